"""The EAGLE-3 drafter (`drafters=[eagle3]`): chains from one decoder layer on the target's own features
(models.eagle3), under any chain stop policy.

It names the target layers it reads (`layers`), so every verification hands it the target's hidden states there,
at the pending token(s) and the accepted path. The first round proposes nothing: the target's prefill gives the
prompt's features. Each later round first runs the draft over the tokens committed since (each with the target's
feature at the position before it: true features, kept in the draft's cache), then drafts: step j + 1 reads the
token step j chose and step j's own output as its feature. After the verification the cache drops the drafted
positions (they were run on the draft's features, not the target's) and the committed tokens wait for the next round
with their true features — so a drafted position is never kept on a guessed feature.

`DraftStep.hidden` is the layer's output (the draft's guess of the target's next feature), for heads that read it.
"""

from __future__ import annotations

import json
import time

import torch

from decode.drafter import Chain, Drafter, Sampling, Verdict
from decode.lm_drafters import Student
from models.eagle3 import Eagle3, Eagle3Cache
from models.features.signals import DraftStep


_PROFILES: dict = {}  # (weights, pair profile key) → this draft's profile


class Eagle3Drafter(Drafter):
    name = "eagle3"

    def __init__(self, pair, policy, weights: str):
        from pathlib import Path

        from models.student import REPO_ROOT

        super().__init__(policy)
        path = Path(str(weights))
        path = path if path.is_absolute() else REPO_ROOT / path
        self.model = Eagle3.load(path, pair.target).to(device=pair.device, dtype=pair.dtype).eval()
        self.weights = str(path)
        self.layers = tuple(self.model.cfg.layers)
        self.vocab = int(pair.vocab_size)
        self.support = self.model.ids

    @classmethod
    def runs(cls, policy_cls) -> str | None:
        if Student.delegate(policy_cls) is not None:
            return "EAGLE-3 drafts chains here (trees on it are issue 53's next step)"
        if policy_cls.learned:
            return "a stop head trained on the student's traces does not read EAGLE-3's features"
        return None

    def profile_of(self, profile):
        """The pair's profile with the draft's curves measured on this draft (its step on n new tokens after
        `profile.context` cached positions, medians of 15 timed calls; the first step of a round is priced as a warm
        one, and a prefill as one call on the prompt): what its rounds cost, for the cost model and the
        expected-value rule. Measured once per drafter object."""
        import dataclasses

        if profile is None:
            return None
        key = (self.weights, json.dumps(profile.key, sort_keys=True, default=str))
        if key not in _PROFILES:
            ms = [self._step_ms(n, profile.context) for n in range(1, len(profile.draft_ms) + 1)]
            pre = [self._step_ms(L, 0) for L in profile.prefill_lengths]
            _PROFILES[key] = dataclasses.replace(profile, key={**profile.key, "draft": "eagle3"}, draft_ms=ms,
                                                 draft_cold_ms=ms[0], prefill_draft_ms=pre, draft_level_ms=None)
        return _PROFILES[key]

    @torch.inference_mode()
    def _step_ms(self, n: int, context: int, repeats: int = 15) -> float:
        m, dev = self.model, self.model.ids.device
        h = torch.zeros(context + n, m.cfg.hidden, device=dev, dtype=next(m.parameters()).dtype)
        toks = torch.zeros(context + n, dtype=torch.long, device=dev)
        cache = Eagle3Cache()
        if context:
            m.step(toks[:context], h[:context], cache)
        times = []
        for _ in range(repeats + 3):
            cache.crop(context)
            t0 = time.perf_counter()
            m.step(toks[context:], h[context:], cache)
            times.append((time.perf_counter() - t0) * 1000)
        return float(sorted(times[3:])[repeats // 2])

    def describe(self) -> dict:
        return {"name": self.name, "layers": list(self.layers), "policy": self.policy.describe()}

    def start(self, prompt_ids, s: Sampling, lookahead=None) -> None:
        self.s, self.seq = s, list(prompt_ids)
        self.cache = Eagle3Cache()
        self.feed: tuple[list[int], torch.Tensor] | None = None  # committed tokens and their true features
        self.want_q = (not s.greedy) or bool(self.policy.needs_probs)
        self.policy.reset(lookahead=lookahead)
        self.position = 0

    def _full(self, scores: torch.Tensor) -> torch.Tensor:
        """Subset scores (len(ids),) → logits over the target's vocabulary, −inf outside the subset."""
        out = scores.new_full((self.vocab,), float("-inf"))
        return out.index_copy_(0, self.model.ids, scores)

    @torch.inference_mode()
    def propose(self, budget: int, res) -> Chain:
        rnd = Chain([], source=self)
        if self.feed is None:  # before the target's prefill: nothing to read yet
            self.base = self.cache.length
            return rnd
        now, s, m = time.perf_counter, self.s, self.model
        ts = now()
        toks, feats = self.feed
        out = m.step(torch.tensor(toks, device=feats.device), m.fuse(feats), self.cache)[-1:]
        self.base = self.cache.length  # true-feature positions; the chain's are dropped at commit
        res.draft_calls += 1
        for j in range(min(self.max_len, budget)):
            q, tok = s.draw(self._full(m.logits(out)[0]), self.want_q)
            te = now()
            res.draft_s += te - ts
            rnd.tokens.append(tok)
            if q is not None:
                rnd.qs.append(q)
            stop = self.policy.should_stop(DraftStep(probs=q, token=tok, hidden=out[0], position_in_round=j,
                                                     position=self.position + j, support=self.support))
            ts = now()
            res.policy_s += ts - te
            if stop:
                rnd.stopped = True
                break
            if tok in s.eos or j + 1 == min(self.max_len, budget):
                break
            out = m.step(torch.tensor([tok], device=out.device), out, self.cache)
            res.draft_calls += 1
        res.draft_s += now() - ts
        return rnd

    def commit(self, v: Verdict, res) -> None:
        self.cache.crop(self.base)
        self.seq += v.kept + [v.next]
        n = v.hidden.shape[1]  # features at the pending token(s) and the kept path: one per token to feed
        self.feed = (self.seq[-n:], v.hidden.permute(1, 0, 2))
        if getattr(v.proposal, "source", None) is self:
            self.policy.observe(v.drafted, len(v.kept))
        self.position += len(v.kept) + 1
