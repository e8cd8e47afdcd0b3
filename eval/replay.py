"""Replay stop policies on greedy traces under the cost model: what a policy would gain, without decoding.

    python -m eval.replay +experiment=study/disco_mbpp replay.tune=VAL_TRACES replay.eval=TEST_TRACES \
        replay.c_from=results/stop_heads/profile.json replay.out_dir=results/stop_heads/replay_mbpp

A greedy `target_ar` trace holds, at every position of the target's greedy continuation, the draft's features and
whether its argmax equals the target's token. That is everything a speculative round sees while it stays on the
target's path, so the decoder's rounds can be replayed row by row with the real policy objects (decode/policies.py)
in decode.loop's own round code (eval.replay_rounds):
draft rows t, t+1, … until the policy stops, keep the leading accepted ones plus one target token, go on from there.
Up to a round's first rejected token the policy sees exactly what it sees in decoding, so for a policy without state
across rounds every round's accepted count (hence tokens and target calls) is the decoder's, and so is its draft
length when it stopped by that rejection (tested). Past it the draft would run on its own wrong token and the replay
shows the on-path row instead: those rounds' lengths are approximate (`past_rejection`: their share), and so is an
adaptive policy's state (AdaEDL, heuristic). Time is the cost model of decode.metrics under a measured cost profile
(models.cost: a verification pass over k+1 tokens costs t_target(k+1), a draft step t_draft), not a clock. In exchange a whole threshold grid replays in seconds and without timing
noise, which separates what a stop rule can gain from what a machine's verification cost and noise do to it.

It reads the decode experiment's `policies`, `policy.*` and `tune.grid` (the same config as `python -m decode`):
each grid is tuned on `replay.tune` traces for cost-model speedup and the chosen point replayed on `replay.eval`.
`replay.synthetic_auroc` adds the *synthetic heads*: per-row scores with a chosen AUROC (binormal, equal variance,
independent of everything else), thresholded like a DISCO head — the speedup a head of that quality would reach on
these traces, i.e. how good a classifier the static-to-oracle gap asks for.

Besides replay.json / replay.md / replay_auroc.png it writes tuned.json in decode's format, so
`python -m decode ... tuned=OUT/tuned.json` decodes with the replay's choices (seconds of tuning instead of a decoded
grid); `replay.compare=DECODE_OUT_DIR` (a decode run on the eval traces' prompts) adds replayed vs decoded call counts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from scipy.stats import norm
from sklearn.metrics import roc_auc_score
from tqdm.auto import tqdm

from decode import wandb_log
from decode.metrics import per_position, speedup_from_costs
from models.cost import CostProfile
from decode.learned import Learned
from decode.policies import StopPolicy, build_policy, split_spec
from decode.methods import Method, methods_from_cfg
from decode.tune import choose, grid_params, tune_grid
from eval.continuations import Continuation, load_continuations
from eval.replay_report import compare, gap_closed, write_outputs
from eval.replay_rounds import replay_one, trace_drafter
from utils.cli import UserError, hydra_entry, output_dir


def not_replayed(cls: type[StopPolicy]) -> str | None:
    """Why a policy class cannot be replayed on greedy traces (None: it can): an `external` one runs transformers'
    own loop, an `approximate` one keeps tokens the target never checks — neither is a round of decode.loop."""
    if cls.external:
        return "runs transformers' own loop"
    if cls.approximate:
        return "approximate verification (lossy)"
    if cls.tree:
        return "a token-tree builder (chain traces hold one branch)"
    return None


def score_auroc(policy: StopPolicy, cols: dict) -> float | None:
    """AUROC of the per-token score a policy thresholds, on on-path rows (None for rules without one): its
    `trace_score` (max q for max-confidence, −H_q for SVIP and AdaEDL), P(accept) for a head — where it sits on the
    synthetic heads' curve."""
    y = cols["draft_token"] == cols["target_token"]
    if policy.trace_score == "max_q":
        score = np.asarray(cols["draft_topk"])[:, 0]
    elif policy.trace_score == "neg_entropy":
        score = -np.asarray(cols["draft_entropy"])
    elif policy.learned:
        from models.features.spec import features_from_columns

        with torch.no_grad():
            score = policy.bundle.prob(features_from_columns(cols, policy.bundle.spec)).numpy()
    else:
        return None
    return float(roc_auc_score(y, score)) if 0 < y.sum() < len(y) else None


