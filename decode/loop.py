"""THE speculative loop (batch 1): draft with a stop policy, verify with the target, roll both KV caches back exactly.

Both models keep a KV cache (`models.lm.LM.new_cache`). The first call of each model runs the whole prompt;
afterwards the last emitted token is "pending" for the target, so every target call is [pending, x_1..x_K] → p at
K+1 positions. After a verification that kept n of K drafted tokens, `cache.crop(-m)` removes exactly the m rejected
positions from each cache (target: K − n; draft: K − 1 − n, since the draft never ran on its own last token).

Greedy (temperature 0) and sampling (temperature, top-p) share the loop; exact verification is lossless, SPRINTER
verification (`policy.approximate`) keeps verifier-accepted tokens unchecked. `autoregressive` is the target-only
baseline with the same model calls, so speedups compare like with like.

Speed: inference mode throughout; logits only for positions we read (the LM head is skipped during prefill and for
all but the last drafted position); q's softmax only when the policy or the sampler needs it; one host read per
drafted token (the token id, which the next draft step needs anyway) and one per verification.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from decode.tree import commit, grow, root_stats
from decode.tree import verify as tree_verify
from decode.verify import greedy_verify, sample_verify, sprinter_verify
from models.distributions import draft_probs, greedy_ids, tvd, verification_stats
from models.features.context import ContextIndex
from models.features.signals import DraftStep, VerifyStats, compared
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


def _verify_stats(p: torch.Tensor | None, logits: torch.Tensor, qs: list, support, k: int, n: int) -> VerifyStats:
    """models.features.signals.VerifyStats of one verification that drafted k and kept n, from p (sampling) or the
    target's logits (greedy) at positions 0..n: models.distributions.verification_stats over the `compared`
    positions."""
    m = int(compared(k, n))
    ent, margin, tv = verification_stats(logits[: n + 1], None if p is None else p[: n + 1], qs, m, support)
    return VerifyStats.of(ent, margin, tv, k, n)


@dataclass(frozen=True)
class _Settings:
    """What one call of `speculative` computes and how it samples: decided once, from the policy's flags
    (decode.policies: needs_probs, needs_hidden, needs_context, needs_verify_stats, approximate) and the settings."""

    temperature: float
    top_p: float
    generator: torch.Generator | None
    greedy: bool
    approx: bool  # SPRINTER verification: verifier-accepted tokens are kept unchecked
    want_q: bool  # q as a distribution (sampling, the policy, SPRINTER's TVD, the verification statistics)
    want_h: bool  # the draft's last hidden state
    want_ctx: bool  # the context (prompt + output, one list kept in step with the output): disco_plus heads
    want_vs: bool  # the last verification's statistics: disco_plus heads

    @classmethod
    def of(cls, policy, temperature: float, top_p: float, generator) -> _Settings:
        greedy = not (temperature and temperature > 0)
        approx, want_vs = bool(policy.approximate), bool(policy.needs_verify_stats)
        want_q = (not greedy) or bool(policy.needs_probs) or approx or want_vs
        return cls(temperature, top_p, generator, greedy, approx, want_q, bool(policy.needs_hidden),
                   bool(policy.needs_context), want_vs)


@dataclass
class _Round:
    """One round's drafted tokens and what its verification reads of them."""

    tokens: list[int] = field(default_factory=list)
    qs: list = field(default_factory=list)  # q of each drafted token (when computed)
    qs_support: list = field(default_factory=list)  # greedy + verification statistics: q on the draft's support
    verifier_stop: bool = False  # the policy ended the round (for SPRINTER: its verifier rejected the last token)


