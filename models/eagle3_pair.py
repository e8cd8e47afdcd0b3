"""The EAGLE-3 draft (models.eagle3) on a pair: loaded for decoding (`load_for_pair`), as the draft LM a token tree
grows from (`TreeDraft`: decode's eagle3_tree and data_gen's eagle_tree traces), and its cost profile
(`draft_profile`: its own step, and a round's first call as it runs)."""

from __future__ import annotations

import json
import time

import torch

from models.eagle3 import Eagle3
from utils.cli import UserError

_PROFILES: dict = {}  # (weights, pair profile key) → an EAGLE-3 draft's profile (draft_profile)


class TreeDraft:
    """EAGLE-3 as the draft LM models.tree.grow calls: `(logits, None)` of tokens after the cache, full-width (−inf
    off the head's subset). The pending call reads true features: `feats` holds the fused ones of draft positions
    `feats_at`, `feats_at` + 1, ... (decode: the committed tokens' own; data_gen's tree traces: a whole sequence's,
    from 0). A call on tree nodes feeds each node its parent's output — the last position before its own that its
    mask row attends (its deepest ancestor, or the last true-feature position for the root's children)."""

    def __init__(self, model: Eagle3, vocab: int):
        self.model, self.vocab = model, vocab
        self.device, self.support = model.ids.device, model.ids
        self.feats: torch.Tensor | None = None
        self.feats_at = 0
        self.outs = torch.empty(0, model.cfg.hidden, device=self.device, dtype=next(model.parameters()).dtype)

    def new_cache(self):
        return self.model.new_cache()

    def keep(self, cache, idx) -> None:
        """Keep cache positions `idx`: a prefix only (a node is never kept: its feature was the draft's guess)."""
        if list(idx) != list(range(len(idx))):
            raise ValueError("the EAGLE-3 tree draft keeps a prefix of its cache only")
        cache.crop(len(idx))

    def __call__(self, tokens: list[int], cache, last: int, positions=None, mask=None):
        m, n, start = self.model, len(tokens), cache.length
        if mask is None:
            h = self.feats[start - self.feats_at : start - self.feats_at + n]
        else:
            cols = torch.arange(mask.shape[-1], device=mask.device)
            before = mask & (cols[None] < (start + torch.arange(n, device=mask.device))[:, None])
            h = self.outs[torch.where(before, cols[None], -1).max(-1).values]
        out = m.step(torch.tensor(tokens, device=self.device), h, cache, positions, mask)
        if self.outs.shape[0] < start + n:
            grown = self.outs.new_empty(max(2 * self.outs.shape[0], start + n, 512), self.outs.shape[1])
            grown[:start] = self.outs[:start]
            self.outs = grown
        self.outs[start : start + n] = out
        z = m.logits(out[-last:]).float()
        return z.new_full((last, self.vocab), float("-inf")).index_copy_(1, m.ids, z), None


def load_for_pair(pair, weights: str | None, quantize: str | None) -> tuple[Eagle3, str]:
    """The saved draft (`weights`; None: the pair's `eagle3.weights`) on the pair's target, in its dtype and device,
    prepared for drafting (models.eagle3
    `prepare`: the pair's linear products; int8 where `quantize` says, `pair` following pair.draft.quantize)."""
    from pathlib import Path

    from models.student import REPO_ROOT

    q = pair.cfg.draft.get("quantize") if quantize == "pair" else quantize
    if q not in (None, "int8"):
        raise UserError(f"drafter eagle3's quantize must be pair, int8 or null, got '{quantize}'")
    if weights is None:  # the drafter's yaml leaves it to the pair
        weights = (pair.cfg.get("eagle3") or {}).get("weights")
        if weights is None:
            raise UserError(f"pair {pair.pair_id} names no EAGLE-3 draft (pair.eagle3.weights); pass "
                            "drafter.eagle3.weights=PATH, or train one with python -m train.eagle")
    path = Path(str(weights))
    path = path if path.is_absolute() else REPO_ROOT / path
    model = Eagle3.load(path, pair.target).to(device=pair.device, dtype=pair.dtype).eval()
    from models.lm_head import int8_float_rows

    return model.prepare(pair.linear, int8=q == "int8", float_rows=int8_float_rows(pair.cfg.draft)), str(path)


