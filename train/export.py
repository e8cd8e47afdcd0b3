"""Publish a trained head: copy a `python -m train` checkpoint without optimizer/loop state, plus its record.

    python -m train.export logs/train/runs/<run>/checkpoints/best.ckpt models/weights/heads/disco_mbpp.ckpt

The copy keeps exactly what `models.heads.load_head` reads (the `specstop` entry and the head's weights), so decode
and eval use it like the original; a SpecDec++ checkpoint shrinks from ~12 MB to ~4 MB. Next to it goes <name>.json,
the form of the shipped heads' records (models/weights/heads/*.json): `command` (the training run's command line,
from its .hydra/hydra.yaml), `export` (this command) and the run's results.json (test metrics, threshold, data). The
trace folders the head was trained and tested on are recorded in the copy (`specstop.traces`), so
`python -m eval ckpt=<copy>` finds them once the run's logs are gone. argparse, not Hydra: a file copy from one path to
another, with nothing to configure."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
from pathlib import Path

import torch
from omegaconf import OmegaConf

from data_gen.contract import HEAD_SPLITS, default_trace_folder, training_config
from models.heads import CKPT_KEY, load_head
from utils.cli import UserError, fail
from utils.files import atomic_write


def export(src: Path, dst: Path) -> Path:
    load_head(src)  # refuses anything that is not a head checkpoint, with one line
    ckpt = torch.load(src, map_location="cpu", weights_only=False)
    meta = dict(ckpt[CKPT_KEY])
    if training_config(src) is not None:
        meta["traces"] = {split: str(default_trace_folder(src, ckpt, split, None)) for split in HEAD_SPLITS}
    slim = {CKPT_KEY: meta, "state_dict": {k: v for k, v in ckpt["state_dict"].items() if k.startswith("head.")}}
    atomic_write(dst, lambda tmp: torch.save(slim, tmp))
    results = src.parent.parent / "results.json"
    if results.is_file():
        command = train_command(src)
        record = {**({"command": command} if command else {}),
                  "export": " ".join(["python -m train.export", shlex.quote(str(src)), shlex.quote(str(dst))]),
                  **json.loads(results.read_text())}
        dst.with_suffix(".json").write_text(json.dumps(record, indent=2))
    for png in ("roc.png", "pr.png"):
        if (src.parent / png).is_file():
            shutil.copyfile(src.parent / png, dst.with_suffix(f".{png}"))
    return dst


def train_command(ckpt: Path) -> str | None:
    """The command line of the training run a checkpoint comes from (`python -m train` + its Hydra overrides, from
    `<run dir>/.hydra/hydra.yaml`); None when the run left no Hydra record."""
    for parent in list(ckpt.resolve().parents)[:3]:
        path = parent / ".hydra" / "hydra.yaml"
        if path.is_file():
            overrides = OmegaConf.load(path).hydra.overrides
            args = [a for a in [*overrides.hydra, *overrides.task] if not str(a).startswith("hydra.mode=")]
            return " ".join(["python -m train", *(shlex.quote(str(a)) for a in args)])
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    args = ap.parse_args()
    print(export(args.src, args.dst))


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        fail(str(err))
