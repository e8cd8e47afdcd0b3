"""Where token trees can pay on this machine: the best static tree (Sequoia's DP) against the best chain, predicted
from the pair's measured acceptance-by-rank vector and cost profile (issue 30).

    python -m eval.tree_ceiling [pair=smollm2_135m] [prompts=24] [tokens=96] [max_rank=8] [max_nodes=32]
        [draft=eagle3] [out_dir=results/trees]

1. Acceptance by rank: the target's greedy continuation (decode.loop.autoregressive, `tokens` new tokens, stopping at
   EOS) of the first `prompts` prompts of the split, then one teacher-forced draft pass over prompt + continuation.
   At every continuation position, the 1-based rank of the target's token in the draft's logits (ties counted in its
   favour); a token outside a reduced (FR-Spec) draft vocabulary can never be drafted and counts as `beyond`.
   With draft=eagle3 the draft is the pair's EAGLE-3 draft, ranked by a round's first call (`eagle_logits`) and
   priced by its own draft curves (models.eagle3_pair.draft_profile).
   rank_vector[r-1] = P(rank = r) for r ≤ max_rank; `beyond` = the rest.
2. Costs: the pair's measured profile (models.profiling.get_profile, the cache decode reads; measured when missing).
3. Trees: models.tree_dp, position independence (a rank-r child is accepted with p_r given its parent was).
4. Speedup of a round = (1 + E[accepted]) · t_target(1) ÷ (draft cost + verify cost), `CostProfile.round_steps`:
   a tree's verify = one tree-attention target pass over n + 1 tokens (pending + n nodes; past the profile's
   measured range linear from its last two points, never below the last; the report says when) and its draft = the
   root's call at draft_cold_ms, then one call per level the draft runs on, priced by how many nodes it runs
   (`draft_level_ms`). A chain is priced as decode's chain loop runs it (one-token draft calls, a causal pass).
   Per size n the tree is the depth bound's optimum with the best speedup; the best chain is max over K of
   (1 + p₁ + … + p₁^K) under the chain's costs. The *flat* regime sets t_target(n) = t_target(1) (a GPU's verification
   pass: wide trees are nearly free there), draft costs unchanged.
Writes <out_dir>/ceiling.json and ceiling.md. An upper bound for static trees: acceptance is measured on the target's
own path, and real positions are not independent.
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from models.tree_dp import TreeTable, chain, run_levels, score_tree
from utils.cli import UserError, command, hydra_entry, output_dir
from utils.files import write_text_atomic

REGIMES = ("measured", "flat")


def check(cfg: DictConfig) -> None:
    """Settings the user can get wrong, before any model loads."""
    for key in ("prompts", "tokens", "max_rank", "max_nodes"):
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise UserError(f"{key} must be a positive integer, got {cfg.get(key)!r}; e.g. {key}=8")


# ------------------------------------------------------------------------------------------------ acceptance by rank


@torch.inference_mode()
def target_ranks(pair, prompt_ids: list[int], tokens: int, eagle=None) -> np.ndarray:
    """Rank of each target greedy token in the draft's teacher-forced logits (0: outside the draft's support); with
    `eagle` (an EAGLE-3 draft), in its first-step logits (`eagle_logits`)."""
    from decode.loop import autoregressive
    from models.lm import LM

    cont = autoregressive(pair, prompt_ids, tokens, eos=pair.eos_ids).tokens
    if eagle is not None:
        logits = eagle_logits(pair, eagle, list(prompt_ids) + cont, len(cont))
    else:
        draft = LM.of(pair, "draft")
        logits, _ = draft(list(prompt_ids) + cont[:-1], draft.new_cache(), last=len(cont))
    logits = logits.float()
    picked = logits.gather(1, torch.tensor(cont, device=logits.device)[:, None])
    ranks = 1 + (logits > picked).sum(1)
    return torch.where(torch.isneginf(picked[:, 0]), 0, ranks).cpu().numpy()


def eagle_logits(pair, model, seq: list[int], n: int) -> torch.Tensor:
    """An EAGLE-3 draft's logits (n, vocab; −inf off its subset) for the last n tokens of `seq`, each read as a
    round's first draft call reads it: the target's features at the position two before it and the token between
    (models.eagle3 forward_steps' row i scores token i + 2). A tree's first level; deeper levels read the draft's
    own features, so the rank vector is step 1's (an upper bound for the levels below)."""
    from models.eagle3 import target_features

    x = torch.tensor([seq], device=pair.device)
    feats = target_features(pair.target, x, None, model.cfg.layers).to(next(model.parameters()).dtype)
    h = model.forward_steps(x, feats, 1)[0][0]  # (T − 1, H)
    z = model.logits(h[len(seq) - n - 2 : len(seq) - 2]).float()
    full = torch.full((n, pair.vocab_size), float("-inf"), device=z.device)
    full[:, model.ids.to(z.device)] = z
    return full


def measure_ranks(pair, ids: list[list[int]], tokens: int, eagle=None) -> np.ndarray:
    return np.concatenate([target_ranks(pair, x, tokens, eagle) for x in tqdm(ids, desc="ranks", unit="prompt")])


def rank_vector(ranks: np.ndarray, max_rank: int) -> dict:
    """P(rank = r) for r = 1..max_rank, the remaining mass, and the share outside the draft's vocabulary."""
    n = len(ranks)
    probs = [float(np.mean(ranks == r)) for r in range(1, max_rank + 1)]
    return {"rank_vector": probs, "beyond": max(0.0, 1.0 - sum(probs)), "positions": n,
            "outside_draft_vocab": float(np.mean(ranks == 0))}


# ------------------------------------------------------------------------------------------------ cost model


def costs(prof, max_nodes: int) -> dict:
    """The profile as the report shows it: t_target(n) for n = 1..max_nodes+1 (ms), a cold first draft call and a
    warm one. The speedups themselves are costed by `CostProfile.round_steps`."""
    target = [float(prof.target(n)) for n in range(1, max_nodes + 2)]  # past the measured range: never below the last
    cold = float(prof.cold_ms)
    tree = [prof.tree_target(n) / target[0] for n in range(1, max_nodes + 2)]
    level = [prof.level_draft(n) / float(prof.draft_ms[0]) for n in range(1, max_nodes + 1)]
    return {"target_ms": target, "draft_ms": float(prof.draft_ms[0]), "draft_cold_ms": cold,
            "tree_target_ratio": tree if prof.target_tree_ms else None,
            "level_draft_ratio": level if prof.draft_level_ms else None,
            "target_ratio": [t / target[0] for t in target], "c": float(prof.draft_ms[0]) / target[0],
            "c_cold": cold / target[0], "measured_max_n": len(prof.target_ms),
            "extrapolated": max_nodes + 1 > len(prof.target_ms), "measured": prof.date,
            "other_load_cores": prof.extra.get("other_load_cores")}


def speedup(e: float, n: int, levels: list[int] | None, prof, flat: bool, calls: int = 0) -> float:
    """(1 + E) target steps' tokens per round ÷ the round's cost in target steps: a tree's root draft call, its
    `levels` (nodes per further draft call) and one tree pass over n + 1 tokens, or (levels None) a chain's `calls`
    one-token draft calls and a causal pass; flat: a pass as cheap as a one-token step."""
    v = 0 if flat else n
    return (1.0 + e) / (prof.round_steps(calls, v) if levels is None else prof.round_steps(1 + len(levels), v, levels))


def best_chain(p: list[float], max_nodes: int, prof, flat: bool) -> dict:
    rows = []
    for k in range(1, max_nodes + 1):
        e = score_tree(p, *chain(k))
        rows.append({"k": k, "e": e, "speedup": speedup(e, k, None, prof, flat, calls=k)})
    return max(rows, key=lambda r: r["speedup"])


def best_tree(table: TreeTable, n: int, prof, flat: bool) -> dict:
    """Of the depth-bounded optima of size n, the one with the best predicted speedup."""
    best = None
    for d in range(1, n + 1):
        if table.value(n, d) == float("-inf"):
            continue
        t = table.tree(n, d)
        s = speedup(t.expected_accepted, n, run_levels(t.parents), prof, flat)
        if best is None or s > best["speedup"] + 1e-12:
            best = {"e": t.expected_accepted, "depth": t.depth, "speedup": s, "parents": list(t.parents),
                    "ranks": list(t.ranks)}
    return best


def analyse(rv: dict, prof, max_nodes: int) -> dict:
    """Per size n and regime the speedup-best static tree and its ratio to the regime's best chain."""
    p = rv["rank_vector"]
    table = TreeTable(p, max_nodes)
    chains = {reg: best_chain(p, max_nodes, prof, reg == "flat") for reg in REGIMES}
    sizes = []
    for n in range(1, max_nodes + 1):
        if table.value(n, n) == float("-inf"):
            continue  # more nodes than max_rank ranks allow at any depth (never for n ≤ max_nodes with ranks ≥ 1)
        row = {"n": n, "e_max": table.value(n, n)}
        for reg in REGIMES:
            t = best_tree(table, n, prof, reg == "flat")
            row[reg] = {**t, "vs_chain": t["speedup"] / chains[reg]["speedup"]}
        sizes.append(row)
    best = {reg: max(sizes, key=lambda r: r[reg]["speedup"]) for reg in REGIMES}
    return {"sizes": sizes, "best_chain": chains,
            "best_tree": {reg: {"n": best[reg]["n"], **best[reg][reg]} for reg in REGIMES},
            "static_tree_vs_chain": best["measured"]["measured"]["vs_chain"],
            "static_tree_vs_chain_flat": best["flat"]["flat"]["vs_chain"]}


# ------------------------------------------------------------------------------------------------ report


def markdown(res: dict) -> str:
    c, rv = res["profile"], res  # rv: the rank-vector keys, merged into res
    shown = [n for n in (2, 4, 8, 16, 32, 64) if n <= len(c["target_ratio"])]
    lines = [
        f"`{res['command']}` — pair {res['pair']}, {res['dtype']}, {res['machine']}, {res['date_utc']}.", "",
        f"Acceptance by rank ({rv['positions']} positions of the target's greedy continuations of {res['prompts']} "
        f"{res['dataset']} {res['split']} prompts): "
        + ", ".join(f"p{r + 1} {x:.3f}" for r, x in enumerate(rv["rank_vector"]))
        + f"; beyond {rv['beyond']:.3f} (outside the draft's vocabulary {rv['outside_draft_vocab']:.3f}).",
        f"Cost profile ({c['measured']}): c = {c['c']:.3f} (first draft call of a round {c['c_cold']:.3f}); "
        "t(n)/t(1): " + ", ".join(f"n={n} {c['target_ratio'][n - 1]:.2f}" for n in shown)
        + (f"; past n={c['measured_max_n']} (the measured range) linear from the last two points, never below "
           f"t({c['measured_max_n']})." if c["extrapolated"] else ".")
        + ("" if not c.get("tree_target_ratio") else " Tree rounds: tree-attention pass t(n)/t(1) "
           + ", ".join(f"n={n} {c['tree_target_ratio'][n - 1]:.2f}" for n in shown))
        + ("" if not c.get("level_draft_ratio") else "; a draft call on a level of n nodes ÷ a draft step "
           + ", ".join(f"n={n} {c['level_draft_ratio'][n - 1]:.2f}" for n in shown
                       if n <= len(c["level_draft_ratio"])) + "."), "",
    ]
    for reg, label in (("measured", "measured t(n)"), ("flat", "flat t(n) = t(1)")):
        ch, bt = res["best_chain"][reg], res["best_tree"][reg]
        edge = "the largest size tried; " if bt["n"] == res["max_nodes"] else ""
        lines.append(f"**{label}:** best static tree n={bt['n']} ({edge}depth {bt['depth']}, E={bt['e']:.2f}) "
                     f"{bt['speedup']:.2f}× vs best chain K={ch['k']} (E={ch['e']:.2f}) {ch['speedup']:.2f}× — "
                     f"ratio {bt['vs_chain']:.3f}.")
    lines += ["", "| n | E | depth | speedup | ÷ best chain | E (flat) | depth (flat) | speedup (flat) | "
              "÷ best chain (flat) |", "|---|---|---|---|---|---|---|---|---|"]
    for row in res["sizes"]:
        m, f = row["measured"], row["flat"]
        lines.append(f"| {row['n']} | {m['e']:.2f} | {m['depth']} | {m['speedup']:.2f} | {m['vs_chain']:.3f} | "
                     f"{f['e']:.2f} | {f['depth']} | {f['speedup']:.2f} | {f['vs_chain']:.3f} |")
    lines += ["", "Predicted (cost model, not a clock): per size n the static tree with the best speedup over depth "
              "bounds; speedup = (1 + E) · t(1) ÷ (draft levels + t(n + 1)), a draft level costing one draft call. "
              "Position independence assumed: an upper bound for static trees on this draft.", ""]
    return "\n".join(lines)


def about(cfg: DictConfig, pair) -> dict:
    """What the result was made with (eval.study reads pair, dtype, device, draft, linear, forward for staleness)."""
    from omegaconf import OmegaConf

    from models.cost import machine

    return {"command": command("eval.tree_ceiling"), "pair": pair.pair_id, "dtype": str(pair.dtype).replace("torch.", ""),
            "device": str(pair.device), "draft": OmegaConf.to_container(pair.cfg.draft, resolve=True),
            "linear": pair.linear, "forward": pair.forwards, "threads": torch.get_num_threads(),
            "machine": machine(), "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "dataset": str(cfg.dataset.name), "split": str(cfg.split), "prompts": int(cfg.prompts),
            "tokens": int(cfg.tokens), "max_rank": int(cfg.max_rank), "max_nodes": int(cfg.max_nodes),
            "draft": str(cfg.get("draft", "student"))}


def eagle_draft(pair, cfg: DictConfig):
    """(the pair's EAGLE-3 draft, its weights' path) for draft=eagle3; one error line for another draft."""
    if cfg.draft != "eagle3":
        raise UserError(f"draft={cfg.draft}: eval.tree_ceiling measures the pair's own draft (draft=student) or its "
                        "EAGLE-3 draft (draft=eagle3)")
    from models.eagle3_pair import load_for_pair

    return load_for_pair(pair, cfg.get("eagle3_weights"), None)


@hydra_entry("tree_ceiling")
def main(cfg: DictConfig) -> dict:
    check(cfg)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    from data_gen.prompts import load_prompts
    from decode.run import tokenize_prompts
    from models.profiling import get_profile
    from models.pair import load_pair

    pair = load_pair(cfg.pair)
    ids = tokenize_prompts(pair, load_prompts(cfg.dataset, str(cfg.split), int(cfg.prompts)), int(cfg.tokens))
    eagle, weights = (None, None) if cfg.get("draft", "student") == "student" else eagle_draft(pair, cfg)
    rv = rank_vector(measure_ranks(pair, ids, int(cfg.tokens), eagle), int(cfg.max_rank))
    prof = get_profile(pair, cfg.get("profile"))
    if eagle is not None:  # its own draft curves, timed as decode runs it (models.eagle3_pair.draft_profile)
        from models.eagle3_pair import draft_profile
        from models.lm import LM

        prof = draft_profile(eagle, weights, prof, LM.of(pair, "target"))
    res = {**about(cfg, pair), **rv, "profile": costs(prof, int(cfg.max_nodes)), **analyse(rv, prof, int(cfg.max_nodes))}
    out = output_dir(cfg.get("out_dir"))
    write_text_atomic(out / "ceiling.json", json.dumps(res, indent=1))
    write_text_atomic(out / "ceiling.md", markdown(res))
    print(markdown(res))
    probs = "[" + ",".join(f"{x:.3f}" for x in res["rank_vector"]) + "]"
    print(f"the tree builders' override for this pair: 'policy.sequoia.rank_probs={probs}' "
          f"'policy.tree_static.rank_probs={probs}'")
    print(f"wrote {out / 'ceiling.json'} and {out / 'ceiling.md'}")
    return res


if __name__ == "__main__":
    main()
