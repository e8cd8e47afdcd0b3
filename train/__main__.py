"""`python -m train +experiment=NAME`: traces (generated first if missing) → stop head → test metrics, curves, results.

One job top to bottom: load or generate the traces for train/validation/test (data_gen; the pair is loaded once and
only if something must be generated), build features and labels (TraceDataModule), fit the head with early
stopping on `val/auroc`, keep the best checkpoint (it carries the threshold chosen on validation and everything
decode needs), reload it with `models.heads.load_head`, test it, and write:

- `results.json` (test/auroc, test/ap, test/f1, test/f1_static_best, threshold, ckpt_path, ...),
- `checkpoints/best.ckpt` with `roc.png` and `pr.png` beside it (and to W&B as plots when W&B is on),
- `csv/` (always) and `wandb/` (offline by default; `wandb sync <run dir>/wandb/offline-run-*` uploads later).

The work lives in train/job.py (`run`); this entry composes the config, calls it and prints.
The run directory is printed on the last line of stdout. The function returns the monitored metric (best
`val/auroc`, or `optimized_metric`), which is what an Optuna sweep (`hparams_search=...`) maximises.
"""

from __future__ import annotations

import math
from pathlib import Path

from omegaconf import DictConfig

from train.job import run
from utils.cli import hydra_entry


@hydra_entry("train")
def main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    results = run(cfg, run_dir)
    print(run_dir, flush=True)
    value = results.get(str(cfg.optimized_metric), math.nan)
    return float(value)


if __name__ == "__main__":
    main()
