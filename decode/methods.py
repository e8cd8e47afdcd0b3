"""Decode methods: what `policies` (with `policy.<name>.*` and a `tuned.json`) makes of the config.

A *method* is one row of the decode tables: `Method.key` is its name there (`svip`, `learned`, or
`learned:<ckpt stem>` beside another head, `svip[h=0.3]` for a grid point), `Method.spec` the stop policy it runs
(`svip`, `learned:PATH`), `Method.params` that policy's constructor parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from decode.policies import HEAD_POLICIES, parse_spec
from utils.cli import UserError


@dataclass
class Method:
    key: str  # the name in summary.json
    spec: str  # policy spec (`svip`, `learned:PATH`)
    params: dict  # constructor parameters


def methods_from_cfg(cfg: DictConfig) -> list[Method]:
    """`policies` entries → methods with their params (conf/policy/<name>.yaml merged with `policy.<name>.*`)."""
    specs = [str(s) for s in cfg.policies]
    names = [parse_spec(s)[0] for s in specs]
    out = []
    for spec, name in zip(specs, names):
        if name == "target":
            continue  # target-only always runs
        params = OmegaConf.to_container(cfg.policy[name], resolve=True) if name in cfg.get("policy", {}) else {}
        path = parse_spec(spec)[1]
        if name in HEAD_POLICIES:
            path = path or params.get("ckpt") or cfg.get("policy_ckpt")
            spec = f"{name}:{path}" if path else name
        key = name if names.count(name) == 1 else f"{name}:{Path(path).stem}" if path else spec
        out.append(Method(key, spec, params))
    keys = [m.key for m in out]
    if len(set(keys)) != len(keys):
        raise UserError(f"policies lists a method twice: {keys}")
    if cfg.get("tuned"):
        out = apply_tuned(out, Path(str(cfg.tuned)))
    if float(cfg.temperature) > 0:
        bad = [m.key for m in out if parse_spec(m.spec)[0] == "oracle"]
        if bad:
            raise UserError("the oracle policy is greedy-only (its lookahead is the target's greedy output); "
                            "use temperature=0 or drop oracle from policies")
    return out


def method_entry(table: dict, key: str, name: str, ckpt=None) -> dict | None:
    """A method's entry in a per-method table written by another run (tuned.json's `chosen`, a summary.json): by its
    key, else by `<name>:<ckpt file stem>` — a head is keyed `learned` when listed alone and `learned:<file stem>`
    beside another head, so the same head can carry either key."""
    for k in (key, f"{name}:{Path(str(ckpt)).stem}" if ckpt else None):
        if k in table:
            return table[k]
    return None


def apply_tuned(methods: list[Method], path: Path) -> list[Method]:
    """Parameters chosen by an earlier `mode=tune` run (its tuned.json), matched by method key: how a setting tuned
    on one dataset's validation split is carried to another test set (MBPP → HumanEval). Methods the file does not
    name keep their configured parameters; run.json records the parameters every method ran with."""
    if not path.is_file():
        raise UserError(f"tuned={path}: no such file; pass the tuned.json written by a `mode=tune` run")
    try:
        chosen = json.loads(path.read_text())["chosen"]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"tuned={path} is not a tuned.json from `python -m decode mode=tune`") from None
    found = {m.key: method_entry(chosen, m.key, *parse_spec(m.spec)) for m in methods}
    if not any(v is not None for v in found.values()):
        raise UserError(f"tuned={path} tunes {sorted(chosen)}, none of this run's methods {[m.key for m in methods]}")
    return [Method(m.key, m.spec, {**m.params, **(found[m.key] or {})}) for m in methods]
