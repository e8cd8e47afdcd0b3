"""Find a config by name on Hydra's search path, and the class its `_target_` names.

How the stages find what a user can add without touching code elsewhere: a stop policy is `conf/policy/<name>.yaml`
(decode.policies), a head family `conf/model/<name>.yaml` (models.heads). The file's name is the thing's name and its
`_target_` the class, so a new one is a class plus a yaml — no registry to keep in step.

The search path is Hydra's: conf/ plus what `hydra.searchpath=[file:///DIR]` adds (a user's own conf dir holding
`policy/<name>.yaml` makes that policy known by name). It is read from the running Hydra app, or from a config
composed with `return_hydra_config=True` (its `hydra.runtime.config_sources`); otherwise it is conf/ alone.
"""

from __future__ import annotations

import importlib
import importlib.resources
from pathlib import Path

from omegaconf import OmegaConf

from utils.cli import CONF_DIR, UserError


_HYDRA_PATH: list = [None, None]  # (the Hydra config object it was read from, the search path read)


def search_path(cfg=None) -> list:
    """Config folders in Hydra's search order (file:// folders and pkg:// packages), conf/ always among them.
    Without `cfg`, the running Hydra job's, read once per job config: decode's learned tree builders resolve their
    node groups by it on every tree level, and reading it through OmegaConf cost ~0.7 ms a time (half the builder's
    own work on EAGLE-3's trees, 2026-11-29)."""
    if cfg is None:
        from hydra.core.hydra_config import HydraConfig

        now = HydraConfig.instance().cfg  # a new object whenever Hydra sets a config
        if _HYDRA_PATH[0] is not now or now is None:
            _HYDRA_PATH[:] = [now, _search_path(now.hydra.runtime.config_sources if now is not None else None)]
        return list(_HYDRA_PATH[1])
    sources = OmegaConf.select(cfg, "hydra.runtime.config_sources")
    if sources is None:
        return search_path()
    return _search_path(sources)


def _search_path(sources) -> list:
    out = []
    for src in sources or []:
        if src.schema == "file":
            out.append(Path(src.path))
        elif src.schema == "pkg":
            try:
                out.append(importlib.resources.files(src.path.replace("/", ".")))
            except (ModuleNotFoundError, TypeError):
                continue
    if not any(isinstance(p, Path) and p.resolve() == CONF_DIR for p in out):
        out.insert(0, CONF_DIR)
    return out


def names(group: str, cfg=None) -> list[str]:
    """Config names in `group` across the search path, sorted."""
    found = set()
    for root in search_path(cfg):
        folder = root / group
        if folder.is_dir():
            found |= {p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml")}
    return sorted(found)


def find(group: str, name: str, cfg=None):
    """`<group>/<name>.yaml` from the first search-path folder that has it (None: none has)."""
    for root in search_path(cfg):
        path = root / group / f"{name}.yaml"
        if path.is_file():
            return path
    return None


def load(group: str, name: str, cfg=None) -> dict | None:
    """`<group>/<name>.yaml` as a plain dict (None when no folder has it)."""
    path = find(group, name, cfg)
    return None if path is None else read(path)


def read(path) -> dict:
    """A config file as a plain dict (interpolations left as written)."""
    return OmegaConf.to_container(OmegaConf.create(path.read_text()), resolve=False) or {}


def shown(path) -> str:
    """A config file's path for a message: relative to the repo for conf/, else as found."""
    try:
        return str(Path(path).resolve().relative_to(CONF_DIR.parent))
    except (TypeError, ValueError):
        return str(path)


def target_class(target, base: type, where: str) -> type:
    """The class a `_target_` names, checked to be a `base`; one UserError line (naming `where`) otherwise."""
    if isinstance(target, type):
        cls = target
    elif not target or not isinstance(target, str):
        raise UserError(f"{where} names no class: give it `_target_: package.module.Class` "
                        f"(a {base.__module__}.{base.__qualname__})")
    else:
        try:
            cls = _import(target)
        except (ImportError, AttributeError, ValueError) as err:
            raise UserError(f"{where}: cannot import `_target_: {target}` ({type(err).__name__}: {err})") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise UserError(f"{where}: `_target_: {target}` is not a {base.__module__}.{base.__qualname__}")
    return cls


def _import(path: str):
    """The object at a dotted path (`package.module.Class`, nested names allowed): the longest importable module
    prefix, then attributes. Hydra's `get_class` does the same but logs an error before raising, and a refused yaml
    must be one line."""
    parts = path.split(".")
    error: Exception = ValueError(f"'{path}' is not a dotted path")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name is None or not (module == err.name or module.startswith(err.name + ".")):
                raise  # the module exists but a module it imports does not: that is the error to show
            error = err
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise error


def build(group: str, cfg, base: type, key: str = "name", what: str | None = None):
    """The `base` instance a config describes (a yaml of `group`, or a dict a checkpoint or manifest stored), built
    by `hydra.utils.instantiate` from its `_target_`. A config without one (stored before the key existed) is looked
    up by its `key` (the thing's name) in `<group>/<name>.yaml`. `what` names the thing in the one error line."""
    from hydra.utils import instantiate
    from omegaconf import DictConfig

    params = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg or {})
    name = params.get(key)
    what = what or f"{group} '{name}'"
    if not params.get("_target_"):
        found = load(group, str(name)) if name is not None else None
        if not found or not found.get("_target_"):
            raise UserError(f"unknown {what}; known: {', '.join(names(group))}")
        params["_target_"] = found["_target_"]
    cls = target_class(params["_target_"], base, f"{group}={name}")
    params["_target_"] = f"{cls.__module__}.{cls.__qualname__}"
    return instantiate(params)
