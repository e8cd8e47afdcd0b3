"""Run one split: target-only once + every method on the same prompts, in one process; no files written here.

Per prompt, target-only decoding runs first and then each method (interleaved, so slow drift of a shared machine
hits every method alike); a warm-up generation of every method precedes all timing. A method is a stop policy on a
drafter (decode.drafter): its own (`drafters` unset) or each listed one; each drafter's rows are priced on its own
cost profile (`Drafter.profile_of`) and its c is measured from its own timed draft steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from decode import metrics
from decode.loop import autoregressive, speculative
from decode.methods import Method
from decode.drafter import Drafter, for_policy
from decode.policies import build_policy
from utils.cli import UserError


@dataclass(frozen=True)
class Decoding:
    """The generation settings every method of a run shares (read once from the config)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    warmup: bool = True
    tie_tol: float | None = None  # greedy near-tie tolerance; None: `tie_ulps` ulps of the pair's dtype
    tie_ulps: float = 4.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> Decoding:
        return cls(int(cfg.max_new_tokens), float(cfg.temperature), float(cfg.top_p), int(cfg.seed),
                   bool(cfg.get("warmup", True)), cfg.get("tie_tol"), float(cfg.get("tie_ulps", 4)))


@dataclass
class SplitResult:
    summary: dict  # {method key: metrics}, target first
    rows: list[dict]  # one per method × prompt
    by_task: dict  # {task: summary}; {} unless the prompts carry several tasks (Spec-Bench)


def check_settings(cfg: DictConfig) -> None:
    """Everything the user can get wrong that needs no model: fail before loading anything."""
    if int(cfg.max_new_tokens) <= 0:
        raise UserError(f"max_new_tokens must be > 0, got {cfg.max_new_tokens}")
    if float(cfg.temperature) < 0:
        raise UserError(f"temperature must be ≥ 0 (0 = greedy), got {cfg.temperature}")
    if not 0 < float(cfg.top_p) <= 1:
        raise UserError(f"top_p must be in (0, 1], got {cfg.top_p}")
    if float(cfg.temperature) == 0 and float(cfg.top_p) < 1:
        raise UserError("top_p < 1 only applies when sampling; set temperature > 0 or top_p=1")
    if not cfg.policies:
        raise UserError("policies is empty; list some, e.g. policies=[constant,svip]")


def tokenize_prompts(pair, prompts, max_new_tokens: int) -> list[list[int]]:
    """Rendered, tokenized prompts; refuses one that does not fit the models' context with its new tokens."""
    from data_gen.prompts import render

    ctx = min(
        int(getattr(m.config, "max_position_embeddings", 1 << 30) or (1 << 30)) for m in (pair.target, pair.draft)
    )
    out = []
    for p in prompts:
        ids = pair.tokenizer(render(p, pair.tokenizer, pair.chat_template),
                             add_special_tokens=not pair.chat_template)["input_ids"]
        if not ids:
            raise UserError(f"prompt {p.prompt_id} is empty after tokenization")
        if len(ids) + max_new_tokens > ctx:
            raise UserError(
                f"prompt {p.prompt_id} has {len(ids)} tokens + max_new_tokens={max_new_tokens} > context {ctx}; "
                "lower max_new_tokens or use shorter prompts"
            )
        out.append(ids)
    return out


def _generate(pair, drafter: Drafter | None, prompt_ids: list[int], d: Decoding, eos: set[int], seed: int,
              lookahead=None):
    """One generation: target-only when `drafter` is None, else speculative with it."""
    g = torch.Generator()
    g.manual_seed(seed)
    if drafter is None:
        return autoregressive(pair, prompt_ids, d.max_new_tokens, d.temperature, d.top_p, eos, g)
    return speculative(pair, prompt_ids, drafter, d.max_new_tokens, d.temperature, d.top_p, eos, g,
                       lookahead=lookahead)


