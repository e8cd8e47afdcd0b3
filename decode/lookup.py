"""Prompt lookup: candidates copied from the context, at no model cost (`lookup`), and a model drafter falling back
on it (`student+lookup`, `eagle3+lookup`: PlusLookup).

As transformers' `prompt_lookup_num_tokens` and llama.cpp's lookup decoding: the longest suffix of the context
(prompt + output so far, and the tokens drafted this round) of n ≤ `ngram` tokens that occurred before proposes
the token that followed its latest occurrence (models.features.context.ContextIndex.lookup: the same proposal the
`copy` feature group's lookup_hit names), and drafting goes on from the extended context until no suffix recurs,
the stop policy stops, or `max_len`.

Its confidence signal, what stop policies read: the matched n-gram occurred C times before and was followed by the
proposal c of them; q puts n·c/(n·C + 1) on the proposal, the other candidates likewise by their counts, and the
rest, 1/(n·C + 1), spread evenly over the vocabulary (additive smoothing with pseudo-count 1/n: a longer, more often
repeated match is surer). SVIP reads its entropy, max-confidence its top probability; the expected-value rule
prices it on this drafter's profile, where a draft step costs nothing. The proposal is deterministic, so exact
sampling verifies it as a point mass (accepted with probability p(x)): lossless for any signal.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from decode.drafter import Chain, Drafter, Sampling, Verdict, build_drafter
from decode.lm_drafters import Student
from models.features.context import ContextIndex
from models.features.signals import DraftStep
from utils.cli import UserError


class Lookup(Drafter):
    name = "lookup"

    def __init__(self, pair, policy=None, ngram: int = 3, min_ngram: int = 1, max_len: int = 10):
        if not 1 <= int(min_ngram) <= int(ngram):
            raise UserError(f"drafter lookup: need 1 ≤ min_ngram ≤ ngram, got min_ngram={min_ngram}, ngram={ngram}")
        cap = int(max_len) if policy is None else min(int(max_len), policy.max_len)
        super().__init__(policy, cap)
        self.ngram, self.min_ngram = int(ngram), int(min_ngram)
        self.vocab = int(pair.vocab_size)

    @classmethod
    def runs(cls, policy_cls) -> str | None:
        if Student.delegate(policy_cls) is not None:
            return "prompt lookup drafts chains: no trees, SPRINTER or transformers' loop"
        if policy_cls.needs_hidden or policy_cls.learned:
            return "prompt lookup has no hidden state for a head to read"
        return None

    def profile_of(self, profile):
        """The pair's profile with every draft cost zero: a lookup is a dict probe, not a model call, so its
        verification passes follow another target pass (priced as `target_ms`, not `verify_ms`)."""
        if profile is None:
            return None
        zero = [0.0] * len(profile.draft_ms)
        return dataclasses.replace(profile, draft_ms=zero, draft_cold_ms=0.0, verify_ms=None,
                                   prefill_draft_ms=[0.0] * len(profile.prefill_draft_ms),
                                   draft_level_ms=None if profile.draft_level_ms is None else [0.0] * len(
                                       profile.draft_level_ms))

    def describe(self) -> dict:
        return {"name": self.name, "ngram": self.ngram, "min_ngram": self.min_ngram, "max_len": self.max_len,
                **({"policy": self.policy.describe()} if self.policy is not None else {})}

    def start(self, prompt_ids, s: Sampling, lookahead=None) -> None:
        from models.features import layout

        if self.ngram > layout.LOOKUP_N:
            raise UserError(f"drafter lookup: ngram ≤ {layout.LOOKUP_N} (models.features.layout.LOOKUP_N)")
        self.s = s
        self.index = ContextIndex(prompt_ids, counts=True)
        self.position = 0
        if self.policy is not None:
            self.policy.reset(lookahead=lookahead)

    def match(self) -> tuple[int | None, int]:
        """(proposal, n) of the context's longest recurring suffix of min_ngram ≤ n ≤ ngram tokens ((None, 0): none)."""
        prop, n = self.index.lookup()
        return (prop, n) if prop is not None and self.min_ngram <= n <= self.ngram else (None, 0)

    def signal(self, n: int) -> torch.Tensor:
        """The confidence distribution q (module docstring) over the matched n-gram's followers."""
        after = {t: c for t, c in self.index.followers(n).items() if c > 0 and t < self.vocab}
        scale = n * sum(after.values()) + 1.0
        q = torch.full((self.vocab,), 1.0 / (scale * self.vocab))
        for tok, c in after.items():
            q[tok] += n * c / scale
        return q

    def propose(self, budget: int, res) -> Chain:
        now = time.perf_counter
        rnd = Chain([], source=self)
        mark = self.index.mark()
        ts = now()
        for j in range(min(self.max_len, budget)):
            tok, n = self.match()
            if tok is None:
                break
            rnd.tokens.append(tok)
            if not self.s.greedy:
                point = torch.zeros(self.vocab)
                point[tok] = 1.0
                rnd.qs.append(point)
            stop = False
            if self.policy is not None:
                q = self.signal(n) if self.policy.needs_probs else None
                te = now()
                res.draft_s += te - ts
                stop = self.policy.should_stop(DraftStep(probs=q, token=tok, hidden=None, position_in_round=j,
                                                         position=self.position + j))
                ts = now()
                res.policy_s += ts - te
            self.index.push(tok)
            if stop:
                rnd.stopped = True
                break
            if tok in self.s.eos:
                break
        self.index.rollback(mark)
        res.draft_s += now() - ts
        return rnd

    def commit(self, v: Verdict, res) -> None:
        ts = time.perf_counter()
        for tok in v.kept + [v.next]:
            self.index.push(tok)
        self.position += len(v.kept) + 1
        if self.policy is not None and getattr(v.proposal, "source", None) is self:
            self.policy.observe(v.drafted, len(v.kept))
        res.draft_s += time.perf_counter() - ts


