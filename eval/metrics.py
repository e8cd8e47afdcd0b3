"""The one definition of the stop-classifier metrics, shared by `python -m train` (test step and results.json) and
`python -m eval`, so the two report the same number for the same head on the same rows.

The positive class is "accepted / continue drafting" (label 1). Soft labels (tvd, accept_prob) are binarised at 0.5
for every metric here; scores are acceptance probabilities (or any monotone score), higher = more likely accepted.
A score at or above the threshold predicts "continue" (scikit-learn's convention in `precision_recall_curve`).
"""

from __future__ import annotations

import math

import numpy as np
from sklearn.metrics import (
    average_precision_score,
    confusion_matrix,
    f1_score,
    precision_recall_curve,
    roc_auc_score,
    roc_curve,
)


def _as_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().float().numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)


def binarize(labels) -> np.ndarray:
    """Hard 0/1 labels: soft labels in [0, 1] are cut at 0.5 (1 ↔ label ≥ 0.5)."""
    return (_as_numpy(labels) >= 0.5).astype(np.int64)


def _f1(tp: int, fp: int, fn: int) -> float:
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def classification_metrics(scores, labels, threshold: float) -> dict:
    """AUROC, average precision, and F1/precision/recall/confusion counts at `threshold` (score ≥ threshold → 1).

    AUROC and AP are NaN when the labels hold a single class (they are undefined there).
    """
    s = _as_numpy(scores)
    y = binarize(labels)
    if len(s) != len(y):
        raise ValueError(f"scores ({len(s)}) and labels ({len(y)}) differ in length")
    pred = (s >= threshold).astype(np.int64)
    tn, fp, fn, tp = (int(v) for v in confusion_matrix(y, pred, labels=[0, 1]).ravel())
    two_classes = 0 < y.sum() < len(y)
    return {
        "auroc": float(roc_auc_score(y, s)) if two_classes else math.nan,
        "ap": float(average_precision_score(y, s)) if two_classes else math.nan,
        "f1": _f1(tp, fp, fn),
        "precision": tp / (tp + fp) if tp + fp else 0.0,
        "recall": tp / (tp + fn) if tp + fn else 0.0,
        "tp": tp,
        "fp": fp,
        "tn": tn,
        "fn": fn,
    }


def best_f1_threshold(scores, labels) -> tuple[float, float]:
    """(threshold, F1) maximising F1 over every distinct score used as a threshold (choose it on validation)."""
    s = _as_numpy(scores)
    y = binarize(labels)
    if y.sum() == 0:
        return float(s.max()) + 1e-6 if len(s) else 0.5, 0.0
    precision, recall, thresholds = precision_recall_curve(y, s)
    # the last (precision=1, recall=0) point has no threshold
    p, r = precision[:-1], recall[:-1]
    f1 = np.where(p + r > 0, 2 * p * r / np.maximum(p + r, 1e-12), 0.0)
    i = int(np.argmax(f1))
    return float(thresholds[i]), float(f1[i])


def static_length_f1(labels, positions_in_round, max_k: int | None = None) -> dict:
    """F1 of the best static speculation length used as a classifier (DISCO App. D's "F1 static-SL").

    Rounds are reconstructed from the trace by cutting after each rejection (`models.features.trace_round_positions`), so
    `positions_in_round[i]` is 0 for the first drafted token of a round. A static length K predicts "continue" (1)
    for the first K positions of a round (position < K) and "stop" (0) after. We report the K in 0..max_k
    (default: the largest position seen + 1, i.e. up to "never stop") with the best F1 against the labels, which
    makes the baseline an upper bound for any static K chosen elsewhere.

    Returns dict(f1_static_best, k_best, f1_by_k).
    """
    y = binarize(labels)
    pos = _as_numpy(positions_in_round).astype(np.int64)
    if len(y) != len(pos):
        raise ValueError(f"labels ({len(y)}) and positions ({len(pos)}) differ in length")
    if max_k is None:
        max_k = int(pos.max()) + 1 if len(pos) else 1
    f1_by_k = {}
    for k in range(0, max_k + 1):
        f1_by_k[k] = float(f1_score(y, (pos < k).astype(np.int64), labels=[0, 1], zero_division=0.0))
    k_best = max(f1_by_k, key=lambda k: (f1_by_k[k], -k))
    return {"f1_static_best": f1_by_k[k_best], "k_best": k_best, "f1_by_k": f1_by_k}


