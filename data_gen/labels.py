"""Label schemes: functions of stored trace columns, applied at load time (train and eval share them).

Traces keep raw statistics (q(x), p(x), TVD, tokens), so a τ sweep or a new scheme never regenerates traces.

| scheme | label | source |
|---|---|---|
| greedy_match | 1[x = argmax p] | DISCO App. D |
| tvd | soft 1 − TVD(p, q); with `hard_threshold` set, 1[1 − TVD ≥ threshold] | DISCO ("cross-entropy with the TVD") |
| ratio | 1[q(x)/p(x) ≤ τ] (τ = 1 ⇔ p ≥ q; larger τ accepts more) | SPRINTER |
| accept_prob | soft min(1, p(x)/q(x)) | SpecDec++ |
"""

from __future__ import annotations

import numpy as np
from omegaconf import DictConfig

from utils.cli import UserError

SCHEMES = {
    "greedy_match": ("draft_token", "target_token"),
    "tvd": ("tvd",),
    "ratio": ("q_draft", "p_draft"),
    "accept_prob": ("q_draft", "p_draft"),
}
SOFT = {"tvd", "accept_prob"}


def required_columns(cfg: DictConfig) -> tuple[str, ...]:
    if cfg.name not in SCHEMES:
        raise UserError(f"unknown label scheme '{cfg.name}'; known: {', '.join(SCHEMES)}")
    return SCHEMES[cfg.name]


def is_soft(cfg: DictConfig) -> bool:
    """Soft labels are probabilities in [0, 1]; metrics binarise them at 0.5."""
    return cfg.name in SOFT and cfg.get("hard_threshold") is None


def make_labels(columns: dict, cfg: DictConfig) -> np.ndarray:
    """Labels (float32 in [0, 1]) for trace columns (a dict or a `datasets.Dataset`) under scheme `cfg`."""
    needed = required_columns(cfg)
    names = columns.column_names if hasattr(columns, "column_names") else list(columns)
    missing = [c for c in needed if c not in names]
    if missing:
        raise UserError(
            f"label scheme '{cfg.name}' needs trace column(s) {missing} that these traces lack; "
            "regenerate them with this code's data_gen or pick another labels="
        )
    col = {c: np.asarray(columns[c]) for c in needed}
    if cfg.name == "greedy_match":
        return (col["draft_token"] == col["target_token"]).astype(np.float32)
    if cfg.name == "tvd":
        soft = 1.0 - col["tvd"].astype(np.float64)
        threshold = cfg.get("hard_threshold")
        return (soft >= float(threshold)).astype(np.float32) if threshold is not None else soft.astype(np.float32)
    q = col["q_draft"].astype(np.float64)
    p = col["p_draft"].astype(np.float64)
    if cfg.name == "ratio":
        return (q <= float(cfg.get("tau", 1.0)) * p).astype(np.float32)
    return np.minimum(1.0, p / np.maximum(q, 1e-30)).astype(np.float32)
