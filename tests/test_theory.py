"""eval.theory against cases worked by hand (numbers in the comments), plus Monte Carlo checks of the mechanisms."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eval import theory

# A 3-token vocabulary worked by hand:
#   p = (0.5, 0.3, 0.2) target, q = (0.2, 0.3, 0.5) draft.
#   A = {q ≤ p} = {x1, x2} (x2 ties: acceptable), R = {q > p} = {x3}; TVD = ½(0.3 + 0 + 0.3) = 0.3.
#   SPRINTER with a verifier that accepts x3 (a false positive) with probability ε = 0.5:
#     x3 drawn (0.5): verifier accepts (×0.5) → 0.25 emitted x3; rejects (0.25): target keeps x3 with p/q = 0.4 → 0.10,
#     else (0.15) resamples from the residual (p − q)₊ = (0.3, 0, 0)/0.3 → all 0.15 to x1.
#     x1 drawn (0.2) is always emitted (target keeps it, p/q ≥ 1); x2 drawn (0.3) likewise.
#   Emitted: x1 = 0.2 + 0.15 = 0.35, x2 = 0.30, x3 = 0.25 + 0.10 = 0.35  ==  0.5·p + 0.5·q.
#   TVD(emitted, p) = ½(0.15 + 0 + 0.15) = 0.15 = ε · TVD(p, q).
P3 = np.array([0.5, 0.3, 0.2])
Q3 = np.array([0.2, 0.3, 0.5])


def test_three_token_sprinter_by_hand():
    assert theory.tvd(P3, Q3) == pytest.approx(0.3)
    # the verifier's behaviour on acceptable tokens (TPR) must not matter: try two different ones
    for v_acceptable in (1.0, 0.2):
        emitted = theory.sprinter_emitted_distribution(P3, Q3, [v_acceptable, v_acceptable, 0.5])
        np.testing.assert_allclose(emitted, [0.35, 0.30, 0.35], atol=1e-12)
    np.testing.assert_allclose(theory.sprinter_mixture(P3, Q3, 0.5), [0.35, 0.30, 0.35])
    assert theory.tvd(theory.sprinter_mixture(P3, Q3, 0.5), P3) == pytest.approx(0.15)
    assert theory.sprinter_tvd(0.5, 0.3) == pytest.approx(0.15)
    # perfect verifier (ε = 0) is lossless; ε = 1 emits q
    np.testing.assert_allclose(theory.sprinter_emitted_distribution(P3, Q3, [1, 1, 0]), P3, atol=1e-12)
    np.testing.assert_allclose(theory.sprinter_emitted_distribution(P3, Q3, 1.0), Q3, atol=1e-12)


def test_emitted_distribution_matches_simulation():
    rng = np.random.default_rng(0)
    p = np.array([0.4, 0.1, 0.05, 0.3, 0.15])
    q = np.array([0.1, 0.3, 0.2, 0.3, 0.1])
    v = np.array([0.9, 0.3, 0.7, 0.5, 0.2])  # FPR differs per over-proposed token: ε̄ is the excess-weighted one
    n = 200_000
    x = rng.choice(5, size=n, p=q)
    keep = rng.random(n) < v[x]
    keep |= rng.random(n) < np.minimum(1, p[x] / q[x])
    residual = np.clip(p - q, 0, None)
    out = np.where(keep, x, rng.choice(5, size=n, p=residual / residual.sum()))
    freq = np.bincount(out, minlength=5) / n
    exact = theory.sprinter_emitted_distribution(p, q, v)
    np.testing.assert_allclose(freq, exact, atol=5e-3)
    # its TVD from p is ε̄·TVD(p, q) with ε̄ = Σ_R v(q − p)/TVD = (0.3·0.2 + 0.7·0.15)/0.35
    eps_bar = (0.3 * 0.2 + 0.7 * 0.15) / 0.35
    assert theory.tvd(exact, p) == pytest.approx(eps_bar * 0.35)
    # and the row estimator on draws x ~ q recovers ε̄ and that TVD
    est = theory.sprinter_tvd_from_rows(q[x], p[x], rng.random(n) < v[x])
    assert est["tvd_pq_from_samples"] == pytest.approx(0.35, abs=5e-3)
    assert est["eps_weighted"] == pytest.approx(eps_bar, abs=1e-2)
    assert est["tvd_sprinter_from_samples"] == pytest.approx(eps_bar * 0.35, abs=5e-3)


def test_run_length_theorem2_by_hand():
    # β = 0.9, ε = 0.5, n = 2: P(N≥1) = 0.9, P(N≥2) = 0.81, P(N≥k) = 0.81·0.5^{k−2} after → 0.9 + 0.81 + 0.81 = 2.52
    assert theory.sprinter_run_length(0.9, 0.5, 2) == pytest.approx(2.52)
    assert theory.sprinter_run_length(1.0, 0.0, 7) == pytest.approx(7.0)  # perfect verifier: exactly n
    assert theory.sprinter_run_length(0.5, 0.0, math.inf) == pytest.approx(1.0)
    # geometric n: a = 0.5, β = 0.9, ε = 0.5 → 0.45/0.55 + 0.5·0.5/(0.5·0.55) = 0.8181.. + 0.9090.. = 1.7272..
    assert theory.sprinter_run_length_geometric(0.9, 0.5, 0.5) == pytest.approx(0.45 / 0.55 + 0.25 / 0.275)
    # the closed form equals Theorem 2 averaged over n ~ Geometric(a)
    a, b, e = 0.7, 0.85, 0.3
    avg = sum(a**m * (1 - a) * theory.sprinter_run_length(b, e, m) for m in range(400))
    assert theory.sprinter_run_length_geometric(b, e, a) == pytest.approx(avg, rel=1e-9)


def test_run_length_matches_simulation():
    rng = np.random.default_rng(1)
    b, e, n = 0.8, 0.4, 3
    counts = []
    for _ in range(40_000):
        k = 0
        while rng.random() < (b if k < n else e):
            k += 1
        counts.append(k)
    assert np.mean(counts) == pytest.approx(theory.sprinter_run_length(b, e, n), abs=0.03)


def test_leviathan_by_hand():
    # α = 0.8, γ = 4: (1 − 0.8^5)/0.2 = (1 − 0.32768)/0.2 = 3.3616; c = 0.25: ÷ (4·0.25 + 1) = 1.6808
    assert theory.expected_tokens_per_round(0.8, 4) == pytest.approx(3.3616)
    assert theory.improvement_factor(0.8, 4, 0.25) == pytest.approx(1.6808)
    assert theory.expected_tokens_per_round(1.0, 4) == 5
    # α = 0.8, c = 0.25: γ=1 1.44, γ=2 1.6267, γ=3 1.6869, γ=4 1.6808 → best γ = 3
    g, f = theory.best_gamma(0.8, 0.25)
    assert g == 3 and f == pytest.approx((1 - 0.8**4) / 0.2 / 1.75)
    # a costly draft never pays: c = 1 → best γ = 1 with factor (1 + α)/2 < 1
    assert theory.best_gamma(0.5, 1.0) == (1, pytest.approx(0.75))


def test_latency_model_by_hand():
    # eq. 9 (k = 1): (1 − p/2)(a + b); p = 0.8, a + b = 1.25 → 0.75
    assert theory.latency_per_token(0.8, 0.25, 1.0, 1) == pytest.approx(0.75)
    # k = 2, p = 0.5, a + b = 1: (1−p)/1 + p(1−p)/2 + p²/3 = 0.5 + 0.125 + 0.08333 = 0.70833
    assert theory.latency_per_token(0.5, 0.0, 1.0, 2) == pytest.approx(0.5 + 0.125 + 0.25 / 3)
    for k in (1, 2, 5, 9):
        assert theory.latency_per_token(0.7, 0.3, 1.0, k) == pytest.approx(theory.latency_per_token_recursive(0.7, 0.3, 1.0, k))
    rows = theory.speedup_curve(0.8, 0.25, range(1, 6))
    assert [r["gamma"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["latency_model"] == pytest.approx(1 / 0.75)
    assert rows[3]["leviathan"] == pytest.approx(1.6808)
    # Jensen: charging each round its own cost per token is never faster than the renewal (Leviathan) rate
    assert all(r["latency_model"] <= r["leviathan"] + 1e-12 for r in rows)


def test_sprinter_predictions_bundle():
    out = theory.sprinter_predictions(tpr=0.9, fpr=0.5, mean_tvd=0.3, accept_rate=0.5, runs=[2, 2])
    assert out["tvd_sprinter_pred"] == pytest.approx(0.15)
    assert out["run_length_pred_empirical_n"] == pytest.approx(2.52)
    assert out["run_length_ideal_geometric"] == pytest.approx(1.0)