def draft_profile(model: Eagle3, weights: str, profile, target=None):
    """The pair's profile with the draft's curves measured on this draft (its step on n new tokens after
    `profile.context` cached positions, a tree level of n nodes likewise, a prefill as one call on the prompt,
    medians of 15 timed calls): what its rounds cost, for the cost model, the expected-value rule and the tree
    builders. A round's first call (`draft_cold_ms`) is timed as it runs, given the `target` LM: right after a
    target pass, the committed tokens' features fused and two of them run (a round's first call feeds accepted + 1
    tokens; EAGLE-3 accepts about one a round on MBPP). It costs 2.8× a warm one-token step (0.88 vs 0.31 ms, 2-core
    EPYC, bf16, 2026-11-29), which is what it was priced as before. The later calls of a round (`draft_ms`, a tree's
    level calls) are timed after a target pass and a round's first call too (`_round_start`), not back to back: the
    draft's ~19 MB fit a CPU's last-level cache and a 135M target's pass evicts them, so a back-to-back step is
    warmer than any the loop makes — priced so, EAGLE-3's draft time in the loop ran 31-57% over its model (MBPP
    20 × 64, `python -m eval.wall_gap`, 2026-11-29 12:57). Measured once per weights, profile and target."""
    import dataclasses

    if profile is None:
        return None
    key = (weights, json.dumps(profile.key, sort_keys=True, default=str), target is not None)
    if key not in _PROFILES:
        later = None if target is None else _round_start(model, target, profile.context)
        ms = [_step_ms(model, n, profile.context, before=later) for n in range(1, len(profile.draft_ms) + 1)]
        level = None if not profile.draft_level_ms else [
            _step_ms(model, n, profile.context, tree=True, before=later)
            for n in range(1, len(profile.draft_level_ms) + 1)]
        pre = [_step_ms(model, L, 0) for L in profile.prefill_lengths]
        cold = ms[0] if target is None else _first_call_ms(model, target, profile.context)
        _PROFILES[key] = dataclasses.replace(profile, key={**profile.key, "drafter": "eagle3"}, draft_ms=ms,
                                             draft_cold_ms=cold, prefill_draft_ms=pre, draft_level_ms=level)
    return _PROFILES[key]


def _target_round(m: Eagle3, target, context: int, rows: int):
    """What a round's draft calls follow: a target cache prefilled to `context` and a closure making a round's
    3-token target pass (then cropping it), with the ids and a round's first-call inputs (`rows` committed tokens,
    their features)."""
    dev, dtype = m.ids.device, next(m.parameters()).dtype
    ids = [(100 + i) % target.vocab for i in range(context + 3)]
    tcache = target.new_cache()
    target(ids[:context], tcache, last=0)
    toks, feats = torch.tensor(ids[:rows], device=dev), torch.zeros(rows, 3, m.cfg.hidden, device=dev, dtype=dtype)

    def target_pass():
        target(ids[context : context + 3], tcache, last=3)
        tcache.crop(-3)
    return ids, target_pass, toks, feats


@torch.inference_mode()
def _first_call_ms(m: Eagle3, target, context: int, rows: int = 2, repeats: int = 15) -> float:
    """A round's first draft call as decode.eagle3 runs it, after a target pass over 3 tokens (`draft_profile`)."""
    ids, target_pass, toks, feats = _target_round(m, target, context, rows)
    dcache = m.new_cache()
    m.step(torch.tensor(ids[:context], device=toks.device),
           torch.zeros(context, m.cfg.hidden, device=toks.device, dtype=feats.dtype), dcache)

    def setup():
        target_pass()
        dcache.crop(context)
    return _median_ms(lambda: m.logits(m.step(toks, m.fuse(feats), dcache)[-1:]), setup, repeats)


@torch.inference_mode()
def _round_start(m: Eagle3, target, context: int, rows: int = 2):
    """An untimed setup: a target pass over 3 tokens, then a round's first draft call (on a cache of its own), so a
    timed call after it finds the caches as a round's second call does."""
    _, target_pass, toks, feats = _target_round(m, target, context, rows)
    dcache = m.new_cache()

    def setup():
        target_pass()
        m.logits(m.step(toks, m.fuse(feats), dcache)[-1:])
        dcache.crop(0)
    return setup


def _median_ms(call, setup, repeats: int) -> float:
    """Median ms of `call` over `repeats` timed runs after 3 untimed ones, `setup` (untimed) before each."""
    times = []
    for _ in range(repeats + 3):
        setup()
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1000)
    return float(sorted(times[3:])[repeats // 2])


@torch.inference_mode()
def _step_ms(m: Eagle3, n: int, context: int, tree: bool = False, repeats: int = 15, before=None) -> float:
    dev = m.ids.device
    h = torch.zeros(context + n, m.cfg.hidden, device=dev, dtype=next(m.parameters()).dtype)
    toks = torch.zeros(context + n, dtype=torch.long, device=dev)
    cache = m.new_cache()
    if context:
        m.step(toks[:context], h[:context], cache)
    tree_args = {}
    if tree:  # n nodes that each see the context and themselves: a level's call (its mask, its positions)
        mask = torch.zeros(n, context + n, dtype=torch.bool, device=dev)
        mask[:, :context] = True
        mask[:, context:] = torch.eye(n, dtype=torch.bool, device=dev)
        tree_args = {"positions": torch.full((n,), context, device=dev), "mask": mask}
    def setup():
        if before is not None:
            before()
        cache.crop(context)
    return _median_ms(lambda: m.logits(m.step(toks[context:], h[context:], cache, **tree_args)), setup, repeats)
