"""Publish a trained head: copy a `python -m train` checkpoint without optimizer/loop state, plus its results.json.

    python -m train.export logs/train/runs/<run>/checkpoints/best.ckpt results/heads/disco_mbpp.ckpt

The copy keeps exactly what `models.heads.load_head` reads (the `specstop` entry and the head's weights), so decode
and eval use it like the original; a SpecDec++ checkpoint shrinks from ~12 MB to ~4 MB. The run's results.json (test
metrics, threshold, data) is written next to it as <name>.results.json. The trace folders the head was trained and
tested on are recorded in the copy (`specstop.traces`), so `python -m eval ckpt=<copy>` finds them once the run's
logs are gone. argparse, not Hydra: a file copy from one path to another, with nothing to configure.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from data_gen.store import HEAD_SPLITS, default_trace_folder, training_config
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
        meta = json.loads(results.read_text())
        meta["exported_from"] = str(src)
        dst.with_suffix(".results.json").write_text(json.dumps(meta, indent=2))
    for png in ("roc.png", "pr.png"):
        if (src.parent / png).is_file():
            shutil.copyfile(src.parent / png, dst.with_suffix(f".{png}"))
    return dst


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
