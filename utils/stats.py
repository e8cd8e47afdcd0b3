"""Bootstrap intervals over prompts: the one resampling routine of the project (eval.bar's bar, decode's speedup
plots, eval.study). Below the stages, so decode and eval both import it."""

from __future__ import annotations

import numpy as np


def bootstrap_ci(n: int, stat, n_resamples: int = 4000, confidence: float = 0.95,
                 method: str = "BCa") -> list[list[float]]:
    """[low, high] of each entry of the vector statistic stat(idx) over prompt indices resampled with replacement
    (seeded, so the same files give the same intervals). `stat(idx, axis=-1)` takes an index array of shape
    (..., n) and returns one row per statistic; one draw of prompts serves every entry, so statistics of methods
    decoded on the same prompts are paired. `method`: "BCa" (eval.bar) or "percentile" (plots)."""
    from scipy.stats import bootstrap

    res = bootstrap((np.arange(n),), stat, vectorized=True, n_resamples=n_resamples, confidence_level=confidence,
                    method=method, random_state=0)
    return [[float(lo), float(hi)] for lo, hi in zip(np.atleast_1d(res.confidence_interval.low),
                                                     np.atleast_1d(res.confidence_interval.high))]
