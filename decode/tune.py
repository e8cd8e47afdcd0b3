"""Tuning: the grid points of `tune.grid`, the best point per method, and carrying chosen parameters to other runs.

`mode=sweep` runs every grid point as its own row and chooses nothing; `mode=tune` runs them on `tune.split`
(validation), keeps each method's best by `tune.metric` (`choose`) and writes `tuned.json`, which `tuned=FILE`
applies to a later run (decode.methods.apply_tuned). Thresholds are never tuned on test.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from omegaconf import DictConfig, OmegaConf

from decode.methods import Method
from decode.policies import split_spec


def tune_grid(cfg: DictConfig, methods: list[Method], untuned: bool = True) -> list[Method]:
    """Every grid point of `tune.grid.<policy>` for the listed policies; the others once with their params
    (`untuned=False` leaves them out: tuning has nothing to choose for them). A grid is a product space
    ({param: [values]}) whose optional `also` adds the points of more product spaces (e.g. thresholds, plus (a, b)
    under another rule; repeats dropped); see `product_spaces`."""
    grid = OmegaConf.to_container(cfg.tune.grid, resolve=True) or {}
    out = []
    for m in methods:
        name = split_spec(m.spec)[0]
        spaces = grid.get(name) or {}
        if not spaces:
            if untuned:
                out.append(m)
            continue
        seen = set()
        for space in product_spaces(spaces):
            keys = list(space)
            for values in itertools.product(*(space[k] for k in keys)):
                point = dict(zip(keys, values))
                label = ",".join(f"{k}={v}" for k, v in point.items())
                if label not in seen:
                    seen.add(label)
                    out.append(replace(m, key=f"{m.key}[{label}]", params={**m.params, **point}))
    return out


def product_spaces(space) -> list[dict]:
    """A `tune.grid.<policy>` entry as a list of product spaces: the entry without `also`, then what `also` holds
    (one space or a list; nested `also`s unfold too). A list is taken as the spaces themselves."""
    if isinstance(space, (list, tuple)):
        return [sp for item in space for sp in product_spaces(item)]
    space = dict(space or {})
    also = space.pop("also", None)
    return ([space] if space else []) + (product_spaces(also) if also else [])


def grid_params(space) -> list[str]:
    """The parameters a `tune.grid.<policy>` entry sweeps."""
    return list(dict.fromkeys(k for sp in product_spaces(space) for k in sp))


def choose(summary: dict, methods: list[Method], grid_methods: list[Method], metric: str) -> list[Method]:
    """Per original method, the grid point with the best `metric` on the tuning split."""
    chosen = []
    for m in methods:
        cands = [g for g in grid_methods if g.key == m.key or g.key.startswith(m.key + "[")]
        if not cands:  # no grid: runs with its configured parameters
            chosen.append(m)
            continue
        best = max(cands, key=lambda g: summary[g.key].get(metric) or float("-inf"))
        chosen.append(replace(m, params=best.params))
    return chosen
