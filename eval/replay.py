"""Replay stop policies on greedy traces under the cost model: what a policy would gain, without decoding.

    python -m eval.replay +experiment=study/disco_mbpp replay.tune=VAL_TRACES replay.eval=TEST_TRACES \
        replay.c_from=results/stop_heads/profile.json replay.out_dir=results/stop_heads/replay_mbpp

A greedy `target_ar` trace holds, at every position of the target's greedy continuation, the draft's features and
whether its argmax equals the target's token. That is everything a speculative round sees while it stays on the
target's path, so the decoder's rounds can be replayed row by row with the real policy objects (decode/policies.py):
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from scipy.stats import norm
from sklearn.metrics import roc_auc_score
from tqdm.auto import tqdm

from decode import wandb_log
from decode.metrics import oracle_gap_closed, per_position, speedup_from_costs
from models.cost import CostProfile
from decode.policies import Learned, StopPolicy, build_policy, split_spec
from decode.methods import Method, methods_from_cfg
from decode.tune import choose, grid_params, tune_grid
from utils.files import jsonl_text
from models.features.signals import DraftStep, VerifyStats, compared
from models.features.trace import continuation_starts
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


@dataclass
class Continuation:
    """One greedy continuation of a trace: per-row draft features, the target's tokens, and (when the trace has them)
    what a disco_plus head reads: the prompt and context tokens and the target's per-row statistics."""

    topk: torch.Tensor  # (n, k) draft top-k probabilities
    entropy: torch.Tensor  # (n,)
    hidden: torch.Tensor | None  # (n, d) or None
    draft_token: np.ndarray
    target_token: np.ndarray
    prompt_id: str = ""
    prompt: list[int] | None = None  # prompt token ids
    context_token: np.ndarray | None = None  # the continuation's tokens (the target's greedy tokens)
    target_entropy: np.ndarray | None = None  # H_p, top-2 margin of p and TVD(p, q) per row
    target_margin: np.ndarray | None = None
    tvd: np.ndarray | None = None

    @property
    def accepted(self) -> np.ndarray:
        return self.draft_token == self.target_token

    def verify_stats(self, t: int, k: int, n: int) -> VerifyStats:
        """The loop's VerifyStats (decode.loop._verify_stats) of a round that started at row t, drafted k, kept n:
        the target produced row t + n's token, so H_p and the margin are row t + n's, TVD averaged over rows
        t .. t + min(n + 1, k) − 1."""
        return VerifyStats.of(self.target_entropy[t + n], self.target_margin[t + n], self.tvd[t : t + compared(k, n)], k, n)


def check_greedy(manifest: dict, where) -> None:
    """Refuse, in one line, traces that are not greedy target_ar (the only ones a replay can read rounds off)."""
    kind, temp = manifest.get("trace_kind"), manifest.get("temperature")
    if kind != "target_ar" or temp is None or float(temp) != 0.0:
        raise UserError(f"{where} holds {kind} traces at temperature {temp}; this needs greedy target_ar traces "
                        "(python -m data_gen trace=target_ar trace.temperature=0)")


def load_greedy_traces(folder: Path, names: list[str]) -> tuple[dict, dict]:
    """(columns present among `names`, manifest) of a greedy target_ar trace folder; other folders refused in one line."""
    from data_gen.contract import trace_columns
    from data_gen.store import load_traces

    folder = Path(folder)
    if not folder.exists():
        raise UserError(f"no traces at {folder}; make them with python -m data_gen trace=target_ar split=... limit=...")
    ds, manifest = load_traces(folder)
    check_greedy(manifest, folder)
    return trace_columns(ds, [n for n in names if n in ds.column_names]), manifest


PLUS_TRACE_COLUMNS = ("prompt_tokens", "context_token", "target_entropy", "target_margin", "tvd")
CONTINUATION_COLUMNS = ["prompt_id", "kind", "position", "draft_token", "target_token", "draft_topk", "draft_entropy",
                        "draft_hidden", *PLUS_TRACE_COLUMNS]


