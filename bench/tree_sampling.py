"""Exact sampling with token trees on a real pair: the law of the first two emitted tokens against the target's (χ²).

    python -m bench.tree_sampling [pair=smollm2_135m] [prompts=2] [samples=500] [temperature=1.0]
        ['builders=[eagle2,sequoia,tree_static]'] [out_dir=results/bench]

Per prompt (the dataset's test split) and builder: `samples` speculative generations of two tokens at `temperature`,
each with its own seed. Their (x1, x2) counts are compared with the target's exact law p(x1)·p(x2 | x1), computed
from target forwards (the prompt, and the prompt + x1 for every x1 drawn): Pearson's χ² goodness of fit, cells whose
expected count is under 5 pooled into one, and the same test on x1 alone. The second token is the one that tests the
tree walk: it is emitted after an accepted node (or from the residual at a rejection), where a wrong rule for
siblings or for the residual shows. A lossless sampler passes at any N (the p-values are uniform); a biased one fails
as N grows. `pass` = every p-value above 1e-3 / the number of tests (Bonferroni); a test with fewer than two cells
at this N is not run (—). Writes tree_sampling.{json,md}.
"""

from __future__ import annotations

import time
from collections import Counter

import torch
from omegaconf import DictConfig
from scipy.stats import chisquare
from tqdm.auto import tqdm

from bench import command, compose_stage, write_result
from utils.cli import UserError, hydra_entry


def target_law(pair, ids: list[int], temperature: float, firsts) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """p(x1) after the prompt and p(x2 | x1) for each x1 in `firsts`, through the decoder's own target call."""
    from models.distributions import draft_probs
    from models.lm import LM

    lm = LM.of(pair, "target")

    @torch.inference_mode()
    def next_probs(seq):
        logits, _ = lm(seq, lm.new_cache(), 1)
        return draft_probs(logits[0], temperature).double().cpu()

    return next_probs(ids), {x: next_probs(ids + [x]) for x in firsts}


def gof(observed: Counter, expected: dict, n: int) -> dict:
    """Pearson χ² of `observed` counts against `expected` probabilities (over every outcome); cells expecting < 5
    pooled into one (with everything never drawn)."""
    big = {k: p * n for k, p in expected.items() if p * n >= 5}
    obs = [observed.get(k, 0) for k in big]
    exp = list(big.values())
    rest_obs, rest_exp = n - sum(obs), n - sum(exp)
    if rest_exp > 1e-9:
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif rest_obs:  # an outcome of probability ~0 was drawn
        return {"chi2": float("inf"), "dof": len(obs) - 1, "p_value": 0.0, "cells": len(obs)}
    if len(obs) < 2:  # every outcome below the floor: nothing to test at this N
        return {"chi2": None, "dof": 0, "p_value": None, "cells": len(obs)}
    scale = sum(obs) / sum(exp)  # float rounding only
    res = chisquare(obs, [e * scale for e in exp])
    return {"chi2": float(res.statistic), "dof": len(obs) - 1, "p_value": float(res.pvalue), "cells": len(obs)}


def pair_law(p1: torch.Tensor, p2: dict[int, torch.Tensor], n: int) -> dict:
    """Expected probabilities of (x1, x2) for the x1 drawn (cells above the pooling floor only matter; the rest of the
    mass is what `gof` pools)."""
    out = {}
    for x1, cond in p2.items():
        joint = float(p1[x1]) * cond
        keep = torch.nonzero(joint * n >= 5).flatten().tolist()
        out.update({(x1, int(x2)): float(joint[x2]) for x2 in keep})
    return out


def run(cfg: DictConfig) -> dict:
    from data_gen.prompts import load_prompts
    from decode.loop import speculative
    from decode.methods import methods_from_cfg
    from decode.policies import build_policy
    from decode.run import tokenize_prompts
    from models.profiling import get_profile
    from models.pair import load_pair

    if not cfg.temperature or float(cfg.temperature) <= 0:
        raise UserError("temperature must be > 0: this bench tests exact sampling (greedy is tested token for token)")
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    pair = load_pair(cfg.pair)
    profile = get_profile(pair, cfg.get("profile"))
    dcfg = compose_stage("decode", [f"policies=[{','.join(map(str, cfg.builders))}]"])
    methods = methods_from_cfg(dcfg)
    not_trees = [m.key for m in methods if not getattr(m.policy_class, "tree", False)]
    if not_trees:
        raise UserError(f"builders {not_trees} are not token-tree builders; pick from eagle2, sequoia, tree_static, ...")
    prompts = load_prompts(cfg.dataset, str(cfg.split), int(cfg.prompts))
    ids_all = tokenize_prompts(pair, prompts, 2)
    n, temp = int(cfg.samples), float(cfg.temperature)
    rows = []
    for pi, ids in enumerate(ids_all):
        for m in methods:
            builder = build_policy(m.spec, m.params, pair=pair, profile=profile, target=m.target)
            firsts, both, nodes = Counter(), Counter(), 0
            for i in tqdm(range(n), desc=f"prompt {pi} {m.key}", leave=False):
                g = torch.Generator().manual_seed(int(cfg.seed) + i)
                res = speculative(pair, ids, builder, 2, temperature=temp, generator=g)
                x1, x2 = res.tokens[0], res.tokens[1]
                firsts[x1] += 1
                both[(x1, x2)] += 1
                nodes += res.rounds[0][0]
            p1, p2 = target_law(pair, ids, temp, sorted(firsts))
            rows.append({"prompt": pi, "builder": m.key, "samples": n, "verified_nodes_first_round": nodes / n,
                         "x1": gof(firsts, {int(k): float(v) for k, v in enumerate(p1) if v * n >= 5}, n),
                         "x1_x2": gof(both, pair_law(p1, p2, n), n)})
    pvals = [r[k]["p_value"] for r in rows for k in ("x1", "x1_x2") if r[k]["p_value"] is not None]
    tests = len(pvals)
    floor = 1e-3 / max(tests, 1)
    result = {"command": command("tree_sampling"), "pair": pair.pair_id, "dtype": str(pair.dtype).removeprefix("torch."),
              "temperature": temp, "dataset": str(cfg.dataset), "split": str(cfg.split), "p_floor": floor,
              "tests": tests, "pass": bool(tests) and all(p > floor for p in pvals), "rows": rows,
              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    lines = [f"`{result['command']}` ({result['date_utc']}; {result['pair']} {result['dtype']}, T = {temp}, "
             f"{n} samples per prompt and builder)", "",
             "| prompt | builder | nodes verified (round 1) | χ² x1 (dof) | p x1 | χ² (x1, x2) (dof) | p (x1, x2) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["x1"], r["x1_x2"]
        cell = lambda t: ("—", "—") if t["p_value"] is None else (f"{t['chi2']:.1f} ({t['dof']})", f"{t['p_value']:.3f}")  # noqa: E731
        lines.append(f"| {r['prompt']} | {r['builder']} | {r['verified_nodes_first_round']:.2f} | "
                     + " | ".join((*cell(a), *cell(b))) + " |")
    lines += ["", f"Every p-value above {floor:.1e} (1e-3 / {tests} tests): **{'pass' if result['pass'] else 'FAIL'}**."]
    write_result(cfg.out_dir, "tree_sampling", result, lines)
    return result


if __name__ == "__main__":
    hydra_entry("bench/tree_sampling")(run)()