class SyntheticHead(StopPolicy):
    """A head of known AUROC: stop when its per-row score (set per continuation via reset) falls below `threshold`."""

    name = "synthetic"
    needs_probs = False

    def __init__(self, threshold: float, max_len: int = 40):
        super().__init__(max_len)
        self.threshold = float(threshold)
        self.scores = np.zeros(0)

    def reset(self, synthetic=None, **ctx):
        self.scores = synthetic

    def should_stop(self, step):
        s = self.scores
        if s.ndim == 2:  # an eagle_chain continuation's scores by (round start, step)
            j = step.position_in_round
            return s[step.position - j, j] < self.threshold
        return s[step.position] < self.threshold


def synthetic_scores(conts: list[Continuation], auroc: float, seed: int) -> list[np.ndarray]:
    """Binormal scores N(μ·accepted, 1) with μ = √2·Φ⁻¹(AUROC): that AUROC in expectation, nothing else learned. One
    per row: by position for target_ar rows, by (round start, step) for eagle_chain's (`Continuation.rows`; read by
    position, a round's steps read the rows of other rounds — the synthetic rows on EAGLE-3 traces before
    2026-11-29 10:10 did)."""
    mu = math.sqrt(2.0) * norm.ppf(auroc)
    rng = np.random.default_rng(seed)
    out = []
    for c in conts:
        s = mu * c.accepted + rng.standard_normal(len(c.accepted))
        out.append(s if c.rows is None else np.where(c.rows >= 0, s[c.rows], np.inf))
    return out


def cost_rows(rounds_per_cont: list[list[tuple[int, int]]], prompt_lens: list) -> tuple[list, list]:
    """Decode-style rows (decode.metrics) of each replayed continuation and of its target-only generation."""
    rows, base = [], []
    for rs, prompt in zip(rounds_per_cont, prompt_lens):
        n_tok = sum(n + 1 for _, n in rs)
        rows.append({"new_tokens": n_tok, "target_calls": len(rs), "draft_calls": sum(k for k, _ in rs),
                     "drafted": sum(k for k, _ in rs), "rounds": rs, "prompt_tokens": prompt})
        base.append({"new_tokens": n_tok, "target_calls": n_tok, "draft_calls": 0, "prompt_tokens": prompt})
    return rows, base


def summarize(rounds_per_cont: list[list[tuple[int, int]]], profile: CostProfile,
              conts: list[Continuation] | None = None) -> dict:
    """Cost-model numbers of one replayed method (the decode summary's definitions, decode.metrics): each
    continuation costed like a decode row under `profile` against its target-only generation (prefills at the
    prompt's length when `conts` carry it); `per_prompt` keeps each continuation's costs for paired bootstraps."""
    from models.cost import modeled_ms

    conts = conts or [None] * len(rounds_per_cont)
    rows, base = cost_rows(rounds_per_cont, [len(c.prompt) if c is not None and c.prompt is not None else None
                                             for c in conts])
    cost = [modeled_ms(r, profile) for r in rows]
    t_cost = [modeled_ms(r, profile) for r in base]
    n_tok = [r["new_tokens"] for r in rows]
    rounds = [r for rs in rounds_per_cont for r in rs]
    tokens = sum(n + 1 for _, n in rounds)
    drafted = sum(k for k, _ in rounds)
    accepted = sum(n for _, n in rounds)
    verified, acc_pos = per_position(rounds, limit=8)
    return {
        "cost_model_speedup": speedup_from_costs(sum(n_tok), sum(cost), sum(n_tok), sum(t_cost)),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": tokens / len(rounds) if rounds else 0.0,
        "draft_calls_per_token": drafted / tokens if tokens else 0.0,
        "mean_draft_length": drafted / len(rounds) if rounds else 0.0,
        "per_position_acceptance": [a / v if v else None for a, v in zip(acc_pos, verified)],
        "past_rejection": sum(k > n + 1 for k, n in rounds) / len(rounds) if rounds else 0.0,
        "tokens": tokens,
        "per_prompt": {"prompt_id": [c.prompt_id if c is not None else str(i) for i, c in enumerate(conts)],
                       "new_tokens": n_tok, "cost_ms": cost, "target_cost_ms": t_cost},
    }