class PlusLookup(Drafter):
    """Prompt lookup where the context has a match of at least `min_ngram` tokens, a model drafter otherwise
    (`inner`, by name: `student+lookup`, `eagle3+lookup`); one stop policy asks both (each from its own signal). The
    model drafter's state skips the lookup's rounds and catches up on the committed tokens at its next call (the
    student's cache: decode.lm_drafters; EAGLE-3's true features: decode.eagle3), so it needs the target's features
    the inner drafter names (`layers`) after every round, and its rounds are priced on its own profile."""

    def __init__(self, pair, policy, inner: str = "student", ngram: int = 3, min_ngram: int = 2, max_len: int = 10,
                 inner_params: dict | None = None, model: Drafter | None = None):
        super().__init__(policy)
        self.inner = model or build_drafter(inner, pair, policy, inner_params)  # eval.replay: the trace's draft
        self.name = f"{inner}+lookup"
        self.lookup = Lookup(pair, policy, ngram, min_ngram, max_len)
        self.max_len = max(self.inner.max_len, self.lookup.max_len)
        self.layers, self.heads_from = tuple(self.inner.layers), self.inner.heads_from

    @classmethod
    def runs(cls, policy_cls) -> str | None:
        return Lookup.runs(policy_cls)

    def profile_of(self, profile):
        return self.inner.profile_of(profile)

    def describe(self) -> dict:
        return {"name": self.name, "inner": self.inner.describe(), "lookup": self.lookup.describe(),
                "policy": self.policy.describe()}

    def start(self, prompt_ids, s: Sampling, lookahead=None) -> None:
        self.inner.start(prompt_ids, s, lookahead)
        self.lookup.start(prompt_ids, s, lookahead)

    def propose(self, budget: int, res) -> Chain:
        rnd = self.lookup.propose(budget, res) if self.lookup.match()[0] is not None else None
        return rnd if rnd is not None and rnd.tokens else self.inner.propose(budget, res)

    def commit(self, v: Verdict, res) -> None:
        self.inner.commit(v, res)
        self.lookup.commit(v, res)