def load_continuations(folder: Path) -> tuple[list[Continuation], dict, dict]:
    """A greedy target_ar trace folder as (continuations, manifest, columns)."""
    cols, manifest = load_greedy_traces(folder, CONTINUATION_COLUMNS)
    return continuations(cols), manifest, cols


def continuations(cols: dict) -> list[Continuation]:
    """Trace columns (`CONTINUATION_COLUMNS` where present) split into continuations."""
    starts = np.flatnonzero(continuation_starts(cols))
    ends = np.append(starts[1:], len(cols["position"]))
    topk = torch.tensor(cols["draft_topk"], dtype=torch.float32)
    ent = torch.tensor(cols["draft_entropy"], dtype=torch.float32)
    hid = torch.tensor(cols["draft_hidden"]).float() if "draft_hidden" in cols else None
    plus = all(c in cols for c in PLUS_TRACE_COLUMNS)

    def part(name, a, b):
        return cols[name][a:b] if plus else None

    out = [Continuation(topk[a:b], ent[a:b], None if hid is None else hid[a:b],
                        cols["draft_token"][a:b].astype(np.int64), cols["target_token"][a:b].astype(np.int64),
                        prompt_id=str(cols["prompt_id"][a]) if "prompt_id" in cols else str(i),
                        prompt=[int(x) for x in cols["prompt_tokens"][a]] if plus else None,
                        context_token=part("context_token", a, b), target_entropy=part("target_entropy", a, b),
                        target_margin=part("target_margin", a, b), tvd=part("tvd", a, b))
           for i, (a, b) in enumerate(zip(starts, ends))]
    return out


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
        return self.scores[step.position] < self.threshold


def synthetic_scores(conts: list[Continuation], auroc: float, seed: int) -> list[np.ndarray]:
    """Binormal scores N(μ·accepted, 1) with μ = √2·Φ⁻¹(AUROC): that AUROC in expectation, nothing else learned."""
    mu = math.sqrt(2.0) * norm.ppf(auroc)
    rng = np.random.default_rng(seed)
    return [mu * c.accepted + rng.standard_normal(len(c.accepted)) for c in conts]


