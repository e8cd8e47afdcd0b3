"""Distribution math on logits and probabilities: the draft's q, greedy ids, top-k, entropy, top-2 margin, TVD, and
the target's verification statistics from its logits.

Used by every stage that touches a distribution (data_gen's trace rows, decode's loop, verification and features), so
a number means the same everywhere; kept apart from models.features, which defines what a stop head reads. Each
function works along the last axis, in float32 where it matters, and says when a cheaper form gives the same values.
"""

from __future__ import annotations

import torch


def draft_probs(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0) -> torch.Tensor:
    """q over the vocabulary, in float32. Greedy (T=0) reports the T=1 distribution; top-p truncates and renormalises."""
    logits = logits.float()
    if temperature and temperature > 0:
        logits = logits / temperature
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        probs = top_p_filter(probs, top_p)
    return probs


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last axis, the first maximum as `argmax` returns it: via `max(-1)`, because torch 2.13's CPU
    argmax of bfloat16 runs scalar code (~180 µs over a 49k vocabulary on one core, every draft step and every
    verified position) while max(-1) is vectorised (~45 µs); float32 costs the same either way."""
    return logits.max(-1).indices


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose mass reaches top_p (always the top one), renormalised."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    sorted_p = torch.where(mass_before < top_p, sorted_p, torch.zeros_like(sorted_p))
    out = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return out / out.sum(-1, keepdim=True)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats along the last axis (0·log 0 = 0)."""
    return -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)


def on_support(q: torch.Tensor, support: torch.Tensor | None) -> torch.Tensor:
    """q read on the draft's support (a reduced vocabulary, models.lm.LM.support; all of q without one): q is exactly
    0 off it, so its top-k and entropy are the same there for a fraction of the work (a sixth on 8k-of-49k)."""
    return q if support is None else q.index_select(-1, support)


def support_entropy(q: torch.Tensor, support: torch.Tensor | None = None, mass: torch.Tensor | None = None):
    """H_q on the draft's support: the one definition DraftStep and models.tree.Tree.stats read (`mass`: q already
    read on the support, `on_support`)."""
    return entropy(on_support(q, support) if mass is None else mass)


def support_topk(q: torch.Tensor, k: int, support: torch.Tensor | None = None, mass: torch.Tensor | None = None,
                 ids: bool = False):
    """The k largest probabilities of q, best first, read on its support (`mass` as in `support_entropy`); with
    `ids`, (values, their token ids). A support narrower than k: the zeros off it fill the tail, so the full q is
    read. The one definition DraftStep's top-k and models.tree.Tree.stats (a builder's children) read; `ids=False`
    takes the two-stage `topk_probs`, the same values."""
    mass = on_support(q, support) if mass is None else mass
    if mass.shape[-1] < k:
        mass, support = q, None
    if not ids:
        return topk_probs(mass, k)
    v, i = mass.topk(min(k, mass.shape[-1]))
    return v, (i if support is None else support[i])


def verification_stats(logits: torch.Tensor | None, p: torch.Tensor | None, qs: list, m: int,
                       support: torch.Tensor | None = None):
    """(H_p and top-1 − top-2 of p at the last verified row, TVD(p, q) at the first m drafted rows): what one
    verification tells a stop head, the one definition of decode's chain rounds and tree roots. From p (r, V) when
    the verifier built it (sampling); else from the target's logits (r, V) and q on the draft's support
    (`logit_stats`, the same numbers for a fraction of the work)."""
    if p is None:
        return logit_stats(logits, support, torch.stack(qs[:m]) if m else None)
    tv = tvd(p[:m], torch.stack(qs[:m])) if m else p[:0, 0]
    return entropy(p[-1]), top2_margin(p[-1]), tv


def top2_margin(probs: torch.Tensor) -> torch.Tensor:
    """Largest minus second-largest probability along the last axis (how decided a distribution is); the two-stage
    top-k (`topk_probs`, the same values) because a plain top-2 over 49k entries cost ~125 µs per verification."""
    top = topk_probs(probs, 2)
    return top[..., 0] - top[..., 1]


def tvd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Total variation distance ½Σ|p − q| along the last axis (1 − TVD is the exact-sampling acceptance rate)."""
    return 0.5 * (p - q).abs().sum(-1)


def logit_stats(z: torch.Tensor, support: torch.Tensor | None = None, q_support: torch.Tensor | None = None):
    """What a verification tells a stop head, from the target's logits z (r, V) of greedy verification: (H_p and the
    top-2 margin of p = softmax(z) at the last row, TVD(p, q) for the first m rows of q given on its support) — the
    numbers of `entropy`, `top2_margin` and `tvd` (to float rounding) with a fraction of their work.

    Why: a 49k-wide entropy and TVD against stacked 49k-wide q's cost ~0.3 ms per round on one CPU core, as much as
    the head itself. Here the full-width work is one fused softmax per row plus, on the last row, its top-2 and one
    dot product: H = log Z − E_p[z] with log Z = max z − log max p (max p is the top-2's first value); and q is
    exactly 0 off its support, so TVD = ½(Σ_S |p − q| + 1 − Σ_S p) reads only the support's columns
    (`support=None`: q covers the vocabulary).
    """
    z = z.float()
    p = torch.softmax(z, dim=-1)
    last = z[-1].clamp_min(torch.finfo(z.dtype).min)  # a masked (−inf) logit has p = 0 and adds nothing to E_p[z]
    top = topk_probs(p[-1], 2)
    ent = last.max() - torch.log(top[0]) - torch.dot(p[-1], last)
    margin = top[0] - top[1]
    if q_support is None or len(q_support) == 0:
        return ent, margin, z.new_zeros(0)
    m = len(q_support)
    ps = p[:m] if support is None else p[:m].index_select(-1, support)
    tv = 0.5 * ((ps - q_support).abs().sum(-1) + 1.0 - ps.sum(-1))
    return ent, margin, tv


SMALL_TOPK = 16384  # up to this width (an FR-Spec draft's support) one plain top-k is fewer ops than two stages


def topk_probs(probs: torch.Tensor, k: int, chunk: int = 256) -> torch.Tensor:
    """The k largest probabilities, sorted descending (the values of `probs.topk(k)`, bit for bit).

    Two-stage, because a full top-k over a 49k vocabulary was the largest cost of the DISCO policy per drafted token
    (~90 µs on one CPU core; this takes ~25): split the vocabulary into chunks, keep the k chunks with the largest
    maxima, take the top-k of those. Exact: an element outside those chunks has k larger chunk maxima above it, so it
    cannot be among the k largest. The tail that does not fill a chunk is always kept.
    """
    vocab = probs.shape[-1]
    n = vocab // chunk
    if n < 2 * k or vocab <= SMALL_TOPK:
        return probs.topk(k, dim=-1).values
    lead = probs.shape[:-1]
    body = probs[..., : n * chunk].reshape(*lead, n, chunk)
    best = body.amax(-1).topk(k, dim=-1).indices
    cand = body.gather(-2, best.unsqueeze(-1).expand(*lead, k, chunk)).flatten(-2)
    if n * chunk < vocab:
        cand = torch.cat([cand, probs[..., n * chunk :]], dim=-1)
    return cand.topk(k, dim=-1).values
