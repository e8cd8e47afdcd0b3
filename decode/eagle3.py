"""The EAGLE-3 drafter (`drafters=[eagle3]`): chains from one decoder layer on the target's own features
(models.eagle3), under any chain stop policy — and token trees under any tree builder (`Eagle3Tree`, which
`eagle3` hands a builder to, as the student hands one to `tree`).

It names the target layers it reads (`layers`), so every verification hands it the target's hidden states there,
at the pending token(s) and the accepted path. The first round proposes nothing: the target's prefill gives the
prompt's features. Each later round first runs the draft over the tokens committed since (each with the target's
feature at the position before it: true features, kept in the draft's cache), then drafts: step j + 1 reads the
token step j chose and step j's own output as its feature. After the verification the cache drops the drafted
positions (they were run on the draft's features, not the target's) and the committed tokens wait for the next round
with their true features — so a drafted position is never kept on a guessed feature.

A stop head that reads the hidden state gets [the layer's output at the step (the draft's guess of the target's
next feature) ‖ the fused target feature the round began from], as trace=eagle_chain rows store it; heads trained
on those traces (HeadBundle.drafter "eagle3") are the ones this drafter runs.

A tree grows by the student's code (models.tree.grow: one call per level, tree attention); each node reads its
parent's output as its feature (the root's children: the last true-feature position's), and after the verification
the cache keeps no node: the accepted path is fed again with the target's features, as in a chain.
"""

from __future__ import annotations

import time

import torch

from decode.drafter import Chain, Drafter, Sampling, TreeProposal, Verdict
from decode.lm_drafters import Student, StudentTree
from models.eagle3_pair import TreeDraft, draft_profile, load_for_pair
from models.lm import LM
from models.features.signals import DraftStep


class _Loaded:
    """What both EAGLE-3 drafters share: the draft loaded for the pair, the target layers it reads, and the cost
    profile its rounds are priced on (its own step's curves)."""

    def _load(self, pair, weights: str | None, quantize: str | None) -> None:
        self.model, self.weights = load_for_pair(pair, weights, quantize)
        self.layers = tuple(self.model.cfg.layers)
        self.target = LM.of(pair, "target")

    def profile_of(self, profile):
        return draft_profile(self.model, self.weights, profile, self.target)

    def _refeed(self, v: Verdict) -> None:
        """After a verification: drop the drafted positions (run on the draft's own features) and queue the committed
        tokens with the target's features at the positions before them, for the next round's first call."""
        self.cache.crop(self.base)
        self.seq += v.kept + [v.next]
        n = v.hidden.shape[1]  # features at the pending token(s) and the kept path: one per token to feed
        feed = (self.seq[-n:], v.hidden.permute(1, 0, 2))
        if self.feed is not None:  # a round it did not draft (eagle3+lookup's lookup): its tokens still wait
            feed = (self.feed[0] + feed[0], torch.cat([self.feed[1], feed[1]]))
        self.feed = feed


class Eagle3Drafter(_Loaded, Drafter):
    name = "eagle3"
    heads_from = "eagle3"  # heads trained on trace=eagle_chain traces (data_gen.eagle_traces)

    def __init__(self, pair, policy, weights: str | None = None, quantize: str | None = "pair"):
        super().__init__(policy)
        self._load(pair, weights, quantize)
        self.vocab = int(pair.vocab_size)
        self.support = self.model.ids

    @classmethod
    def delegate(cls, policy_cls) -> str | None:
        return "eagle3_tree" if getattr(policy_cls, "tree", False) else None

    @classmethod
    def runs(cls, policy_cls) -> str | None:
        if Student.delegate(policy_cls) is not None:
            return "a chain drafter runs chain stop policies"
        return None

    def describe(self) -> dict:
        return {"name": self.name, "layers": list(self.layers), "policy": self.policy.describe()}

    def start(self, prompt_ids, s: Sampling, lookahead=None) -> None:
        self.s, self.seq = s, list(prompt_ids)
        self.cache = self.model.new_cache()
        self.feed: tuple[list[int], torch.Tensor] | None = None  # committed tokens and their true features
        self.base = 0  # positions run on true features (a lookup's round can come before its first)
        self.want_q = (not s.greedy) or bool(self.policy.needs_probs)
        self.want_hidden = bool(getattr(self.policy, "needs_hidden", False))
        self.policy.reset(lookahead=lookahead)
        self.position = 0

    @torch.inference_mode()
    def propose(self, budget: int, res) -> Chain:
        rnd = Chain([], source=self)
        if self.feed is None:  # before the target's prefill: nothing to read yet
            self.base = self.cache.length
            return rnd
        now, s, m = time.perf_counter, self.s, self.model
        ts = now()
        (toks, feats), self.feed = self.feed, None
        fused = m.fuse(feats)
        out = m.step(torch.tensor(toks, device=feats.device), fused, self.cache)[-1:]
        self.base = self.cache.length  # true-feature positions; the chain's are dropped at commit
        # a head reading the hidden state gets [the step's output ‖ the fused feature the round began from], as
        # eagle_chain traces store it (data_gen.eagle_traces)
        start_feature = fused[-1] if self.want_hidden else None
        res.draft_calls += 1
        for j in range(min(self.max_len, budget)):
            q, tok = s.draw(m.logits(out)[0], self.want_q, m.ids, self.vocab)
            te = now()
            res.draft_s += te - ts
            rnd.tokens.append(tok)
            if q is not None:
                rnd.qs.append(q)
            hidden = torch.cat([out[0], start_feature]) if self.want_hidden else out[0]
            stop = self.policy.should_stop(DraftStep(probs=q, token=tok, hidden=hidden, position_in_round=j,
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
        self._refeed(v)
        if getattr(v.proposal, "source", None) is self:
            self.policy.observe(v.drafted, len(v.kept))
        self.position += len(v.kept) + 1


class Eagle3Tree(_Loaded, StudentTree):
    """Token trees from the EAGLE-3 draft under a tree builder: the student's tree drafter (`StudentTree`) with the
    chain drafter's cache handling — the first round proposes nothing, each later one grows a tree after the
    committed tokens fed with their true features, and the cache then drops every node. A node head it runs was
    trained on EAGLE-3's candidate trees (trace=eagle_tree)."""

    name = "eagle3_tree"
    params_of = "eagle3"
    heads_from = "eagle3"

    def __init__(self, pair, policy, weights: str | None = None, quantize: str | None = "pair"):
        Drafter.__init__(self, policy)
        self._load(pair, weights, quantize)
        self.draft = TreeDraft(self.model, int(pair.vocab_size))

    def start(self, prompt_ids, s: Sampling, lookahead=None) -> None:
        super().start(prompt_ids, s, lookahead)
        self.seq = list(prompt_ids)
        self.feed: tuple[list[int], torch.Tensor] | None = None  # nothing to read before the target's prefill

    @torch.inference_mode()
    def propose(self, budget: int, res):
        if self.feed is None:
            self.base = self.cache.length
            return Chain([], source=self)
        (self.pending, feats), self.feed = self.feed, None  # consumed: _refeed queues the next round's anew
        self.draft.feats, self.draft.feats_at = self.model.fuse(feats), self.cache.length
        prop = super().propose(budget, res)
        self.base = prop.prefix_len
        # the target's prefix is one longer: the draft's position i holds token i + 1 (its first has no feature)
        return TreeProposal(prop.tree, len(self.seq), prop.nodes)

    def _commit_cache(self, v: Verdict) -> None:
        self._refeed(v)