def replay_one(policy: StopPolicy, cont: Continuation, synthetic=None) -> list[tuple[int, int]]:
    """The rounds (drafted k, accepted n) decode.loop.speculative would run on this continuation, read off the trace.

    Same round structure as the loop: at most min(max_len, tokens left − 1) drafted tokens, the token that makes the
    policy stop is drafted and verified, the target adds one token per round (correction or bonus). A policy that
    reads the context (prompt + committed output) or the last verification's statistics (disco_plus heads) gets
    them as the loop builds them, from the trace's prompt, context tokens and target statistics."""
    acc = cont.accepted
    total = len(acc)
    want_ctx = bool(getattr(policy, "needs_context", False))
    want_vs = bool(getattr(policy, "needs_verify_stats", False))
    if (want_ctx or want_vs) and cont.prompt is None:
        raise UserError("this head reads the context / last verification, which these traces lack "
                        f"({', '.join(PLUS_TRACE_COLUMNS)}); regenerate them with python -m data_gen")
    ctx = list(cont.prompt) if want_ctx else None
    vstats = None
    policy.reset(lookahead=cont.target_token.tolist(), synthetic=synthetic)
    rounds, t = [], 0
    while t < total:
        k_cap = min(policy.max_len, total - t - 1)
        k = 0
        for j in range(k_cap):
            i = t + j
            step = DraftStep(probs=cont.topk[i], token=int(cont.draft_token[i]),
                             hidden=None if cont.hidden is None else cont.hidden[i], position_in_round=j, position=i,
                             _topk=cont.topk[i], _entropy=cont.entropy[i], context=ctx, verify=vstats)
            k += 1
            if policy.should_stop(step):
                break
        n = 0
        while n < k and acc[t + n]:
            n += 1
        policy.observe(k, n)
        rounds.append((k, n))
        if want_vs:
            vstats = cont.verify_stats(t, k, n)
        if want_ctx:
            ctx.extend(int(x) for x in cont.context_token[t : t + n + 1])
        t += n + 1
    return rounds


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
        out[m.key] = summarize([replay_one(pol, cont) for cont in conts], profile, conts)
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
        res.update(auroc=float(a), realised_auroc=float(roc_auc_score(y, np.concatenate(s_eval))), threshold=float(best))
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


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"Cost-model replay on greedy traces (`python -m eval.replay`): tuned on `{s['tune']}` "
        f"({s['tune_rows']} rows), replayed on `{s['eval']}` ({s['eval_rows']} rows); c = {s['c']:.3f} "
        f"({s['c_from']}); pair {s['pair']}; {s['date']}.",
        "",
        "| method | chosen | score AUROC | cost-model speedup | accept | mean acc len | draft calls/tok | mean K | "
        "past rejection |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in result["eval"].items():
        chosen = result["chosen"].get(key) or ""
        if isinstance(chosen, dict):
            chosen = ", ".join(f"{k}={v}" for k, v in chosen.items())
        auroc = r.get("score_auroc", r.get("realised_auroc"))
        auroc = "–" if auroc is None else f"{auroc:.3f}"
        lines.append(f"| {key} | {chosen} | {auroc} | {r['cost_model_speedup']:.3f} | {r['acceptance_rate']:.3f} | "
                     f"{r['mean_accepted_length']:.2f} | {r['draft_calls_per_token']:.3f} | {r['mean_draft_length']:.2f} | "
                     f"{r['past_rejection']:.3f} |")
    lines += ["", "Past rejection: share of rounds that drafted beyond their first rejected token; there a policy that "
                  "reads features sees on-path rows the decoder would not have seen, so those rounds' lengths are "
                  "approximate (constant K and static K read none: exact)."]
    comp = result.get("compare")
    if comp:
        lines += ["", f"Replayed vs decoded (`{result['settings']['compare']}`, same prompts):", "",
                  "| method | mean acc len replay | decode | accept replay | decode | draft calls/tok replay | decode |",
                  "|---|---|---|---|---|---|---|"]
        for k, r in comp.items():
            lines.append(f"| {k} | {r['mean_accepted_length_replay']:.3f} | {r['mean_accepted_length_decode']:.3f} | "
                         f"{r['acceptance_rate_replay']:.3f} | {r['acceptance_rate_decode']:.3f} | "
                         f"{r['draft_calls_per_token_replay']:.3f} | {r['draft_calls_per_token_decode']:.3f} |")
    gap = result.get("gap")
    if gap:
        lines += ["", "Static K-opt → oracle gap closed (cost model): "
                      + ", ".join(f"{k} {v:.0%}" for k, v in gap.items()) + "."]
    if result.get("skipped"):
        lines += ["", "Not replayed: " + "; ".join(f"{k} ({v})" for k, v in result["skipped"].items()) + "."]
    return "\n".join(lines) + "\n"


def compare(table: dict, run_dir: Path) -> dict:
    """Replayed vs decoded call counts per method, from a decode run on the eval traces' prompts (its summary.json):
    the mean accepted length follows from accepted counts (exact for stateless policies); acceptance rate and draft
    calls per token also count tokens drafted past a rejection (approximate). Timing-free: any machine's run will do."""
    decoded = json.loads((Path(run_dir) / "summary.json").read_text())
    keys = ("mean_accepted_length", "acceptance_rate", "draft_calls_per_token")

    def twin(key):  # a head is keyed `learned` when decoded alone, `learned:<stem>` beside another head
        if key in decoded:
            return decoded[key]
        name, _, stem = key.partition(":")
        alone = decoded.get(name) or {}
        return alone if stem and Path(str((alone.get("params") or {}).get("ckpt"))).stem == stem else None

    return {k: {**{f"{q}_replay": r[q] for q in keys}, **{f"{q}_decode": d[q] for q in keys}}
            for k, r in table.items() if (d := twin(k)) is not None}


