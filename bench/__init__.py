"""Measurements behind the numbers in README.md and results/: `python -m bench.<script> key=value ...`.

Each script is a Hydra entry like the stages (`utils.cli.hydra_entry` on conf/bench/<script>.yaml, so a mistyped
key or a missing file is one error line), imports the packages normally, and writes
results/bench/<name>.{json,md,png} unless its `out_dir` says otherwise (the stop-head probes write beside the study
they extend, results/stop_heads). Relative paths in their configs resolve against the repository root, so a script
reads and writes the same files wherever it is launched from. No stage imports this package (tests/test_layers.py).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def repo_path(path) -> Path:
    """`path` as given when absolute, else under the repository root."""
    p = Path(str(path)).expanduser()
    return p if p.is_absolute() else REPO / p


def interleaved_median_us(fns: dict, repeats: int, warmup: int) -> dict:
    """Median µs per call of each zero-argument function in `fns`: `warmup` untimed calls of each first, then
    `repeats` rounds timing each once in turn, so a shared machine's drift hits them alike."""
    import statistics
    import time

    for f in fns.values():
        for _ in range(warmup):
            f()
    ts = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            ts[k].append(1e6 * (time.perf_counter() - t))
    return {k: statistics.median(v) for k, v in ts.items()}


def write_result(out_dir, stem: str, result: dict, lines, key: str | None = None, keep=None,
                 md_stem: str | None = None) -> dict:
    """The one way a bench script writes its result: `<stem>.json` (the numbers) and `<md_stem or stem>.md` (its
    table) under `out_dir` (relative: under the repository), each replaced atomically, and the table printed.

    `key` (a machine's name, or machine and dtype): the json holds one entry per key, so runs on different CPUs
    sit side by side; `result` replaces the entry under `key`, an older entry stays where `keep(entry)` is true
    (all when `keep` is None), and `lines` is a function of all entries. Otherwise `lines` is the table's lines.
    Returns what the json holds."""
    import json

    from utils.files import read_json, write_text_atomic

    out = repo_path(out_dir)
    data = result
    if key is not None:
        old = read_json(out / f"{stem}.json") or {}
        data = {k: v for k, v in old.items() if keep is None or keep(v)}
        data[key] = result
    table = lines(data) if callable(lines) else lines
    write_text_atomic(out / f"{stem}.json", json.dumps(data, indent=1, default=str) + "\n")
    write_text_atomic(out / f"{md_stem or stem}.md", "\n".join(table) + "\n")
    print("\n".join(table))
    return data


def command(script: str) -> str:
    """The command line that made a bench result (`python -m bench.<script> <overrides>`), recorded in its json and md."""
    from utils.cli import command as stage_command

    return stage_command(f"bench.{script}")


def ablation_variants(cfg, script: str) -> dict:
    """{variant: its overrides} of an ablation bench's `variants` (conf/bench/<script>.yaml `variant_overrides`);
    one error line naming the unknown ones."""
    from omegaconf import OmegaConf

    from utils.cli import UserError

    known = OmegaConf.to_container(cfg.variant_overrides, resolve=True)
    unknown = [v for v in cfg.variants if v not in known]
    if unknown:
        raise UserError(f"variants {unknown} are not defined; known: {sorted(known)} (conf/bench/{script}.yaml)")
    return {str(v): known[v] for v in cfg.variants}


def compose_stage(config_name: str, overrides: list[str]):
    """A stage's composed config (conf/<config_name>.yaml with `overrides`), from inside a bench's Hydra run (which
    already initialised Hydra on conf/) or outside one."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from utils.cli import CONF_DIR

    if GlobalHydra.instance().is_initialized():
        return compose(config_name, overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name, overrides)