def _draft_round(draft: LM, dcache, inp: list[int], policy, s: _Settings, k_cap: int, base: int, ctx, vstats,
                 eos: set[int], res: GenResult) -> _Round:
    """Draft up to `k_cap` tokens after `inp`, asking the policy after each (the token that stops it stays in the
    round; so does an EOS); draft and policy time go to `res`."""
    now = time.perf_counter
    rnd = _Round()
    for j in range(k_cap):
        ts = now()
        logits, hidden = draft(inp, dcache, last=1)
        z = logits[0]
        if s.greedy:
            q = draft_probs(z, 0.0) if s.want_q else None
            tok = int(greedy_ids(z))
        else:
            q = draft_probs(z, s.temperature, s.top_p)
            tok = int(torch.multinomial(q, 1, generator=s.generator))
        te = now()
        res.draft_s += te - ts
        res.draft_calls += 1
        rnd.tokens.append(tok)
        if s.want_q:
            rnd.qs.append(q)
        step = DraftStep(probs=q, token=tok, hidden=hidden[0] if s.want_h else None, position_in_round=j,
                         position=base + j, context=ctx, verify=vstats, support=draft.support)
        stop = policy.should_stop(step)
        if s.want_vs and s.greedy and not s.approx:
            rnd.qs_support.append(step.on_support())
        res.policy_s += now() - te
        if stop:
            rnd.verifier_stop = True
            break
        if tok in eos:
            break
        inp = [tok]
    return rnd


def _verify_round(target: LM, tcache, t_pending: list[int], rnd: _Round, s: _Settings, res: GenResult):
    """One target pass over the pending token + the round: (n drafted tokens kept, the target's token after them,
    p — None under greedy verification, which needs no distribution — and the logits). SPRINTER verification also
    counts its unchecked tokens and their TVD into `res`."""
    k = len(rnd.tokens)
    logits, _ = target(t_pending + rnd.tokens, tcache, last=k + 1)
    res.target_calls += 1
    if s.greedy and not s.approx:
        n, nxt = greedy_verify(greedy_ids(logits), torch.tensor(rnd.tokens, dtype=torch.long))
        return n, nxt, None, logits
    p = draft_probs(logits, s.temperature, s.top_p)
    q_stack = torch.stack(rnd.qs) if k else p[:0]
    dt = torch.tensor(rnd.tokens, dtype=torch.long, device=p.device)
    if s.approx:
        n, nxt = sprinter_verify(p, q_stack, dt, rnd.verifier_stop, s.greedy, s.generator)
        unchecked = k - 1 if (rnd.verifier_stop and k) else k
        if unchecked:
            res.unchecked += unchecked
            res.tvd_sum += float(tvd(p[:unchecked], q_stack[:unchecked]).sum())
    else:
        n, nxt = sample_verify(p, q_stack, dt, s.generator)
    return n, nxt, p, logits


def _rollback(dcache, tcache, d_pending: list[int], drafted: list[int], n: int, nxt: int) -> list[int]:
    """Exact rollback after keeping n of the drafted tokens: crop the rejected positions from both caches (target:
    k − n; draft: k − 1 − n, as it never ran on its own last token). Returns the tokens the draft runs on next."""
    k = len(drafted)
    if k - n > 0:
        tcache.crop(-(k - n))
    if k == 0:
        return d_pending + [nxt]
    if n == k:
        return [drafted[-1], nxt]
    if k - 1 - n > 0:
        dcache.crop(-(k - 1 - n))
    return [nxt]


def _tree_round(draft: LM, target: LM, dcache, tcache, d_pending, t_pending, builder, s: _Settings, budget: int,
                res: GenResult, cindex=None, tstats=None) -> tuple[list[int], int, list[int], int, tuple | None]:
    """One token-tree round (decode.tree): grow, verify, keep the accepted path in both caches. Returns (accepted
    tokens, the target's next token, the draft's pending tokens, verified nodes, and — when `s.want_vs` — the
    verification's (H_p, margin) at the distribution that token came from, for the next round's tree). `cindex` /
    `tstats`: the root context (a ContextIndex of prompt + output) and the last such numbers, handed to the tree
    for builders whose node head reads them (models.tree.Tree.context / .verify)."""
    tree, prefix_len, nodes = grow(draft, dcache, d_pending, builder, s, budget, res, cindex, tstats)
    res.tree_levels.append(list(tree.levels))
    ts = time.perf_counter()
    path, nxt, z = tree_verify(target, tcache, t_pending, tree, nodes, s, res)
    d_pending = commit(draft, target, dcache, tcache, tree, prefix_len, path, nxt)
    te = time.perf_counter()
    res.target_s += te - ts
    if s.want_vs:  # the builder's input, timed as policy time (as the chain's VerifyStats)
        tstats = root_stats(z, s)
        res.policy_s += time.perf_counter() - te
    return [tree.tokens[i] for i in path], nxt, d_pending, len(nodes), tstats


