"""`python -m decode.profile pair=NAME [threads=N] [profile.refresh=true] [out=FILE]`: print (and optionally save)
the measured cost profile of a pair on this machine — t_draft(n), t_target(n), prefills (models/cost.py) — the curve
decode's cost model, `mode=tune`, `eval.replay` and the stop rules read. Measured once per machine, then cached."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig

from models.cost import CostProfile
from models.profiling import get_profile
from utils.cli import hydra_entry


@hydra_entry("profile")
def main(cfg: DictConfig) -> CostProfile:
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    from models.pair import load_pair

    pair = load_pair(cfg.pair)
    prof = get_profile(pair, cfg.get("profile"))
    print(prof.summary())
    if cfg.get("out"):
        out = Path(str(cfg.out))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(prof.to_dict(), indent=1))
        print(f"wrote {out}")
    return prof


if __name__ == "__main__":
    main()
