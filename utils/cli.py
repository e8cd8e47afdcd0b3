"""Entry-point plumbing shared by every stage: user errors as one line, config-name checks before Hydra.

A researcher who mistypes `pair=smollm` should read one line that names the problem and the fix, not a stack
trace. Code raises `UserError` for anything the user can fix; `hydra_entry` turns it into that line (exit code 2).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Callable

import hydra

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class UserError(Exception):
    """A mistake in the user's input or setup; the message must say what is wrong and how to fix it."""


def known_names(group: str, extra: tuple[Path, ...] = ()) -> list[str]:
    """Config names available in a conf group (e.g. `pair`, `dataset`, `experiment`), in conf/ and the `extra`
    folders (a user's conf dirs on `hydra.searchpath`)."""
    return sorted({p.stem for root in (CONF_DIR, *extra) for p in (root / group).glob("*.yaml")})


def check_name(group: str, name: str, extra: tuple[Path, ...] = ()) -> Path:
    """Path of `<group>/<name>.yaml` in conf/ or the first `extra` folder that has it, or a UserError listing the
    known names."""
    for root in (CONF_DIR, *extra):
        path = root / group / f"{name}.yaml"
        if path.is_file():
            return path
    sub, _, _ = name.rpartition("/")  # a name in a folder of the group (experiment=study/NAME)
    known = [f"{sub}/{n}" for n in known_names(f"{group}/{sub}", extra)] if sub else known_names(group, extra)
    raise UserError(f"unknown {group} '{name}'; known: {', '.join(known)}")


def argv_search_path(argv: list[str]) -> tuple[Path, ...]:
    """The `file://` folders a command line adds with `hydra.searchpath=[file:///DIR,...]`: where a user's own
    `labels/NAME.yaml`, `trace/NAME.yaml`, `pair/NAME.yaml` ... make NAME known to `group=NAME`."""
    out = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "hydra.searchpath":
            for item in value.strip("[]").split(","):
                item = item.strip().strip("'\"")
                if item.startswith("file://"):
                    out.append(Path(item[len("file://"):]))
    return tuple(out)


def run_stage(args: list[str], what: str, cwd: Path = CONF_DIR.parent) -> None:
    """Run `python -m <stage> ...` (bench scripts that chain stages), printing the command; a failure becomes a
    UserError naming `what` and the stage's last error line."""
    import subprocess

    cmd = [sys.executable, *args]
    print(" ".join(args), flush=True)
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"{what} failed: {tail}")


def command(module: str) -> str:
    """The command line that made a result (`python -m MODULE` + the run's command-line overrides), recorded in the
    files that cite it; outside a Hydra run (tests compose configs directly) there are no overrides."""
    from hydra.core.hydra_config import HydraConfig

    try:
        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:
        overrides = []
    return " ".join([f"python -m {module}", *overrides])


def output_dir(out_dir) -> Path:
    """The folder a stage writes to: `out_dir` when the user set one, else the Hydra run folder."""
    if out_dir:
        return Path(str(out_dir))
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


STUDY_GROUP = "study"  # conf/experiment/study/*.yaml are decoding studies; conf/experiment/*.yaml train heads


def _check_experiment_stage(name: str, config_name: str | None) -> None:
    if config_name not in ("train", "decode", "replay"):  # replay reads a decode study's policies and grids
        return
    is_study = name.startswith(STUDY_GROUP + "/")
    if is_study and config_name == "train":
        raise UserError(f"experiment '{name}' is a decoding study: python -m decode +experiment={name}")
    if not is_study and config_name in ("decode", "replay"):
        studies = ", ".join(f"{STUDY_GROUP}/{n}" for n in known_names(f"experiment/{STUDY_GROUP}"))
        raise UserError(f"experiment '{name}' trains a head: python -m train +experiment={name} "
                        f"(decode studies: {studies})")


def _check_argv_groups(argv: list[str], config_name: str | None = None) -> None:
    """Reject `group=name` overrides whose config file does not exist, before Hydra prints a stack of its own, and
    an experiment meant for the other stage. Names in a user's conf dir (`hydra.searchpath`) count."""
    extra = argv_search_path(argv)
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if "/" in key or "." in key or not any((root / key).is_dir() for root in (CONF_DIR, *extra)):
            continue
        # multirun values come comma-separated: check each
        for name in value.split(","):
            if name and name != "null" and not name.startswith("choice("):
                check_name(key, name, extra)
                if key == "experiment":
                    _check_experiment_stage(name, config_name)


def fail(message: str) -> None:
    """Print one error line and exit with status 2 (a user error, not a crash)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def open_overrides(argv: list[str], open_dicts: tuple[str, ...]) -> list[str]:
    """`KEY.x.y=V` → `++KEY.x.y=V` for a config's open dicts (decode's `policy`): their entries come from files read
    only when needed (conf/policy/<name>.yaml), so the key may not exist at composition and Hydra would refuse a plain
    override; `++` adds it or overrides it. Prefixed (`+`, `++`, `~`) and non-override arguments pass unchanged."""
    out = []
    for arg in argv:
        key = arg.split("=", 1)[0]
        if "=" in arg and not arg.startswith(("-", "+", "~")) and key.split(".")[0] in open_dicts and "." in key:
            arg = "++" + arg
        out.append(arg)
    return out


def hydra_entry(config_name: str, open_dicts: tuple[str, ...] = ()) -> Callable:
    """`@hydra_entry("decode")` = `@hydra.main` on conf/decode.yaml, with user errors reported as one line;
    `open_dicts`: top-level dicts whose entries a plain `KEY.x.y=V` may add (`open_overrides`)."""

    def decorate(task: Callable) -> Callable:
        @functools.wraps(task)
        def guarded(cfg):
            try:
                return task(cfg)
            except UserError as err:
                fail(str(err))

        hydra_main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(guarded)

        @functools.wraps(task)
        def main():
            try:
                _check_argv_groups(sys.argv[1:], config_name)
            except UserError as err:
                fail(str(err))
            sys.argv[1:] = open_overrides(sys.argv[1:], open_dicts)
            return hydra_main()

        return main

    return decorate