def gap_closed(table: dict) -> dict:
    """Share of the static_opt → oracle cost-model gap each other method closes (negative: below static_opt)."""
    if "static_opt" not in table or "oracle" not in table:
        return {}
    lo, hi = table["static_opt"]["cost_model_speedup"], table["oracle"]["cost_model_speedup"]
    if hi <= lo:
        return {}
    return {k: oracle_gap_closed(r["cost_model_speedup"], lo, hi) for k, r in table.items()
            if k not in ("static_opt", "oracle")}


def plot(result: dict, path: Path) -> Path | None:
    syn = {k: v for k, v in result["eval"].items() if k.startswith("synthetic[")}
    if not syn:
        return None
    from utils.plotting import pyplot

    plt = pyplot()

    from eval.plots import _save

    fig, ax = plt.subplots(figsize=(6, 4.2))
    xs = [v["realised_auroc"] for v in syn.values()]
    ax.plot(xs, [v["cost_model_speedup"] for v in syn.values()], "o-", color="k", label="synthetic head")
    scored = [(k, r) for k, r in result["eval"].items() if r.get("score_auroc") is not None]
    for i, (k, r) in enumerate(scored):
        ax.plot(r["score_auroc"], r["cost_model_speedup"], "s", color=f"C{i % 10}", label=k)
    for k, style in (("oracle", ":"), ("static_opt", "--")):
        if k in result["eval"]:
            ax.axhline(result["eval"][k]["cost_model_speedup"], ls=style, color="grey", lw=1)
            ax.annotate(k, (ax.get_xlim()[0], result["eval"][k]["cost_model_speedup"]), fontsize=7, color="grey",
                        xytext=(2, 2), textcoords="offset points")
    ax.set_xlabel("AUROC of the score the policy thresholds (eval traces)")
    ax.set_ylabel("cost-model speedup")
    ax.set_title("What a stop rule of a given AUROC gains")
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def run(cfg: DictConfig) -> dict:
    rc = cfg.replay
    if not rc.get("tune") or not rc.get("eval"):
        raise UserError("pass the trace folders: replay.tune=VAL_TRACES replay.eval=TEST_TRACES (greedy target_ar, "
                        "python -m data_gen trace=target_ar split=validation|test limit=N)")
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
    out = output_dir(rc.get("out_dir"))
    out.mkdir(parents=True, exist_ok=True)
    per_prompt = {k: r.pop("per_prompt") for k, r in table.items() if "per_prompt" in r}
    (out / "replay.json").write_text(json.dumps(result, indent=1) + "\n")
    # one row per (method, eval continuation): what eval.bar's paired bootstrap resamples
    (out / "prompts.jsonl").write_text(jsonl_text(
        {"method": key, "prompt_id": pid, "new_tokens": pp["new_tokens"][i], "cost_ms": pp["cost_ms"][i],
         "target_cost_ms": pp["target_cost_ms"][i]}
        for key, pp in per_prompt.items() for i, pid in enumerate(pp["prompt_id"])))
    (out / "replay.md").write_text(markdown(result))
    # decode's tuned.json format: `python -m decode ... tuned=OUT/tuned.json` decodes with the replay's choices
    tuned_file = {"metric": "cost_model_speedup (eval.replay)", "split": str(rc.tune),
                  "chosen": {m.key: dict(m.params) for m in chosen}}
    (out / "tuned.json").write_text(json.dumps(tuned_file, indent=1) + "\n")
    plot(result, out / "replay_auroc.png")
    wandb_log.log_replay(result, out)  # no-op unless logger=wandb
    print(markdown(result))
    print(f"wrote {out / 'replay.json'}, replay.md, prompts.jsonl, tuned.json{', replay_auroc.png' if aurocs else ''}")
    return result


@hydra_entry("replay", open_dicts=("policy",))
def main(cfg: DictConfig) -> None:
    with wandb_log.session(cfg, output_dir(cfg.replay.get("out_dir")), "replay"):  # logger=wandb: offline W&B run
        run(cfg)


if __name__ == "__main__":
    main()
