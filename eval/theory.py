"""What the papers' theory predicts, as functions of quantities we measure (α, c, FPR/TPR, TVD).

The paper extractions lost their formulas; each function states the model and derives the result in its docstring.
Units: costs are relative to one target forward pass (c = draft step time ÷ target step time).

1. SPRINTER (approximate verification), Theorem 1: emitted distribution and its TVD from the target.
2. SPRINTER Theorem 2: expected number of consecutive verifier-accepted tokens from TPR/FPR.
3. Leviathan et al.: improvement factor E[tokens per round] = (1 − α^{γ+1})/(1 − α), speedup = that ÷ (γc + 1).
4. "How speculative can speculative decoding be?" eq. 9–13: the expected per-token latency of a round.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

# ------------------------------------------------------------------------------------------------ SPRINTER, Thm 1


def sprinter_emitted_distribution(p, q, verifier_accept) -> np.ndarray:
    """Exact distribution of the token SPRINTER emits in one step, for any per-token verifier acceptance probability.

    The mechanism (SPRINTER Alg. 1 = our `decode` SPRINTER verifier): draw x ~ q; the verifier accepts x with
    probability v(x) and x is emitted without the target; otherwise the target is called and does one step of exact
    speculative sampling on x: keep x with probability min(1, p(x)/q(x)), else resample from the residual
    r = (p − q)₊ / Σ(p − q)₊.

    Write A = {x : q(x) ≤ p(x)} ("acceptable", ratio label with τ = 1) and R = {x : q(x) > p(x)}, and
    T = Σ_R (q − p) = Σ_A (p − q) = TVD(p, q).
    - x ∈ R: emitted directly with q(x)·v(x), or kept by the target with q(x)(1 − v(x))·p(x)/q(x); r(x) = 0, so
      P(x) = v(x)q(x) + (1 − v(x))p(x) = p(x) + v(x)(q(x) − p(x)).
    - x ∈ A: the draw itself is always emitted (verifier accept, or target keeps it since p/q ≥ 1): q(x). Plus the
      resampled mass: a residual draw happens when some y ∈ R is drawn, the verifier rejects, the target rejects:
      Σ_R q(y)(1 − v(y))(1 − p(y)/q(y)) = Σ_R (1 − v(y))(q(y) − p(y)) = (1 − ε̄)·T, with
      ε̄ := Σ_R v(y)(q(y) − p(y)) / T (the excess-mass-weighted false-positive rate). So
      P(x) = q(x) + (1 − ε̄)T·(p(x) − q(x))/T = p(x) − ε̄(p(x) − q(x)).
    The verifier's behaviour on A (its TPR) does not matter: a wrongly rejected acceptable token is kept by the target.
    """
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    v = np.broadcast_to(np.asarray(verifier_accept, dtype=np.float64), p.shape)
    over = q > p
    residual = np.clip(p - q, 0.0, None)
    tvd = residual.sum()
    direct = q * v + q * (1 - v) * np.minimum(1.0, np.divide(p, q, out=np.ones_like(p), where=q > 0))
    resample_mass = np.sum(np.where(over, q * (1 - v) * (1 - np.divide(p, q, out=np.zeros_like(p), where=q > 0)), 0.0))
    return direct + (resample_mass * residual / tvd if tvd > 0 else 0.0)


def sprinter_mixture(p, q, eps: float) -> np.ndarray:
    """SPRINTER Theorem 1: the emitted distribution is (1 − ε)·p + ε·q.

    Exactly true when the verifier accepts every over-proposed token x ∈ R = {q(x) > p(x)} with the same probability
    ε (its false-positive rate; a token with q > p is "unacceptable", accepting it is a false positive), whatever it
    does on A — put v ≡ ε on R in `sprinter_emitted_distribution`: on R p + ε(q − p), on A p − ε(p − q), one formula.
    When v varies over R, the same form holds on A with ε̄ (excess-weighted FPR) but not token by token on R; the TVD
    below still holds with ε̄. Also assumed: x ~ q (sampling at the draft's temperature), one context at a time.
    """
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    return (1 - eps) * p + eps * q


def tvd(p, q) -> float:
    """Total variation distance ½ Σ |p − q|."""
    return 0.5 * float(np.abs(np.asarray(p, dtype=np.float64) - np.asarray(q, dtype=np.float64)).sum())


def sprinter_tvd(eps: float, tvd_pq: float) -> float:
    """TVD(SPRINTER, p) = ε · TVD(p, q).

    From `sprinter_emitted_distribution`: P − p = v(x)(q − p) ≥ 0 on R and −ε̄(p − q) ≤ 0 on A, so
    ½ Σ|P − p| = ½[Σ_R v(q − p) + ε̄ Σ_A (p − q)] = ½[ε̄T + ε̄T] = ε̄ · T. With a constant ε on R, ε̄ = ε.
    Averaged over contexts this is E[ε̄·TVD]; predicting it as FPR × mean TVD assumes the verifier's errors do not
    correlate with how far apart p and q are (`sprinter_tvd_from_rows` avoids that assumption).
    """
    return float(eps) * float(tvd_pq)


def sprinter_tvd_from_rows(q_draft, p_draft, accepted) -> dict:
    """Predicted TVD(SPRINTER, p) per step from trace rows where the draft token x was SAMPLED from q (interleaved).

    For x ~ q, E[1[x ∈ R]·v(x)·(1 − p(x)/q(x))] = Σ_R v(x)(q(x) − p(x)) = ε̄·T (the exact TVD above), and
    E[1[x ∈ R](1 − p/q)] = T. So the row means give the exact per-step TVD averaged over contexts, and their ratio
    the excess-weighted FPR ε̄. `accepted` = the verifier's hard decision (score ≥ threshold).
    """
    q = np.asarray(q_draft, dtype=np.float64)
    p = np.asarray(p_draft, dtype=np.float64)
    acc = np.asarray(accepted, dtype=np.float64)
    excess = np.where(q > p, 1.0 - p / np.maximum(q, 1e-30), 0.0)
    tvd_hat = float(excess.mean()) if len(q) else math.nan
    emitted = float((excess * acc).mean()) if len(q) else math.nan
    return {
        "tvd_pq_from_samples": tvd_hat,
        "eps_weighted": emitted / tvd_hat if tvd_hat > 0 else math.nan,
        "tvd_sprinter_from_samples": emitted,
    }


# ------------------------------------------------------------------------------------------------ SPRINTER, Thm 2


def sprinter_run_length(tpr: float, fpr: float, n: int | float) -> float:
    """SPRINTER Theorem 2: E[N], N = number of consecutive tokens the verifier accepts before its first reject.

    Model (paper Fig. 4): the first n draft tokens are acceptable, every later one unacceptable; the verifier accepts
    an acceptable token with probability β = TPR and an unacceptable one with ε = FPR, independently. Then
    P(N ≥ k) = β^k for k ≤ n and β^n ε^{k−n} for k ≥ n, so
    P(N = k) = β^k(1 − β) (k < n), β^n ε^{k−n}(1 − ε) (k ≥ n), and
    E[N] = Σ_{k≥1} P(N ≥ k) = β(1 − β^n)/(1 − β) + β^n · ε/(1 − ε)
    (first term → n as β → 1: a perfect verifier accepts exactly the n acceptable tokens). n = ∞ gives β/(1 − β).
    """
    b, e = float(tpr), float(fpr)
    if math.isinf(n):
        return b / (1 - b) if b < 1 else math.inf
    first = n if b == 1 else b * (1 - b**n) / (1 - b)
    tail = b**n * (e / (1 - e) if e < 1 else math.inf)
    return first + tail


def sprinter_run_length_geometric(tpr: float, fpr: float, a: float) -> float:
    """Theorem 2 averaged over a geometric ground truth: P(n = m) = a^m (1 − a), a = P(token acceptable).

    E[N] = Σ_m a^m(1 − a)[β(1 − β^m)/(1 − β) + β^m ε/(1 − ε)]
         = β/(1 − β)·(1 − (1 − a)/(1 − aβ)) + ε/(1 − ε)·(1 − a)/(1 − aβ)
         = aβ/(1 − aβ) + (1 − a)ε / ((1 − ε)(1 − aβ)).
    Checks: a = 1 → β/(1 − β); a = 0 → ε/(1 − ε); β = 1, ε = 0 → a/(1 − a), the mean acceptable run.
    """
    a, b, e = float(a), float(tpr), float(fpr)
    if a * b >= 1 or e >= 1:
        return math.inf
    return a * b / (1 - a * b) + (1 - a) * e / ((1 - e) * (1 - a * b))


def sprinter_predictions(tpr: float, fpr: float, mean_tvd: float, accept_rate: float, runs=None) -> dict:
    """Everything item 3 prints for a SPRINTER head: predicted TVD and run lengths from its measured TPR/FPR.

    `accept_rate` = fraction of acceptable tokens (q ≤ p) for the geometric model; `runs` (optional) = the measured
    lengths n of acceptable runs, averaged through Theorem 2 instead of assuming a geometric n.
    """
    out = {
        "tpr": float(tpr),
        "fpr": float(fpr),
        "tvd_pq_mean": float(mean_tvd),
        "tvd_sprinter_pred": sprinter_tvd(fpr, mean_tvd),
        "acceptable_rate": float(accept_rate),
        "run_length_pred_geometric": sprinter_run_length_geometric(tpr, fpr, accept_rate),
        "run_length_ideal_geometric": sprinter_run_length_geometric(1.0, 0.0, accept_rate),
    }
    if runs is not None and len(runs):
        runs = np.asarray(runs)
        out["run_length_pred_empirical_n"] = float(np.mean([sprinter_run_length(tpr, fpr, int(n)) for n in runs]))
        out["acceptable_run_mean"] = float(runs.mean())
    return out


# ------------------------------------------------------------------------------------------------ Leviathan et al.


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """Leviathan et al. Thm 3.8: with i.i.d. acceptance α and γ drafted tokens, a round yields the accepted prefix plus
    one target token: E = Σ_{i=0}^{γ} α^i = (1 − α^{γ+1})/(1 − α) (= γ + 1 when α = 1)."""
    if alpha >= 1:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def improvement_factor(alpha: float, gamma: int, cost_ratio: float) -> float:
    """Leviathan et al.'s walltime improvement: a round costs γ draft steps + one target pass = γc + 1 target steps,
    target-only decoding costs 1 per token, so speedup = E[tokens per round] ÷ (γc + 1)."""
    return expected_tokens_per_round(alpha, gamma) / (gamma * cost_ratio + 1)


def best_gamma(alpha: float, cost_ratio: float, max_gamma: int = 64) -> tuple[int, float]:
    """The integer γ ≥ 1 maximising `improvement_factor` (and that factor)."""
    gammas = range(1, max_gamma + 1)
    factors = [improvement_factor(alpha, g, cost_ratio) for g in gammas]
    i = int(np.argmax(factors))
    return gammas[i], float(factors[i])


# ------------------------------------------------------------------------------------ "How speculative", eq. 9–13


def latency_per_token(p: float, a: float, b: float, k: int) -> float:
    """Expected per-token latency E_pt of one speculative round, "How speculative can SD be?" eq. 12–13.

    A round costs a + b (a = draft latency for its k tokens, b = target verify latency) and yields N + 1 tokens, N the
    accepted count (i.i.d. acceptance p, truncated at k). The paper charges each round its cost spread over its own
    tokens: eq. 13, L(i) = p[(1 − p)(a + b)/(i + 1) + L(i + 1)] for i < k, L(k) = p(a + b)/(k + 1), and eq. 12,
    E_pt = (1 − p)(a + b) + L(1). Unrolled:
        E_pt = (a + b) · [Σ_{i=0}^{k−1} p^i (1 − p)/(i + 1) + p^k/(k + 1)] = (a + b) · E[1/(N + 1)].
    k = 1 gives eq. 9: (1 − p/2)(a + b). Note E[1/(N+1)] ≥ 1/E[N+1] (Jensen): the long-run per-token latency
    (renewal reward, Leviathan) is (a + b)/E[N + 1]; `speedup_curve` reports both.
    """
    if k < 1:
        raise ValueError("k (draft length) must be ≥ 1")
    weights = sum(p**i * (1 - p) / (i + 1) for i in range(k)) + p**k / (k + 1)
    return (a + b) * weights


def latency_per_token_recursive(p: float, a: float, b: float, k: int) -> float:
    """Eq. 12–13 exactly as written (recursion), to check the unrolled `latency_per_token`."""

    def L(i: int) -> float:
        if i == k:
            return p * (a + b) / (i + 1)
        return p * ((1 - p) * (a + b) / (i + 1) + L(i + 1))

    return (1 - p) * (a + b) + L(1)


def speedup_curve(alpha: float, cost_ratio: float, gammas: Iterable[int] = range(1, 11)) -> list[dict]:
    """Predicted speedup over target-only decoding per constant draft length γ, from measured α and cost_ratio.

    Units: one target step = 1, so target-only costs 1 per token; a round has a = γc, b = 1 (a verify pass of γ + 1
    tokens is taken to cost one step — on memory-bound hardware it nearly does; on our CPU it does not, which is what
    decode's measured cost_ratio and speedup reveal). `leviathan` = E[N + 1]/(γc + 1) with c = cost_ratio;
    `latency_model` = 1/E_pt (eq. 12–13).
    """
    rows = []
    for g in gammas:
        ept = latency_per_token(alpha, g * cost_ratio, 1.0, g)
        rows.append(
            {
                "gamma": int(g),
                "tokens_per_round": expected_tokens_per_round(alpha, g),
                "leviathan": improvement_factor(alpha, g, cost_ratio),
                "latency_per_token": ept,
                "latency_model": 1.0 / ept,
            }
        )
    return rows
