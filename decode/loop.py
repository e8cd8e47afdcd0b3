"""THE speculative loop (batch 1): rounds of propose → verify → commit, whatever proposes.

A round: the drafter (decode.drafter.Drafter: the student's chain or tree, prompt lookup, ...) proposes a chain or
a tree of candidates; the target runs once over its pending token(s) and the candidates (`Proposal.verify`: the
acceptance rule, and the target's KV cache cut back to the committed text and the accepted path); the drafter
commits the outcome into its own state and caches. The loop books the round and stops at EOS or the token budget.
It reads nothing about the drafter or its stop policy: eval.replay runs the same `rounds` with a trace standing in
for the target (`Verifier`).

The first target call runs the whole prompt (the prefill, shaped like transformers' generate); afterwards the last
emitted token is "pending" for the target, so every target call is [pending, candidates]. Greedy (temperature 0)
and sampling (temperature, top-p) share the loop; exact verification is lossless. `autoregressive` is the
target-only baseline with the same model calls, so speedups compare like with like.

Speed: inference mode throughout; logits only for positions we read; q's softmax only when the policy or the
sampler needs it; one host read per drafted token and one per verification.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from decode.drafter import Drafter, Sampling
from models.distributions import draft_probs, greedy_ids
from models.lm import LM, Clock


@dataclass
class GenResult:
    """One prompt's generation and its counters (metrics.py turns these into the reported numbers)."""

    tokens: list[int]
    wall_s: float = 0.0
    target_calls: int = 0
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per verification
    # token trees: per round, the nodes of each draft call after the root's (models.tree.Tree.levels; the cost model)
    tree_levels: list[list[int]] = field(default_factory=list)
    draft_s: float = 0.0  # time in draft forwards (incl. q and sampling)
    target_s: float = 0.0  # time in target forwards (incl. verification)
    policy_s: float = 0.0  # time in should_stop + observe
    unchecked: int = 0  # SPRINTER: tokens kept without the target
    tvd_sum: float = 0.0  # SPRINTER: Σ TVD(p, q) over unchecked tokens (the emitted law there is q, not p)


def _eos_cut(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], True
    return tokens, False


@torch.inference_mode()
def autoregressive(pair, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                   eos: set[int] | None = None, generator: torch.Generator | None = None) -> GenResult:
    """Target-only decoding with the same model calls as the speculative loop (the speedup baseline)."""
    lm = LM.of(pair, "target")
    clock = Clock(lm.device)
    eos = eos or set()
    t0 = clock()
    cache = lm.new_cache()
    t1 = t0
    out: list[int] = []
    pending = list(prompt_ids)  # the first call runs the whole prompt (the prefill), later calls one token
    res = GenResult(tokens=out)
    while len(out) < max_new_tokens:
        logits, _ = lm(pending, cache, last=1)
        res.target_calls += 1
        if res.target_calls == 1:
            t1 = clock()
        if temperature and temperature > 0:
            tok = int(torch.multinomial(draft_probs(logits[0], temperature, top_p), 1, generator=generator))
        else:
            tok = int(greedy_ids(logits[0]))
        out.append(tok)
        pending = [tok]
        if tok in eos:
            break
    t2 = clock()
    res.wall_s = t2 - t0
    res.target_s = t2 - t1  # decode steps after the prefill call: the per-step cost c is measured against
    return res


class Verifier:
    """The target side of a round: the target LM, its KV cache and its pending tokens."""

    def __init__(self, pair, prompt_ids: list[int], layers=()):
        self.lm = LM.of(pair, "target")
        self.cache = self.lm.new_cache()
        self.pending = list(prompt_ids)
        self.layers = tuple(layers)

    def verify(self, proposal, s: Sampling, res):
        ts = time.perf_counter()
        v = proposal.verify(self.lm, self.cache, self.pending, s, res, self.layers)
        res.target_s += time.perf_counter() - ts
        self.pending = [v.next]
        return v


def rounds(drafter: Drafter, verifier, s: Sampling, max_new_tokens: int, res: GenResult) -> GenResult:
    """Rounds until EOS or `max_new_tokens` (module docstring); a round drafts at most the tokens left − 1, so the
    target's own token always fits."""
    out, done = res.tokens, False
    while not done and len(out) < max_new_tokens:
        proposal = drafter.propose(max_new_tokens - len(out) - 1, res)
        v = verifier.verify(proposal, s, res)
        drafter.commit(v, res)
        res.drafted += v.drafted
        res.accepted += len(v.kept)
        res.rounds.append((v.drafted, len(v.kept)))
        new, done = _eos_cut(v.kept + [v.next], s.eos)
        out.extend(new)
    return res


def as_drafter(pair, drafter_or_policy) -> Drafter:
    """A drafter as given, or the drafter a stop policy runs on by default (decode.drafter.for_policy)."""
    if isinstance(drafter_or_policy, Drafter):
        return drafter_or_policy
    from decode.drafter import for_policy

    return for_policy("student", pair, drafter_or_policy)


@torch.inference_mode()
def speculative(pair, prompt_ids: list[int], drafter, max_new_tokens: int, temperature: float = 0.0,
                top_p: float = 1.0, eos: set[int] | None = None, generator: torch.Generator | None = None,
                lookahead: list[int] | None = None) -> GenResult:
    """Speculative decoding of one prompt by `drafter` (a decode.drafter.Drafter, or a stop policy: the student
    drafts under it, or the drafter it names — a tree for a builder); see the module docstring."""
    drafter = as_drafter(pair, drafter)
    own = drafter.generate(prompt_ids, max_new_tokens, temperature, top_p, eos or set(), generator)
    if own is not None:  # a drafter with its own loop (transformers' assisted generation)
        return own
    s = Sampling(temperature, top_p, generator, frozenset(eos or ()))
    clock = Clock(LM.of(pair, "target").device)
    t0 = clock()
    res = GenResult(tokens=[])
    drafter.start(list(prompt_ids), s, lookahead=lookahead)
    rounds(drafter, Verifier(pair, prompt_ids, drafter.layers), s, max_new_tokens, res)
    res.wall_s = clock() - t0
    return res
