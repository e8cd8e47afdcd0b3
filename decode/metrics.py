"""THE decoding metrics (DESIGN.md "Metrics"): one definition, used by the runner, the tune mode and the bench.

Aggregates are ratios of sums over prompts (a long prompt weighs by its tokens), except `speedup_std`, the spread
of per-prompt speedups. Definitions:
- tokens_per_s = Σ new tokens ÷ Σ wall seconds (prefill included, as in Spec-Bench);
- speedup = tokens_per_s ÷ tokens_per_s of target-only decoding in the same process on the same prompts;
- acceptance_rate = accepted ÷ drafted;  mean_accepted_length = new tokens ÷ target calls;
- draft/target_calls_per_token = calls ÷ new tokens;
- per_position_acceptance[j] = P(drafted token j of a round is accepted | tokens 0..j−1 were), over verified tokens;
- draft_length_hist = rounds per draft length;
- c = draft step time ÷ target step time (draft forwards timed in the loop, target step = target-only time per token);
- cost_model_speedup = the speedup the run's call counts give under the measured cost profile (models.cost):
  each prompt's target-only and speculative generations costed call by call (prefills, a target pass over k+1
  tokens per round at t_target(k+1), t_draft per draft call) — machine-independent given the profile, and what a
  clock would show when the profile is this machine's;
- oracle gap closed = (speedup − static K-opt's) ÷ (oracle's − static K-opt's), the study's bar (either speedup);
- policy_overhead_frac = time in the policy (should_stop + observe, features included; a tree builder's children,
  expansion and selection, its node head's features and scores included) ÷ time in draft calls;
- lossless (greedy, exact policies) = every output equals the target-only output token for token;
  lossless_up_to_ties also accepts a divergence where the target's logits of the two tokens differ by less than
  `tie_tolerance`: `tie_ulps` units in the last place of the model's dtype at the logits' magnitude (bf16 at a
  logit of 40: 4 × 0.25), i.e. a near-tie that a 1-token and a multi-token pass round differently.
SPRINTER adds target_calls_saved_frac (vs target-only), agreement with target-only output, ROUGE-L and an estimate of
the TVD of the emitted tokens from the target (TVD(p, q) on unchecked tokens, 0 on checked ones, per token).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from decode.loop import GenResult


def per_position(rounds: list[tuple[int, int]], limit: int = 64) -> tuple[list[int], list[int]]:
    """(verified, accepted) counts by position in round; position j is verified when tokens 0..j−1 were accepted."""
    verified, accepted = [0] * limit, [0] * limit
    for k, n in rounds:
        for j in range(min(k, n + 1, limit)):
            verified[j] += 1
            if j < n:
                accepted[j] += 1
    return verified, accepted


def agreement(out: list[int], ref: list[int]) -> dict:
    """Token agreement with the reference output: common prefix length and position-wise match fraction."""
    prefix = 0
    for a, b in zip(out, ref):
        if a != b:
            break
        prefix += 1
    same = sum(a == b for a, b in zip(out, ref))
    return {"prefix_match": prefix, "token_agreement": same / max(len(ref), 1)}


def rouge_l(candidate: str, reference: str) -> float:
    import logging

    from rouge_score import rouge_scorer

    logging.getLogger("absl").setLevel(logging.WARNING)  # rouge_score logs a line per scorer otherwise

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    return float(scorer.score(reference, candidate)["rougeL"].fmeasure)


def record(res: GenResult, ref: GenResult | None) -> dict:
    """Per-prompt numbers (one JSONL row, text added by the runner)."""
    n_tok = len(res.tokens)
    row = {
        "new_tokens": n_tok,
        "wall_s": res.wall_s,
        "tokens_per_s": n_tok / res.wall_s if res.wall_s > 0 else 0.0,
        "target_calls": res.target_calls,
        "draft_calls": res.draft_calls,
        "drafted": res.drafted,
        "accepted": res.accepted,
        "draft_s": res.draft_s,
        "target_s": res.target_s,
        "policy_s": res.policy_s,
        "rounds": [list(r) for r in res.rounds],
        **({"tree_levels": [list(x) for x in res.tree_levels]} if res.tree_levels else {}),
        "unchecked": res.unchecked,
        "tvd_sum": res.tvd_sum,
    }
    if ref is not None:
        row["matches_target"] = res.tokens == ref.tokens
        row.update(agreement(res.tokens, ref.tokens))
        row["speedup"] = (n_tok / res.wall_s) / (len(ref.tokens) / ref.wall_s) if res.wall_s and ref.wall_s else 0.0
    return row


def measured_c(draft_s: float, draft_calls: int, target_s: float, target_calls: int) -> float:
    """Cost ratio c = mean draft step time ÷ mean target step time."""
    if not draft_calls or not target_calls or target_s <= 0:
        return float("nan")
    return (draft_s / draft_calls) / (target_s / target_calls)


def cost_model_speedup(rows: list[dict], target_rows: list[dict], profile) -> float:
    """Tokens/s of `rows` ÷ tokens/s of `target_rows`, each generation costed by `models.cost.modeled_ms`."""
    from models.cost import modeled_ms

    if profile is None:
        return float("nan")
    return speedup_from_costs(sum(r["new_tokens"] for r in rows), sum(modeled_ms(r, profile) for r in rows),
                              sum(r["new_tokens"] for r in target_rows), sum(modeled_ms(r, profile) for r in target_rows))


def speedup_from_costs(tokens: float, cost: float, t_tokens: float, t_cost: float) -> float:
    """Tokens per unit cost ÷ target-only tokens per unit cost (nan when either side is empty)."""
    if not tokens or not t_tokens or cost <= 0 or t_cost <= 0:
        return float("nan")
    return (tokens / cost) / (t_tokens / t_cost)


# spacing of representable numbers at 1.0 (unit in the last place), per dtype name
ULP_AT_ONE = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float32": 2.0 ** -23, "float64": 2.0 ** -52}


def tie_tolerance(dtype: str, magnitude: float, ulps: float = 4.0) -> float:
    """`ulps` units in the last place of `dtype` at |logit| = magnitude: below this a logit margin is a tie."""
    name = str(dtype).replace("torch.", "")
    if name not in ULP_AT_ONE:
        raise ValueError(f"no ulp known for dtype {dtype}")
    return float(ulps * ULP_AT_ONE[name] * 2.0 ** math.floor(math.log2(max(abs(magnitude), 1e-30))))


def oracle_gap_closed(speedup, static, oracle):
    """Share of the static-K-opt → oracle speedup gap a method closes (negative: below static K-opt); arrays too."""
    return (speedup - static) / (oracle - static)


def tokens_per_s(tokens, wall):
    """Σ new tokens ÷ Σ wall seconds, over the last axis when given per-prompt arrays (the bootstrap resamples)."""
    tokens, wall = np.sum(tokens, axis=-1), np.sum(wall, axis=-1)
    return np.divide(tokens, wall, out=np.zeros(np.shape(wall)), where=np.asarray(wall) > 0)


def summarize(rows: list[dict], target_rows: list[dict], profile, greedy: bool, exact: bool) -> dict:
    """One method's summary from its per-prompt rows and target-only rows on the same prompts."""
    tokens = sum(r["new_tokens"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    t_tokens = sum(r["new_tokens"] for r in target_rows)
    tps = float(tokens_per_s([r["new_tokens"] for r in rows], [r["wall_s"] for r in rows]))
    t_tps = float(tokens_per_s([r["new_tokens"] for r in target_rows], [r["wall_s"] for r in target_rows]))
    target_calls = sum(r["target_calls"] for r in rows)
    draft_calls = sum(r["draft_calls"] for r in rows)
    drafted = sum(r["drafted"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    draft_s = sum(r["draft_s"] for r in rows)
    policy_s = sum(r["policy_s"] for r in rows)
    rounds = [tuple(x) for r in rows for x in r["rounds"]]
    verified, acc_pos = per_position(rounds)
    last = max((j for j, v in enumerate(verified) if v), default=-1)
    speedups = [r.get("speedup", 0.0) for r in rows]
    out = {
        "tokens_per_s": tps,
        "speedup": tps / t_tps if t_tps > 0 else float("nan"),
        "speedup_std": float(np.std(speedups)) if speedups else 0.0,
        "cost_model_speedup": cost_model_speedup(rows, target_rows, profile),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": tokens / target_calls if target_calls else 0.0,
        "target_calls_per_token": target_calls / tokens if tokens else 0.0,
        "draft_calls_per_token": draft_calls / tokens if tokens else 0.0,
        "policy_overhead_frac": policy_s / draft_s if draft_s > 0 else 0.0,
        "lossless": (all(r.get("matches_target", False) for r in rows) if exact else False) if greedy else None,
        "mismatched_prompts": sum(not r.get("matches_target", True) for r in rows),
        # every mismatch a near tie (target logit margin below the dtype's tolerance at the first divergence)
        "lossless_up_to_ties": (all(r.get("matches_target", False) or is_tie(r) for r in rows)
                                if exact else False) if greedy else None,
        "per_position_acceptance": [acc_pos[j] / verified[j] if verified[j] else None for j in range(last + 1)],
        "draft_length_hist": {str(k): v for k, v in sorted(Counter(k for k, _ in rounds).items())},
        "mean_draft_length": drafted / len(rounds) if rounds else None,  # None: no per-round view (transformers)
        "draft_step_ms": 1000 * draft_s / draft_calls if draft_calls else None,
        "policy_ms_per_draft_step": 1000 * policy_s / draft_calls if draft_calls else None,
        "n_prompts": len(rows),
        "new_tokens": tokens,
        "wall_s": wall,
    }
    if not exact:
        unchecked = sum(r["unchecked"] for r in rows)
        out["target_calls_saved_frac"] = 1 - target_calls / t_tokens if t_tokens else 0.0
        out["unchecked_frac"] = unchecked / tokens if tokens else 0.0
        out["tvd_est"] = sum(r["tvd_sum"] for r in rows) / tokens if tokens else 0.0
        out["token_agreement"] = float(np.mean([r.get("token_agreement", 0.0) for r in rows]))
        out["prefix_match"] = float(np.mean([r.get("prefix_match", 0) for r in rows]))
        for key in ("rouge_l_ref", "rouge_l_target"):
            out[key] = _mean_or_none([r.get(key) for r in rows])
    return out


def is_tie(row: dict) -> bool:
    """A mismatched greedy row whose first divergence is a near tie (decode.run.tie_margins sets both numbers)."""
    return row.get("divergence_margin", math.inf) < row.get("divergence_tol", -math.inf)


def target_summary(target_rows: list[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in target_rows)
    wall = sum(r["wall_s"] for r in target_rows)
    calls = sum(r["target_calls"] for r in target_rows)
    return {
        "tokens_per_s": tokens / wall if wall else 0.0,
        "speedup": 1.0,
        "speedup_std": 0.0,
        "cost_model_speedup": 1.0,
        "acceptance_rate": None,
        "mean_accepted_length": tokens / calls if calls else 0.0,
        "target_calls_per_token": calls / tokens if tokens else 0.0,
        "draft_calls_per_token": 0.0,
        "policy_overhead_frac": 0.0,
        "lossless": True,
        "target_step_ms": 1000 * wall / calls if calls else None,
        "n_prompts": len(target_rows),
        "new_tokens": tokens,
        "wall_s": wall,
        # the quality an exact policy reaches (it emits the target's tokens): the baseline for approximate ones
        "rouge_l_ref": _mean_or_none([r.get("rouge_l_ref") for r in target_rows]),
    }


def _mean_or_none(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return float(np.mean(vals)) if vals else None
