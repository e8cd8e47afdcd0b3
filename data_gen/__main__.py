"""`python -m data_gen pair=NAME dataset=NAME trace=target_ar|interleaved split=train limit=N batch_size=B trace_root=DIR`

Makes (or resumes, or reuses) the trace folder for those settings and prints a summary. `verify=true` checks a
sharded output is complete instead (the merge step after `shard_id/num_shards` jobs, e.g. a SLURM multirun).
"""

from __future__ import annotations

from omegaconf import DictConfig

from data_gen.run import generate, verify_cmd
from utils.cli import hydra_entry


@hydra_entry("data_gen")
def main(cfg: DictConfig) -> None:
    if cfg.get("verify"):
        verify_cmd(cfg, str(cfg.split))
    else:
        generate(cfg, str(cfg.split))


if __name__ == "__main__":
    main()