def build(method: Method, manifest: dict, folder: Path, profile: CostProfile | None = None,
          columns: list[str] = ()) -> StopPolicy:
    """The method's policy; a head is checked against the traces (pair, tokenizer, the `columns` they hold)."""
    path = split_spec(method.spec)[1]
    pol = build_policy(method.spec, method.params, profile=profile, target=method.target)
    if path:
        from data_gen.contract import check_compatible

        check_compatible(pol.bundle, manifest, folder, list(columns))
    return pol


def speed_rule(bundle, conts: list[Continuation], profile: CostProfile, thresholds) -> dict:
    """The stop rule under which a head (a loaded `models.heads.HeadBundle`) decodes fastest on these (validation)
    continuations, by the cost model: the expected-value rule on its calibrated P(accept) (calibrated heads only) or
    a threshold from `thresholds`. What `python -m train` stores in the checkpoint for `learned:<ckpt>` with no
    tuning step (issue 16)."""
    calibrated = (bundle.calibration or {}).get("mode", "none") != "none"
    cands = ([{"rule": "expected_value"}] if calibrated else []) + [{"rule": "threshold", "threshold": float(t)}
                                                                     for t in thresholds]
    speed = {}
    for c in cands:
        pol = Learned(bundle, profile=profile, **c)
        speed[json.dumps(c)] = summarize([replay_one(pol, x) for x in conts], profile, conts)["cost_model_speedup"]
    best = max(speed, key=speed.get)
    return {**json.loads(best), "cost_model_speedup": speed[best],
            "candidates": {", ".join(f"{k}={v}" for k, v in json.loads(k).items()): v for k, v in speed.items()},
            "profile_key": profile.key}


def replay(methods: list[Method], conts, manifest, folder, profile: CostProfile, desc: str, cols: dict,
           auroc: bool = False) -> dict:
    """Each method's replay summary on the folder's continuations (`cols`: its columns); with `auroc`, also the
    AUROC of the score its policy thresholds."""
    out = {}
    for m in tqdm(methods, desc=desc, unit="method", leave=False):
        pol = build(m, manifest, folder, profile, list(cols))
        drafters = [trace_drafter(m, pol, cont, manifest) for cont in conts]
        prof = profile if drafters[0] is None else drafters[0].profile_of(profile)
        out[m.key] = summarize([replay_one(pol, cont, drafter=d) for cont, d in zip(conts, drafters)], prof, conts)
        if auroc:
            out[m.key]["score_auroc"] = score_auroc(pol, cols)
    return out


def replay_synthetic(aurocs, conts_tune, conts_eval, profile: CostProfile, seed: int) -> dict:
    """Per AUROC: the threshold with the best tuning-split speedup, then the eval split's speedup and realised AUROC."""
    out = {}
    for a in aurocs:
        mu = math.sqrt(2.0) * norm.ppf(a)
        grid = [float(x) for x in np.linspace(min(0.0, mu) - 3.0, max(0.0, mu) + 3.0, 61)]  # both score modes ± 3σ
        s_tune, s_eval = synthetic_scores(conts_tune, a, seed), synthetic_scores(conts_eval, a, seed + 1)

        def run(th, conts, scores):
            pol = SyntheticHead(th)
            return summarize([replay_one(pol, cont, sc) for cont, sc in zip(conts, scores)], profile, conts)

        tuned = {th: run(th, conts_tune, s_tune)["cost_model_speedup"] for th in grid}
        best = max(tuned, key=tuned.get)
        res = run(best, conts_eval, s_eval)
        y = np.concatenate([cont.accepted for cont in conts_eval])
        rows = [sc if sc.ndim == 1 else sc[cont.rows >= 0] for cont, sc in zip(conts_eval, s_eval)]  # row order
        res.update(auroc=float(a), realised_auroc=float(roc_auc_score(y, np.concatenate(rows))), threshold=float(best))
        out[f"synthetic[auroc={a:g}]"] = res
    return out


