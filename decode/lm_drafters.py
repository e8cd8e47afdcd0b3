"""Drafters over the pair's draft LM (the standalone student, or any `pair.draft`): a chain asking a stop policy
after each token (`student`), a token tree shaped by a builder (`tree`), and SPRINTER's approximate chain
(`sprinter`). Each keeps the draft's KV cache in step with the committed text (decode.drafter's interface).

Chain rollback. The draft never runs on its own last drafted token, so after a verification that kept n of k drafted
tokens the draft cache drops k − 1 − n positions and runs next on the target's token (and on the last drafted token
too after a fully accepted round: 2 tokens). A round another drafter proposed (a composite's) leaves the draft cache
as it was: it runs next on its pending tokens, the kept ones and the target's token.
"""

from __future__ import annotations

import time

import torch

from decode.drafter import ApproxChain, Chain, Drafter, Sampling, TreeProposal, Verdict
from models.distributions import verification_stats
from models.features.context import ContextIndex
from models.features.signals import DraftStep, VerifyStats, compared
from models.lm import LM


def verify_stats(p: torch.Tensor | None, logits: torch.Tensor, qs: list, support, k: int, n: int) -> VerifyStats:
    """models.features.signals.VerifyStats of one verification that drafted k and kept n, from p (sampling) or the
    target's logits (greedy) at positions 0..n: models.distributions.verification_stats over the `compared`
    positions."""
    m = int(compared(k, n))
    ent, margin, tv = verification_stats(logits[: n + 1], None if p is None else p[: n + 1], qs, m, support)
    return VerifyStats.of(ent, margin, tv, k, n)


class Student(Drafter):
    """Today's chain: the draft LM drafts one token per call until its stop policy says stop (the token that stops
    it stays in the round, so does an EOS). What it computes per token follows the policy's needs: q as a
    distribution (sampling, `needs_probs`, verification statistics), the hidden state, the context, the last
    verification's statistics."""

    name = "student"
    proposal = Chain

    def __init__(self, pair, policy):
        super().__init__(policy)
        self.draft = LM.of(pair, "draft")

    @classmethod
    def delegate(cls, policy_cls) -> str | None:
        if getattr(policy_cls, "external", False):
            return "hf_assisted"
        if getattr(policy_cls, "tree", False):
            return "tree"
        if getattr(policy_cls, "approximate", False):
            return "sprinter"
        return None

    @classmethod
    def runs(cls, policy_cls) -> str | None:
        return None if cls.delegate(policy_cls) is None else "a chain drafter runs chain stop policies"

    def start(self, prompt_ids, s: Sampling, lookahead=None) -> None:
        pol = self.policy
        self.s = s
        self.want_vs = bool(pol.needs_verify_stats)
        self.want_q = (not s.greedy) or bool(pol.needs_probs) or self.proposal.approximate or self.want_vs
        self.want_h, self.want_ctx = bool(pol.needs_hidden), bool(pol.needs_context)
        pol.reset(lookahead=lookahead)
        self.cache = self.draft.new_cache()
        self.pending = list(prompt_ids)  # the first call is the prefill, shaped like transformers' generate
        self.ctx = list(prompt_ids) if self.want_ctx else None
        self.vstats, self.position, self.qs_support = None, 0, []

    def propose(self, budget: int, res) -> Chain:
        """Draft up to min(max_len, budget) tokens, asking the policy after each; draft and policy time to `res`."""
        now, s, draft = time.perf_counter, self.s, self.draft
        rnd, inp = self.proposal([], source=self), self.pending
        self.qs_support = []
        for j in range(min(self.max_len, budget)):
            ts = now()
            logits, hidden = draft(inp, self.cache, last=1)
            q, tok = s.draw(logits[0], self.want_q)
            te = now()
            res.draft_s += te - ts
            res.draft_calls += 1
            rnd.tokens.append(tok)
            if self.want_q:
                rnd.qs.append(q)
            step = DraftStep(probs=q, token=tok, hidden=hidden[0] if self.want_h else None, position_in_round=j,
                             position=self.position + j, context=self.ctx, verify=self.vstats, support=draft.support)
            stop = self.policy.should_stop(step)
            if self.want_vs and s.greedy and not rnd.approximate:
                self.qs_support.append(step.on_support())
            res.policy_s += now() - te
            if stop:
                rnd.stopped = True
                break
            if tok in s.eos:
                break
            inp = [tok]
        return rnd

    def commit(self, v: Verdict, res) -> None:
        mine = v.proposal is not None and getattr(v.proposal, "source", None) is self
        if self.want_vs and mine:  # the policy's input, timed as policy time
            ts = time.perf_counter()
            qs = v.proposal.qs if v.p is not None else self.qs_support
            self.vstats = verify_stats(v.p, v.logits, qs, self.draft.support, v.drafted, len(v.kept))
            res.policy_s += time.perf_counter() - ts
        self.pending = self._rollback(v) if mine else self.pending + v.kept + [v.next]
        if mine:
            ts = time.perf_counter()
            self.policy.observe(v.drafted, len(v.kept))
            res.policy_s += time.perf_counter() - ts
        new = v.kept + [v.next]
        self.position += len(new)
        if self.ctx is not None:
            self.ctx.extend(new)

    def _rollback(self, v: Verdict) -> list[int]:
        """Crop the rejected positions from the draft cache; the tokens the draft runs on next (module docstring)."""
        k, n, drafted = v.drafted, len(v.kept), v.proposal.tokens
        if k == 0:
            return self.pending + [v.next]
        if n == k:
            return [drafted[-1], v.next]
        if k - 1 - n > 0:
            self.cache.crop(-(k - 1 - n))
        return [v.next]

    def describe(self) -> dict:
        return self.policy.describe()