def _chain_round(draft, target, dcache, tcache, d_pending, t_pending, policy, s, budget, position, ctx, vstats, eos,
                 res):
    """One chain round: draft, verify, the verification's statistics (for policies that ask), roll both caches back.
    Returns (kept drafted tokens, the target's next token, the draft's pending tokens, drafted count, VerifyStats)."""
    now = time.perf_counter
    rnd = _draft_round(draft, dcache, d_pending, policy, s, budget, position, ctx, vstats, eos, res)
    k = len(rnd.tokens)
    ts = now()
    n, nxt, p, logits = _verify_round(target, tcache, t_pending, rnd, s, res)
    te = now()
    res.target_s += te - ts
    if s.want_vs:  # the policy's work, timed as policy time
        vstats = _verify_stats(p, logits, rnd.qs if p is not None else rnd.qs_support, draft.support, k, n)
        res.policy_s += now() - te
    d_pending = _rollback(dcache, tcache, d_pending, rnd.tokens, n, nxt)
    return rnd.tokens[:n], nxt, d_pending, k, vstats


@torch.inference_mode()
def speculative(pair, prompt_ids: list[int], policy, max_new_tokens: int, temperature: float = 0.0,
                top_p: float = 1.0, eos: set[int] | None = None, generator: torch.Generator | None = None,
                lookahead: list[int] | None = None) -> GenResult:
    """Speculative decoding of one prompt with `policy` (decode.policies); see the module docstring. Each round:
    draft (`_draft_round`), verify (`_verify_round`), roll both caches back (`_rollback`), commit."""
    s = _Settings.of(policy, temperature, top_p, generator)
    eos = eos or set()
    draft, target = LM.of(pair, "draft"), LM.of(pair, "target")
    clock = Clock(target.device)
    now = time.perf_counter

    t0 = clock()
    policy.reset(lookahead=lookahead)
    dcache, tcache = draft.new_cache(), target.new_cache()
    out: list[int] = []
    res = GenResult(tokens=out)
    tree = bool(getattr(policy, "tree", False))
    ctx = list(prompt_ids) if s.want_ctx and not tree else None  # a chain head's context (a tree's: cindex)
    vstats = None
    # token trees whose node head reads them: the root context as n-gram index (models.features.nodes.node_copy_columns
    # pushes each node's path onto it and takes it back) and the last verification's (H_p, margin), (0, 0) at first
    cindex = ContextIndex(prompt_ids) if tree and s.want_ctx else None
    tstats = (0.0, 0.0) if tree and s.want_vs else None
    # tokens each model has not run on yet: the whole prompt at first (the first calls are the prefills, shaped
    # like transformers' generate, so low-precision numerics match plain decoding as closely as possible); then
    # 1 token, or 2 for the draft after a fully accepted round
    d_pending = list(prompt_ids)
    t_pending = list(prompt_ids)
    done = False
    while not done and len(out) < max_new_tokens:
        budget = min(policy.max_len, max_new_tokens - len(out) - 1)
        if tree:  # a token-tree round (decode.tree); a chain is the width-1 case below
            kept, nxt, d_pending, k, tstats = _tree_round(draft, target, dcache, tcache, d_pending, t_pending, policy,
                                                          s, budget, res, cindex, tstats)
        else:
            kept, nxt, d_pending, k, vstats = _chain_round(draft, target, dcache, tcache, d_pending, t_pending, policy,
                                                           s, budget, len(out), ctx, vstats, eos, res)
        t_pending = [nxt]
        n = len(kept)

        res.drafted += k
        res.accepted += n
        res.rounds.append((k, n))
        ts = now()
        policy.observe(k, n)
        res.policy_s += now() - ts
        new, done = _eos_cut(kept + [nxt], eos)
        out.extend(new)
        if ctx is not None:
            ctx.extend(new)
        if cindex is not None:  # the builder's input: policy time
            ts = now()
            for tok in new:
                cindex.push(tok)
            res.policy_s += now() - ts
    res.wall_s = clock() - t0
    return res
