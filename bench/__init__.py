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


def command(script: str) -> str:
    """The command line that made a bench result (`python -m bench.<script> <overrides>`), recorded in its json and md."""
    from utils.cli import command as stage_command

    return stage_command(f"bench.{script}")


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