def roc_pr_points(scores, labels, max_points: int = 300) -> dict:
    """ROC (fpr, tpr) and PR (recall, precision) curves as lists, thinned to ≤ max_points for plots and W&B tables
    and rounded to 5 significant digits (a plot needs no more; reports under results/ stay small)."""
    s = _as_numpy(scores)
    y = binarize(labels)
    out = {}
    if 0 < y.sum() < len(y):
        fpr, tpr, _ = roc_curve(y, s)
        precision, recall, _ = precision_recall_curve(y, s)
        for name, (a, b) in {"roc": (fpr, tpr), "pr": (recall, precision)}.items():
            idx = np.unique(np.linspace(0, len(a) - 1, min(max_points, len(a))).round().astype(int))
            out[name] = tuple([float(f"{v:.5g}") for v in c[idx]] for c in (a, b))
    return out


def expected_calibration_error(scores, labels, n_bins: int = 15) -> float:
    """ECE (L1, `n_bins` equal-width bins, torchmetrics BinaryCalibrationError) of scores clipped to [0, 1] against
    labels binarised at 0.5."""
    import torch
    from torchmetrics.classification import BinaryCalibrationError

    s = np.clip(_as_numpy(scores), 0.0, 1.0)
    ece = BinaryCalibrationError(n_bins=n_bins, norm="l1")
    return float(ece(torch.as_tensor(s, dtype=torch.float32), torch.as_tensor(binarize(labels))))


# The training-free scores a head is compared with, on the same rows: name → (label, the trace columns it reads, its
# score from them). Which apply is the head's feature kind's business (models.features.FeatureKind.baselines): chain
# kinds max q (max-confidence's) and −H_q (SVIP's and AdaEDL's: both stop on a monotone function of the entropy);
# token-tree node kinds the node's joint probability (what EAGLE-2 ranks nodes by) and its own q_token.
BASELINES = {
    "max_q": ("max q", ("draft_topk",), lambda c: np.asarray(c["draft_topk"], dtype=np.float64)[:, 0]),
    "neg_entropy": ("−H_q", ("draft_entropy",), lambda c: -np.asarray(c["draft_entropy"], dtype=np.float64)),
    "joint": ("joint probability", ("joint",), lambda c: np.asarray(c["joint"], dtype=np.float64)),
    "q_token": ("q(token)", ("q_token",), lambda c: np.asarray(c["q_token"], dtype=np.float64)),
}
BASELINE_LABELS = {name: label for name, (label, _, _) in BASELINES.items()}
CHAIN_BASELINES = ("max_q", "neg_entropy")


def baseline_columns(names=CHAIN_BASELINES) -> tuple[str, ...]:
    """The trace columns the named baselines read."""
    return tuple(dict.fromkeys(c for n in names for c in BASELINES[n][1]))


def baseline_scores(cols: dict, names=CHAIN_BASELINES) -> dict:
    """The named training-free scores per row (`BASELINES`), those whose trace columns `cols` holds (a dict of
    arrays: trace columns, or train's test rows' copies of them)."""
    return {n: BASELINES[n][2](cols) for n in names if all(c in cols for c in BASELINES[n][1])}


def baseline_auroc(cols: dict, labels, names=CHAIN_BASELINES) -> dict:
    """AUROC of the training-free scores on the same rows and labels: what a head must beat."""
    return {k: classification_metrics(s, labels, 0.5)["auroc"] for k, s in baseline_scores(cols, names).items()}