def run_split(pair, prompts, methods: list[Method], profile, d: Decoding, desc: str) -> SplitResult:
    """Target-only + methods on `prompts`. `profile` (models.cost) costs the cost-model speedup."""
    ids = tokenize_prompts(pair, prompts, d.max_new_tokens)
    eos = pair.eos_ids
    drafters = _drafters(pair, methods, profile)
    if d.warmup:  # first calls allocate caches and pick kernels: keep them out of the timings
        warm = replace(d, max_new_tokens=min(8, d.max_new_tokens))
        ref = _generate(pair, None, ids[0], warm, eos, d.seed)
        for dr in drafters.values():
            _generate(pair, dr, ids[0], warm, eos, d.seed, ref.tokens)
        drafters = _drafters(pair, methods, profile)  # adaptive state (heuristic K, AdaEDL λ) starts afresh
    rows = _decode_prompts(pair, prompts, ids, methods, drafters, d, eos, desc)
    if d.greedy:
        tie_margins(pair, rows, dict(zip([p.prompt_id for p in prompts], ids)), drafters, d.tie_tol, d.tie_ulps)
    tasks = sorted({r["task"] for r in rows if r.get("task")})
    by_task = {t: _summarize([r for r in rows if r.get("task") == t], methods, drafters, profile, d.greedy)
               for t in tasks} if len(tasks) > 1 else {}
    summary = _summarize(rows, methods, drafters, profile, d.greedy)
    drift = summary["target"].get("profile_drift")
    if drift is not None and abs(drift) > PROFILE_DRIFT:
        print(f"warning: this run's target-only step is {100 * drift:+.0f}% off its cost profile's ({profile.date}): "
              "the cost model's speedups and prices are stale — remeasure on an idle machine with "
              "profile.refresh=true", flush=True)
    return SplitResult(summary, rows, by_task)


def _drafters(pair, methods: list[Method], profile) -> dict:
    """A fresh drafter (with a fresh policy) per method, keyed like the tables. A policy that reads the cost profile
    reads its drafter's (`Drafter.profile_of`: prompt lookup's draft steps are free, EAGLE-3's its own)."""
    out = {}
    for m in methods:
        name = m.drafter or "student"
        pol = build_policy(m.spec, m.params, pair=pair, profile=profile, target=m.target)
        dr = for_policy(name, pair, pol, m.drafter_params)
        own = dr.profile_of(profile)
        if own is not profile and type(pol).wants_profile(m.params, getattr(pol, "bundle", None)):
            dr = for_policy(name, pair, build_policy(m.spec, m.params, pair=pair, profile=own, target=m.target),
                            m.drafter_params)
        out[m.key] = dr
    return out


def _approx(drafter) -> bool:
    """Whether a method's verification is approximate (SPRINTER's): a drafter's policy says, or a bare policy."""
    return bool(getattr(getattr(drafter, "policy", drafter), "approximate", False))


def _decode_prompts(pair, prompts, ids, methods, drafters, d: Decoding, eos, desc: str) -> list[dict]:
    """Per prompt: target-only, then every method with the same seed; one row per method × prompt."""
    rows: list[dict] = []
    bar = tqdm(total=len(prompts) * (1 + len(methods)), desc=desc, unit="gen")
    for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids)):
        seed = d.seed * 100003 + i
        task = {"task": prompt.meta["task"]} if prompt.meta.get("task") else {}
        ref = _generate(pair, None, prompt_ids, d, eos, seed)
        bar.update()
        ref_text = pair.tokenizer.decode(ref.tokens, skip_special_tokens=True)
        rows.append({"method": "target", "prompt_id": prompt.prompt_id, "prompt_tokens": len(prompt_ids),
                     **metrics.record(ref, None), "tokens": ref.tokens, "text": ref_text, **task})
        if prompt.reference and any(_approx(dr) for dr in drafters.values()):
            rows[-1]["rouge_l_ref"] = metrics.rouge_l(ref_text, prompt.reference)
        for m in methods:
            dr = drafters[m.key]
            res = _generate(pair, dr, prompt_ids, d, eos, seed, ref.tokens if d.greedy else None)
            bar.update()
            row = {"method": m.key, "prompt_id": prompt.prompt_id, "prompt_tokens": len(prompt_ids),
                   **metrics.record(res, ref), "tokens": res.tokens, **task}
            row["text"] = pair.tokenizer.decode(res.tokens, skip_special_tokens=True)
            if _approx(dr):
                row["rouge_l_target"] = metrics.rouge_l(row["text"], ref_text)
                row["rouge_l_ref"] = metrics.rouge_l(row["text"], prompt.reference) if prompt.reference else None
            rows.append(row)
    bar.close()
    return rows


def _measured_cost_ratio(rows: list[dict], target_rows: list[dict]) -> float:
    """Draft step time ÷ target step time from our loop's timed steps (transformers' loop exposes no split; a
    drafter without model calls, prompt lookup, counts each drafted token as a step)."""
    return metrics.measured_c(sum(r["draft_s"] for r in rows), sum(r["draft_calls"] or r["drafted"] for r in rows),
                              *target_steps(target_rows))


def target_steps(target_rows: list[dict]) -> tuple[float, int]:
    """Target-only's decode steps after its prefill call (target_s excludes that call): (seconds, steps), the unit
    both c and `profile_drift` divide by."""
    return sum(r["target_s"] for r in target_rows), sum(r["target_calls"] - 1 for r in target_rows)


