"""One W&B run per job, the same way in every stage (`logger=wandb`, conf/logger/wandb.yaml).

Offline by default (`logger.wandb.mode=offline`; the run lands under `<job folder>/wandb/offline-run-*`, uploaded
later with `wandb sync`). A Hydra multirun gives one run per job, all in one W&B group named after the sweep folder,
so a sweep reads as one group; the job's overrides name the run. W&B trouble never stops a job: it warns and the
job's files are written as always. train uses `sweep_names`/`finish` with Lightning's WandbLogger; decode and
eval.replay use `start`/`finish` through decode.wandb_log.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def settings(cfg: DictConfig) -> dict | None:
    """The `logger.wandb` block ({project, entity, mode, tags}), or None when W&B is off (`logger=none|csv`)."""
    wcfg = (cfg.get("logger") or {}).get("wandb")
    if not wcfg:
        return None
    return OmegaConf.to_container(wcfg, resolve=True) if isinstance(wcfg, DictConfig) else dict(wcfg)


def group_name(task_name: str, sweep_dir) -> str:
    """The W&B group of every job of one multirun (and of its sweep-level run)."""
    return f"{task_name}-{Path(str(sweep_dir)).name}"


def sweep_names(cfg: DictConfig, run_dir: Path) -> tuple[str | None, str]:
    """W&B group = the multirun folder (one group per sweep), name = job number + overrides; plain runs: no group."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            overrides = ",".join(hc.overrides.task) or "default"
            return group_name(cfg.task_name, hc.sweep.dir), f"{hc.job.num}:{overrides}"[:120]
    except Exception:  # noqa: BLE001 - not under Hydra (tests call the job functions directly)
        pass
    return None, Path(run_dir).name


def start(cfg: DictConfig, run_dir: Path, job_type: str, group: str | None = None, name: str | None = None):
    """Start this job's W&B run under `run_dir` (None when W&B is off or cannot start: a warning, never a failure)."""
    wcfg = settings(cfg)
    if wcfg is None:
        return None
    try:
        import wandb

        mode = str(wcfg.get("mode") or "offline")
        os.environ["WANDB_MODE"] = mode
        os.environ.setdefault("WANDB_SILENT", "true")
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        os.environ["WANDB_DIR"] = str(run_dir)  # per job: a multirun must not reuse job 0's folder
        auto_group, auto_name = sweep_names(cfg, run_dir)
        finish()  # a previous job of this process (basic launcher) that did not close its run
        return wandb.init(project=str(wcfg.get("project") or "specstop"), entity=wcfg.get("entity"), mode=mode,
                          dir=str(run_dir), job_type=job_type, group=group or auto_group, name=name or auto_name,
                          tags=list(wcfg.get("tags") or []), config=OmegaConf.to_container(cfg, resolve=True))
    except Exception as err:  # noqa: BLE001 - W&B trouble never loses a job's results
        warnings.warn(f"W&B disabled for this run ({type(err).__name__}: {err}); the run's files are still written",
                      stacklevel=1)
        return None


def finish(exit_code: int | None = None) -> None:
    """Close the current W&B run (in `finally`, so every job of a multirun gets its own complete run)."""
    try:
        import wandb

        if wandb.run is not None:
            wandb.finish(exit_code=exit_code)
    except Exception:  # noqa: BLE001
        pass