def constant_profile(cost_ratio: float) -> CostProfile:
    """The classic cost model as a profile: every target pass one step, a draft step cost_ratio, prefills likewise."""
    return CostProfile(key={"constant_c": cost_ratio}, draft_ms=[cost_ratio], target_ms=[1.0], prefill_lengths=[1],
                       prefill_target_ms=[1.0], prefill_draft_ms=[cost_ratio], context=1, repeats=0)


def cost_profile(cfg_replay) -> tuple[CostProfile, str]:
    """The cost profile to replay under (`_read_profile`), its draft times scaled by `replay.draft_scale`."""
    profile, source = _read_profile(cfg_replay)
    scale = cfg_replay.get("draft_scale")
    if scale is None or float(scale) == 1.0:
        return profile, source
    if float(scale) <= 0:
        raise UserError(f"replay.draft_scale must be > 0 (1: as measured), got {scale}")
    return scaled_draft(profile, float(scale)), f"{source}, draft times x{float(scale):g} (replay.draft_scale)"


def scaled_draft(profile: CostProfile, scale: float) -> CostProfile:
    """A what-if profile: every draft time (warm step, a round's first step, prefill) `scale` times the measured one,
    the target's curve as measured — what the same stop decisions would be worth with a costlier or cheaper draft."""
    return dataclasses.replace(
        profile, key={**profile.key, "draft_scale": scale}, draft_ms=[t * scale for t in profile.draft_ms],
        prefill_draft_ms=[t * scale for t in profile.prefill_draft_ms],
        draft_cold_ms=None if profile.draft_cold_ms is None else profile.draft_cold_ms * scale)


def _read_profile(cfg_replay) -> tuple[CostProfile, str]:
    """`replay.c` (a constant c, for what-if runs), else `replay.c_from` — a decode run's run.json (its
    `cost_profile`; an older run.json without one falls back to its measured_c) or a profile file from
    `python -m decode.profile out=F`."""
    if cfg_replay.get("c") is not None:
        return constant_profile(float(cfg_replay.c)), f"constant c = {float(cfg_replay.c):.3f} (replay.c)"
    src = cfg_replay.get("c_from")
    if not src:
        raise UserError("the replay needs a cost profile: replay.c_from=RUN/run.json (a decode run) or a profile file "
                        "(python -m decode.profile out=F), or replay.c=0.26 for a constant cost ratio")
    path = Path(str(src))
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"replay.c_from={path}: no such file; pass a decode run's run.json or a profile file") from None
    except ValueError:
        raise UserError(f"replay.c_from={path} is not JSON; pass a decode run's run.json or a profile file") from None
    if isinstance(data, dict) and "target_ms" in data:
        return CostProfile.from_dict(data), f"profile {path}"
    if isinstance(data, dict) and data.get("cost_profile"):
        return CostProfile.from_dict(data["cost_profile"]), f"cost profile of {path}"
    if isinstance(data, dict) and isinstance(data.get("measured_c"), (int, float)):
        cost_ratio = float(data["measured_c"])
        return constant_profile(cost_ratio), f"constant c = {cost_ratio:.3f} ({path} has no cost profile)"
    raise UserError(f"replay.c_from={path} holds neither a cost_profile nor a measured_c; pass a decode run's run.json")