def _summarize(rows: list[dict], methods: list[Method], drafters: dict, profile, greedy: bool) -> dict:
    """Per method: its metrics on its drafter's profile, and c measured over every method of the same drafter
    (the student's chain and tree rows together when `drafters` is unset, as before)."""
    target_rows = [r for r in rows if r["method"] == "target"]
    summary = {"target": metrics.target_summary(target_rows)}
    own = [m for m in methods if not drafters[m.key].policy or not getattr(drafters[m.key].policy, "external", False)]
    by = {}
    for m in own:
        by.setdefault(m.drafter, []).extend(r for r in rows if r["method"] == m.key)
    c_of = {name: _measured_cost_ratio(rs, target_rows) for name, rs in by.items()}
    for m in methods:
        dr = drafters[m.key]
        pol = dr.policy
        own_profile = dr.profile_of(profile)
        s = metrics.summarize([r for r in rows if r["method"] == m.key], target_rows, own_profile, greedy,
                              not _approx(dr))
        if own_profile is not None and own_profile is not profile:  # what its cost model read, for eval.wall_gap
            s["own_profile"] = own_profile.drafter_parts()
        s.update(oracle=bool(getattr(pol, "oracle", False)), approximate=_approx(dr), params=pol.describe(),
                 measured_c=c_of.get(m.drafter, float("nan")), external=bool(getattr(pol, "external", False)),
                 drafter=m.drafter or "student", **weights_record(dr))
        summary[m.key] = s
    summary["target"]["measured_c"] = c_of.get(None, next(iter(c_of.values()), float("nan")))
    drift = profile_drift(target_rows, profile)
    if drift is not None:
        summary["target"]["profile_drift"] = drift
    return summary


def weights_record(drafter) -> dict:
    """{"draft_weights": {path, fingerprint}} for a drafter that read a weights file of its own (EAGLE-3's): what
    a row was decoded with is the file's content, not a path that a longer training run may overwrite."""
    from pathlib import Path

    from models.pair import REPO_ROOT, file_fingerprint

    weights = getattr(drafter, "weights", None)
    if not weights or not Path(weights).is_file():
        return {}
    path = Path(weights)
    shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    return {"draft_weights": {"path": str(shown), "fingerprint": file_fingerprint(path)}}


PROFILE_DRIFT = 0.15  # beyond timing noise: two back-to-back profiles of one machine agree within 0.07 (models.cost)


def profile_drift(target_rows: list[dict], profile) -> float | None:
    """This run's target-only step time ÷ its profile's target step − 1 (None without either). A profile timed in
    a slow spell prices every call too dear: the 1.5B pair's first one (3 rounds) put the target step at 85 ms, the
    decode run right after it at 62 (2-core EPYC, bf16, 2026-11-29), and eval.wall_gap found the gap only later."""
    seconds, steps = target_steps(target_rows)
    if profile is None or not steps:
        return None
    return 1000 * seconds / steps / float(profile.target_ms[0]) - 1


@torch.inference_mode()
def tie_margins(pair, rows: list[dict], prompt_ids: dict, drafters: dict, tie_tol=None, tie_ulps: float = 4.0) -> None:
    """For each greedy exact output that differs from target-only: the target's logit margin between the two
    tokens at the first divergence, from one untimed full pass over prompt + common prefix, and the tolerance below
    which that margin is a tie (`tie_tol` if set, else `tie_ulps` ulps of the pair's dtype at the larger logit).
    A margin within it is a near-tie argmax flipped by low-precision numerics (a 1-token step vs a multi-token
    verify pass round differently), not a bug."""
    ref = {r["prompt_id"]: r["tokens"] for r in rows if r["method"] == "target"}
    for r in rows:
        if r["method"] == "target" or r.get("matches_target", True) or _approx(drafters[r["method"]]):
            continue
        j = r["prefix_match"]
        a, b = ref[r["prompt_id"]], r["tokens"]
        if j >= min(len(a), len(b)):  # one output is a prefix of the other (EOS): not a tie
            r["divergence_margin"], r["divergence_tol"] = float("inf"), 0.0
            continue
        x = torch.tensor([prompt_ids[r["prompt_id"]] + a[:j]], device=pair.device)
        logits = pair.target(x).logits[0, -1, : pair.vocab_size].float()
        r["divergence_margin"] = float((logits[a[j]] - logits[b[j]]).abs())
        magnitude = float(torch.maximum(logits[a[j]].abs(), logits[b[j]].abs()))
        r["divergence_tol"] = (float(tie_tol) if tie_tol is not None
                               else metrics.tie_tolerance(str(pair.dtype), magnitude, tie_ulps))
