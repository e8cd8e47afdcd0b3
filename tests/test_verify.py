"""Verification rules on fixed tiny distributions: the emitted law is p (exact) or (1−ε)p + εq (SPRINTER).

Power of the chi-square tests (α = 0.001, N = 10 000 draws, 4 categories, min expected count ≥ 1 000): a shift of 0.02
of probability mass between two categories of mass ≈ 0.25 gives non-centrality λ = N·Σδ²/p ≈ 32, power ≈ 0.98 —
e.g. forgetting the residual renormalisation or sampling corrections from p instead of norm(max(0, p − q)) shifts far
more than that. The SPRINTER test also checks it would have rejected plain p.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from eval.theory import sprinter_mixture
from decode.verify import greedy_verify, residual, sample_verify, sprinter_verify
from models.distributions import tvd

P = torch.tensor([[0.50, 0.25, 0.15, 0.10], [0.10, 0.20, 0.30, 0.40], [0.25, 0.25, 0.25, 0.25]])
Q = torch.tensor([[0.20, 0.40, 0.10, 0.30], [0.40, 0.30, 0.20, 0.10]])
N = 10_000
ALPHA = 1e-3


def _chi2_ok(counts: np.ndarray, probs: torch.Tensor) -> float:
    probs = probs.double().numpy()
    expected = probs / probs.sum() * counts.sum()
    return chisquare(counts, expected).pvalue


def test_residual_is_normalised_positive_part():
    r = residual(P[0], Q[0])
    expect = torch.tensor([0.30, 0.0, 0.05, 0.0]) / 0.35
    assert torch.allclose(r, expect, atol=1e-6)
    assert torch.allclose(residual(P[0], P[0]), P[0])  # nothing to correct: falls back to p


def test_greedy_verify_first_mismatch_and_bonus():
    tgt = torch.tensor([3, 7, 1, 9])
    assert greedy_verify(tgt, torch.tensor([3, 7, 2])) == (2, 1)
    assert greedy_verify(tgt, torch.tensor([3, 7, 1])) == (3, 9)  # all pass: bonus = argmax after them
    assert greedy_verify(tgt, torch.tensor([0, 7, 1])) == (0, 3)
    assert greedy_verify(tgt[:1], torch.tensor([], dtype=torch.long)) == (0, 3)


def test_exact_sampling_emits_target_distribution_at_both_positions():
    g = torch.Generator().manual_seed(0)
    first, second = np.zeros(4), np.zeros(4)
    for _ in range(N):
        xs = torch.stack([torch.multinomial(Q[j], 1, generator=g)[0] for j in range(2)])
        n, nxt = sample_verify(P, Q, xs, g)
        emitted = xs[:n].tolist() + [nxt]
        first[emitted[0]] += 1
        if n >= 1:  # the second token of the round (kept draft token, correction or bonus) given the first was kept
            second[emitted[1]] += 1
    assert _chi2_ok(first, P[0]) > ALPHA
    assert _chi2_ok(second, P[1]) > ALPHA
    assert _chi2_ok(first, Q[0]) < ALPHA  # the draft's own law is far away: the test has teeth


@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_sprinter_emits_mixture_for_known_fpr(eps):
    """A verifier that accepts with probability ε whatever the token (every accept here is a false positive,
    i.e. FPR ε): kept tokens follow q, verifier rejects go through exact rejection sampling (→ p)."""
    g = torch.Generator().manual_seed(1)
    counts = np.zeros(4)
    for _ in range(N):
        x = torch.multinomial(Q[0], 1, generator=g)
        accepted_by_verifier = bool(torch.rand(1, generator=g) < eps)
        n, nxt = sprinter_verify(P[:2], Q[:1], x, last_rejected=not accepted_by_verifier, greedy=False, generator=g)
        counts[x.item() if n == 1 else nxt] += 1
    law = torch.from_numpy(sprinter_mixture(P[0].numpy(), Q[0].numpy(), eps))  # eval.theory: Theorem 1
    assert _chi2_ok(counts, law) > ALPHA
    if eps > 0:
        assert _chi2_ok(counts, P[0]) < ALPHA


def test_sprinter_keeps_verifier_accepted_prefix_unchecked():
    # the target strongly disagrees with every drafted token, but only the last (verifier-rejected) one is checked
    p = torch.tensor([[0.0, 1.0]] * 4)
    q = torch.tensor([[1.0, 0.0]] * 3)
    drafted = torch.tensor([0, 0, 0])
    n, nxt = sprinter_verify(p, q, drafted, last_rejected=True, greedy=True)
    assert (n, nxt) == (2, 1)
    n, nxt = sprinter_verify(p, q, drafted, last_rejected=False, greedy=True)  # cap reached, nothing rejected
    assert (n, nxt) == (3, 1)


def test_tvd():
    assert float(tvd(P[0], Q[0])) == pytest.approx(0.35)
