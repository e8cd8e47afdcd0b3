"""The decoding benchmark (`python -m decode`): from the config to the files, by mode.

`mode=run` decodes `split` with every listed method (decode.run); `mode=sweep` runs every point of `tune.grid` for
the listed policies as its own row on `split` (a K sweep, an h sweep) and chooses nothing; `mode=tune` chooses each
policy's free parameters on `tune.split` (validation) by `tune.metric` (decode.tune), writes `tuned.json`, and then
evaluates the chosen settings on `tune.eval_split` (test) — thresholds are never tuned on test. decode.report
writes the tables, plots and files; this module only reads the config, loads the pair and calls them.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from decode import wandb_log
from decode.methods import Method, methods_from_cfg
from decode.policies import build_policy
from decode.report import markdown_table, task_table, write_outputs
from decode.run import Decoding, SplitResult, check_settings, run_split
from decode.tune import choose, tune_grid
from models.cost import machine
from models.profiling import get_profile
from models.pair import draft_files
from utils.cli import UserError
from utils.files import write_text_atomic


def main(cfg: DictConfig) -> dict:
    check_settings(cfg)
    methods = methods_from_cfg(cfg)
    mode = str(cfg.get("mode", "run"))
    if mode not in ("run", "tune", "sweep"):
        raise UserError(f"mode must be run, tune or sweep, got '{mode}'")
    threads = cfg.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    torch.manual_seed(int(cfg.seed))
    from models.pair import load_pair

    pair = load_pair(cfg.pair)
    profile = get_profile(pair, cfg.get("profile"))  # measured once per machine, then cached
    for m in methods:  # a bad checkpoint or parameter fails before any decoding
        build_policy(m.spec, m.params, pair=pair, profile=profile, target=m.target)
    out_dir = Path(cfg.out_dir) if cfg.get("out_dir") else _hydra_dir()
    if mode == "tune":
        return _tune(cfg, pair, profile, methods, out_dir)
    if mode == "sweep":  # every grid point of tune.grid as its own row, on `split`; nothing is chosen
        methods = tune_grid(cfg, methods)
    split = str(cfg.split)
    title = f"{pair.pair_id} · {cfg.dataset.name}/{cfg.split} · T={cfg.temperature} · {cfg.max_new_tokens} new tokens"
    result = _run(cfg, pair, split, methods, profile, f"decode {split}", cfg.get("limit"))
    return _publish(cfg, pair, out_dir, split, result, title, profile)


def _tune(cfg: DictConfig, pair, profile, methods: list[Method], out_dir: Path) -> dict:
    """Decode every grid point on `tune.split`, keep each method's best, write tuned.json, then evaluate the chosen
    settings on `tune.eval_split` (if set)."""
    grid = tune_grid(cfg, methods, untuned=False)
    if not grid:
        raise UserError(f"mode=tune: none of {[m.key for m in methods]} has a grid in tune.grid; "
                        f"gridded: {sorted(OmegaConf.to_container(cfg.tune.grid) or {})}")
    metric, tune_split = str(cfg.tune.metric), str(cfg.tune.split)
    tuning = _run(cfg, pair, tune_split, grid, profile, f"tune on {tune_split}", cfg.tune.get("limit", cfg.get("limit")))
    chosen = choose(tuning.summary, methods, grid, metric)
    tuned = {m.key: m.params for m in chosen}
    out_dir.mkdir(parents=True, exist_ok=True)
    info = run_info(cfg, pair, tune_split, tuning.summary, profile)
    write_outputs(out_dir, tuning.summary, tuning.rows, info, f"tuning on {tune_split} (metric {metric})", False,
                  prefix="tune_")
    wandb_log.log_result(tuning.summary, info, out_dir, prefix="tune", tuned=tuned)
    write_text_atomic(out_dir / "tuned.json", json.dumps({"metric": metric, "split": tune_split, "chosen": tuned},
                                                         indent=2))
    print(markdown_table(tuning.summary, f"tuning on {tune_split}"))
    print("chosen:", json.dumps(tuned))
    if not cfg.tune.get("eval_split"):
        return tuning.summary
    split = str(cfg.tune.eval_split)
    result = _run(cfg, pair, split, chosen, profile, f"eval on {split}", cfg.get("limit"))
    return _publish(cfg, pair, out_dir, split, result,
                    f"{pair.pair_id} · {cfg.dataset.name}/{split} · tuned on {tune_split}", profile)


def _run(cfg: DictConfig, pair, split: str, methods: list[Method], profile, desc: str, limit) -> SplitResult:
    """The prompts of `split` (the tuning split may use its own `tune.dataset`, e.g. one prompt per Spec-Bench
    task), decoded by decode.run."""
    from data_gen.prompts import load_prompts

    dataset = cfg.dataset
    if split == str(cfg.tune.split) and cfg.get("mode") == "tune" and cfg.tune.get("dataset"):
        dataset = OmegaConf.merge(dataset, cfg.tune.dataset)
    prompts = load_prompts(dataset, split, None if limit is None else int(limit))
    return run_split(pair, prompts, methods, profile, Decoding.from_cfg(cfg), desc)


def run_info(cfg: DictConfig, pair, split: str, summary: dict, profile=None) -> dict:
    """run.json: the settings, machine and cost profile a split ran with."""
    tuning = cfg.get("mode") == "tune" and split == str(cfg.tune.split)
    return {
        "pair": pair.pair_id, "draft": OmegaConf.to_container(cfg.pair.draft, resolve=True),
        "draft_files": draft_files(cfg.pair),  # which draft: its files' content hashes (models.pair.draft_files)
        "dataset": str(cfg.dataset.name), "split": split,
        "limit": cfg.tune.get("limit", cfg.get("limit")) if tuning else cfg.get("limit"),
        "max_new_tokens": int(cfg.max_new_tokens), "temperature": float(cfg.temperature), "top_p": float(cfg.top_p),
        "seed": int(cfg.seed), "device": str(pair.device), "dtype": str(pair.dtype), "linear": pair.linear,
        "forward": pair.forwards, "batch_size": 1,
        "torch_threads": torch.get_num_threads(), "measured_c": summary["target"].get("measured_c"),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
        "policies": [str(p) for p in cfg.policies], "tuned": cfg.get("tuned"),
        "drafters": [str(d) for d in cfg.drafters] if cfg.get("drafters") else None,
        "params": {k: v.get("params") for k, v in summary.items() if isinstance(v, dict) and v.get("params")},
        "cost_profile": profile.to_dict() if profile is not None else None,
    }


def _publish(cfg, pair, out_dir: Path, split: str, result: SplitResult, title: str, profile) -> dict:
    """Write a run's outputs (summary, per-prompt rows, run info, plots), log them to W&B and print its tables."""
    info = run_info(cfg, pair, split, result.summary, profile)
    write_outputs(out_dir, result.summary, result.rows, info, title, bool(cfg.get("plots", True)),
                  by_task=result.by_task)
    wandb_log.log_result(result.summary, info, out_dir, by_task=result.by_task)  # no-op unless logger=wandb
    print(markdown_table(result.summary, title))
    if result.by_task:
        print(task_table(result.by_task, title))
    print(f"wrote {out_dir}/summary.json")
    return result.summary


def _hydra_dir() -> Path:
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001 - called outside Hydra
        return Path("logs/decode/latest")