class Sprinter(Student):
    """SPRINTER (Zhong et al.): the student's chain, with a verifier head as its stop policy and approximate
    verification — verifier-accepted tokens are kept without the target (lossy; decode.verify.sprinter_verify)."""

    name = "sprinter"
    proposal = ApproxChain

    @classmethod
    def runs(cls, policy_cls) -> str | None:
        return None if getattr(policy_cls, "approximate", False) else "sprinter runs SPRINTER's verifier heads"


class StudentTree(Drafter):
    """Token trees from the draft LM (decode.tree), shaped by a builder (decode.tree_builders): grown level by level,
    verified in one tree-attention pass; both caches keep the accepted path. A builder whose node head reads the
    root context or the last verification's (H_p, margin) gets them here (models.tree.Tree.context / .verify)."""

    name = "tree"

    def __init__(self, pair, policy):
        super().__init__(policy)
        self.draft = LM.of(pair, "draft")

    @classmethod
    def runs(cls, policy_cls) -> str | None:
        return None if getattr(policy_cls, "tree", False) else "a tree drafter runs tree builders"

    def start(self, prompt_ids, s: Sampling, lookahead=None) -> None:
        self.s = s
        self.policy.reset(lookahead=lookahead)
        self.cache = self.draft.new_cache()
        self.pending = list(prompt_ids)
        self.want_vs = bool(self.policy.needs_verify_stats)
        # the root context as an n-gram index (models.features.nodes.node_copy_columns pushes each node's path onto
        # it and takes it back) and the last verification's (H_p, margin), (0, 0) at first
        self.cindex = ContextIndex(prompt_ids) if self.policy.needs_context else None
        self.tstats = (0.0, 0.0) if self.want_vs else None

    def propose(self, budget: int, res) -> TreeProposal:
        from decode.tree import grow

        tree, prefix_len, nodes = grow(self.draft, self.cache, self.pending, self.policy, self.s,
                                       min(self.max_len, budget), res, self.cindex, self.tstats)
        res.tree_levels.append(list(tree.levels))
        return TreeProposal(tree, prefix_len, nodes)

    def commit(self, v: Verdict, res) -> None:
        from decode.tree import root_stats

        ts = time.perf_counter()
        self._commit_cache(v)
        res.target_s += time.perf_counter() - ts  # the cache compaction, booked with the verification as before
        ts = time.perf_counter()
        if self.want_vs:
            self.tstats = root_stats(v.z_next, self.s)
        self.policy.observe(v.drafted, len(v.kept))
        if self.cindex is not None:
            for tok in v.kept + [v.next]:
                self.cindex.push(tok)
        res.policy_s += time.perf_counter() - ts

    def _commit_cache(self, v: Verdict) -> None:
        """The draft cache keeps the accepted path; the draft's pending tokens are what it has not run on."""
        from decode.tree import commit_draft

        prop = v.proposal
        self.pending = commit_draft(self.draft, self.cache, prop.tree, prop.prefix_len, v.path, v.next)

    def describe(self) -> dict:
        return self.policy.describe()
