"""Verification of one draft round: exact greedy, exact sampling (lossless), and SPRINTER's approximate rule.

All functions take the target distributions p (K+1, V) for the K drafted positions plus the one after them, the
draft distributions q (K, V) the tokens were drafted from, and the drafted tokens (K,). They return
`(n_accepted, next_token)`: the first n drafted tokens are kept and `next_token` (a correction, or the bonus token
from p[K] when all K pass) follows them. One host sync per round (the decisions are read back together).

Exact sampling is Leviathan et al.'s rule: accept x with probability min(1, p(x)/q(x)), else resample from
norm(max(0, p − q)); its output is distributed exactly as p. SPRINTER (Zhong et al.) keeps every token its verifier
accepted without looking at p, and only rejection-samples the token the verifier rejected — the round's last one.
With a verifier that wrongly accepts with probability ε the emitted token is distributed as (1−ε)p + εq.
"""

from __future__ import annotations

import torch


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)); falls back to p where p ≤ q everywhere (then a rejection cannot happen anyway)."""
    r = (p - q).clamp_min(0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_verify(target_argmax: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    """Greedy: keep drafted tokens while they equal the target's argmax; the next token is the target's argmax there.

    `target_argmax` (K+1,) are argmax p at the K drafted positions and after them; `draft_tokens` (K,).
    """
    k = draft_tokens.shape[0]
    tgt = target_argmax.tolist()
    drafted = draft_tokens.tolist()
    n = 0
    while n < k and drafted[n] == tgt[n]:
        n += 1
    return n, tgt[n]


def sample_verify(
    p: torch.Tensor, q: torch.Tensor, draft_tokens: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """Exact speculative sampling: accept x_j with min(1, p/q) in order; resample the first rejection from the residual."""
    k = draft_tokens.shape[0]
    if k:
        idx = draft_tokens.view(-1, 1)
        px = p[:k].gather(1, idx).squeeze(1)
        qx = q.gather(1, idx).squeeze(1)
        u = torch.rand(k, generator=generator, device=p.device)
        # u < p/q  <=>  u·q < p  (no division; q(x) > 0 because x was drawn from q)
        reject = (u * qx >= px).tolist()
        for n, rej in enumerate(reject):
            if rej:
                return n, _sample(residual(p[n], q[n]), generator)
    return k, _sample(p[k], generator)


def sprinter_verify(
    p: torch.Tensor,
    q: torch.Tensor,
    draft_tokens: torch.Tensor,
    last_rejected: bool,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """SPRINTER: tokens the verifier accepted are kept as drafted; the verifier-rejected last token is checked exactly.

    `last_rejected` says whether the round ended on a verifier reject (it may also end at the length cap, the token
    budget or EOS, with every token verifier-accepted: then all are kept). The token after the kept ones is the
    exact correction, or the bonus from p when the checked token passes.
    """
    k = draft_tokens.shape[0]
    if k == 0 or not last_rejected:
        return k, (int(p[k].argmax()) if greedy else _sample(p[k], generator))
    j = k - 1
    if greedy:
        n, nxt = greedy_verify(p[j:].argmax(-1), draft_tokens[j:])
    else:
        n, nxt = sample_verify(p[j:], q[j:], draft_tokens[j:], generator)
    return j + n, nxt
