"""Decode methods: what `policies` (with `policy.<name>.*` and a `tuned.json`) makes of the config.

A *method* is one row of the decode tables: `Method.key` is its name there (`svip`, `learned`, or
`learned:<ckpt stem>` beside another head, `svip[h=0.3]` for a grid point), `Method.spec` the stop policy it runs
(`svip`, `learned:PATH`), `Method.params` that policy's constructor parameters, `Method.target` its class (found by
name once, on the config's search path, so a policy from a user's conf dir needs no second look-up),
`Method.drafter` the drafter it runs on (decode.drafter; None: the policy's own, the student's chain or the tree
a builder grows). With `drafters=[a,b]` every drafter is paired with every policy it runs, keyed `a/<policy key>`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from decode.policies import StopPolicy, parse_spec, policy_class, policy_config, policy_target, split_spec
from utils.cli import UserError


@dataclass
class Method:
    key: str  # the name in summary.json
    spec: str  # policy spec (`svip`, `learned:PATH`)
    params: dict  # constructor parameters
    target: str | None = None  # the policy class (its yaml's `_target_`), found by name on the config's search path
    drafter: str | None = None  # conf/drafter/<name>.yaml; None: the student's, handing trees etc. on (decode.drafter)
    drafter_params: dict | None = None  # that yaml's parameters, `drafter.<name>.*` merged over

    @property
    def policy_class(self) -> type[StopPolicy]:
        """The class this method's policy is built from: what decode, the replay and the bar ask about it."""
        if self.target is None:  # a method made by hand (tests): found by name on conf/
            return policy_class(parse_spec(self.spec)[0])
        from hydra.utils import get_class

        return get_class(self.target)


def policy_params(name: str, cfg: DictConfig) -> dict:
    """A policy's constructor parameters: conf/policy/<name>.yaml (less `_target_`) with `policy.<name>.*` merged
    over it — the yaml is read here, for the listed policies only, so decode.yaml lists none of them."""
    base = {k: v for k, v in (policy_config(name, cfg) or {}).items() if k != "_target_"}
    over = cfg.get("policy") or {}
    if name not in over:
        return base
    return OmegaConf.to_container(OmegaConf.merge(base, OmegaConf.to_container(over[name], resolve=True)), resolve=True)


def methods_from_cfg(cfg: DictConfig) -> list[Method]:
    """`policies` entries → methods with their params (conf/policy/<name>.yaml merged with `policy.<name>.*`)."""
    specs = [str(s) for s in cfg.policies]
    parsed = [parse_spec(s, cfg) for s in specs]
    names = [name for name, _ in parsed]
    out = []
    for spec, (name, path) in zip(specs, parsed):
        if name == "target":
            continue  # target-only always runs
        params, target = policy_params(name, cfg), policy_target(name, cfg)
        if policy_class(name, cfg).learned:
            path = path or params.get("ckpt") or cfg.get("policy_ckpt")
            spec = f"{name}:{path}" if path else name
        key = name if names.count(name) == 1 else f"{name}:{Path(path).stem}" if path else spec
        out.append(Method(key, spec, params, target))
    keys = [m.key for m in out]
    if len(set(keys)) != len(keys):
        raise UserError(f"policies lists a method twice: {keys}")
    if cfg.get("drafters"):
        out = with_drafters(out, cfg)
    if cfg.get("tuned"):
        out = apply_tuned(out, Path(str(cfg.tuned)))
    if float(cfg.temperature) > 0:
        greedy_only = [m for m in out if m.policy_class.greedy_only]
        if greedy_only:
            name, why = split_spec(greedy_only[0].spec)[0], ""
            if greedy_only[0].policy_class.oracle:
                why = " (its lookahead is the target's greedy output)"
            raise UserError(f"the {name} policy is greedy-only{why}; use temperature=0 or drop {name} from policies")
    return out


def method_entry(table: dict, key: str, name: str, ckpt=None) -> dict | None:
    """A method's entry in a per-method table written by another run (tuned.json's `chosen`, a summary.json): by its
    key, else by `<name>:<ckpt file stem>` — a head is keyed `learned` when listed alone and `learned:<file stem>`
    beside another head, so the same head can carry either key — each also without its `drafter/` prefix."""
    drafter, _, bare = key.rpartition("/")  # `drafter/<key>` in a run with drafters (with_drafters)
    alt = f"{name}:{Path(str(ckpt)).stem}" if ckpt else None
    for k in (key, bare, alt and f"{drafter}/{alt}" if drafter else None, alt):
        if k and k in table:  # a table from a run without drafters serves each drafter's method of that key
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
    found = {m.key: method_entry(chosen, m.key, *split_spec(m.spec)) for m in methods}
    if not any(v is not None for v in found.values()):
        raise UserError(f"tuned={path} tunes {sorted(chosen)}, none of this run's methods {[m.key for m in methods]}")
    return [replace(m, params={**m.params, **(found[m.key] or {})}) for m in methods]


def with_drafters(methods: list[Method], cfg: DictConfig) -> list[Method]:
    """Every listed drafter × every method whose policy it runs (decode.drafter.runner_of), keyed
    `drafter/<method key>`; a pairing that does not go together is left out with one line saying why."""
    from decode.drafter import runner_of

    out = []
    for name in [str(d) for d in cfg.drafters]:
        over = (cfg.get("drafter") or {}).get(name)
        params = OmegaConf.to_container(over, resolve=True) if over is not None else None
        for m in methods:
            runner, why = runner_of(name, m.policy_class, cfg, split_spec(m.spec)[1])
            if runner is None:
                print(f"drafters: {name}/{m.key} left out: {why}")
                continue
            out.append(replace(m, key=f"{name}/{m.key}", drafter=name, drafter_params=params))
    if not out:
        raise UserError(f"drafters={list(cfg.drafters)} run none of policies={list(cfg.policies)}")
    return out
