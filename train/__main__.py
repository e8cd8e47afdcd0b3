"""`python -m train +experiment=NAME`: traces (generated first if missing) → stop head → test metrics, curves, results.

What the job does and writes (results.json, the checkpoint with its ROC/PR plots, CSV and offline W&B logs):
train/job.py, whose `run` this entry calls after composing the config.
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