def _inputs(rc):
    """(cost profile, where it came from, synthetic AUROCs, tune and eval continuations), checked in one line each."""
    profile, c_from = cost_profile(rc)
    if rc.get("compare") and not (Path(str(rc.compare)) / "summary.json").is_file():
        raise UserError(f"replay.compare={rc.compare} has no summary.json; pass a python -m decode out_dir run on the "
                        "eval traces' prompts (same dataset, split, limit and max_new_tokens)")
    aurocs = [float(a) for a in rc.get("synthetic_auroc") or []]
    if any(not 0.0 < a < 1.0 for a in aurocs):
        raise UserError(f"replay.synthetic_auroc must hold AUROCs strictly between 0 and 1, got {aurocs}")
    conts_tune, man_tune, cols_tune = load_continuations(Path(str(rc.tune)))
    conts_eval, man_eval, cols_eval = load_continuations(Path(str(rc.eval)))
    if man_tune.get("pair_id") != man_eval.get("pair_id"):
        raise UserError(f"replay.tune traces come from pair {man_tune.get('pair_id')}, replay.eval from "
                        f"{man_eval.get('pair_id')}; use one pair's traces for both")
    return profile, c_from, aurocs, (conts_tune, man_tune, cols_tune), (conts_eval, man_eval, cols_eval)


def run(cfg: DictConfig) -> dict:
    rc = cfg.replay
    if not rc.get("tune") or not rc.get("eval"):
        raise UserError("pass the trace folders: replay.tune=VAL_TRACES replay.eval=TEST_TRACES (greedy target_ar, "
                        "python -m data_gen trace=target_ar split=validation|test limit=N)")
    profile, c_from, aurocs, (conts_tune, man_tune, cols_tune), (conts_eval, man_eval, cols_eval) = _inputs(rc)
    methods, skipped = [], {}
    for m in methods_from_cfg(cfg):
        why = not_replayed(m.policy_class)
        if why:
            skipped[m.key] = why
        else:
            methods.append(m)
    grid = tune_grid(cfg, methods, untuned=False)
    grid_cfg = OmegaConf.to_container(cfg.tune.grid, resolve=True) or {}
    tuned = replay(grid, conts_tune, man_tune, Path(str(rc.tune)), profile, "replay tune", cols_tune)
    chosen = choose(tuned, methods, grid, "cost_model_speedup")
    table = replay(chosen, conts_eval, man_eval, Path(str(rc.eval)), profile, "replay eval", cols_eval, auroc=True)
    synthetic = replay_synthetic(aurocs, conts_tune, conts_eval, profile, int(cfg.seed))
    table.update(synthetic)
    gap = gap_closed(table)
    result = {
        "settings": {"tune": str(rc.tune), "eval": str(rc.eval), "c": profile.cost_ratio, "c_from": c_from,
                     "cost_profile": profile.to_dict(),
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "tune_rows": sum(len(x.accepted) for x in conts_tune),
                     "eval_rows": sum(len(x.accepted) for x in conts_eval), "pair": man_eval.get("pair_id"),
                     "drafter": man_eval.get("drafter", "student"),  # whose draft the traces record
                     "grid": grid_cfg},
        "chosen": {**{m.key: {k: m.params.get(k) for k in grid_params(grid_cfg.get(split_spec(m.spec)[0]))}
                      for m in chosen},
                   **{k: {"threshold": round(v["threshold"], 2)} for k, v in synthetic.items()}},
        "eval": table,
        "gap": gap,
        "skipped": skipped,
    }
    if rc.get("compare"):
        result["settings"]["compare"] = str(rc.compare)
        result["compare"] = compare(table, Path(str(rc.compare)))
    write_outputs(result, table, chosen, rc, bool(aurocs))
    return result


@hydra_entry("replay", open_dicts=("policy", "drafter"))
def main(cfg: DictConfig) -> None:
    with wandb_log.session(cfg, output_dir(cfg.replay.get("out_dir")), "replay"):  # logger=wandb: offline W&B run
        run(cfg)


if __name__ == "__main__":
    main()
