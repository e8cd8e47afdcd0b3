"""eval.metrics: the one classifier-metric definition (train's test step and python -m eval use it)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.metrics import f1_score

from eval.metrics import best_f1_threshold, classification_metrics, roc_pr_points, static_length_f1


def test_classification_metrics_counts_and_scores():
    scores = np.array([0.9, 0.8, 0.3, 0.2, 0.6, 0.1])
    labels = np.array([1, 1, 0, 0, 0, 1])
    m = classification_metrics(scores, labels, 0.5)
    assert (m["tp"], m["fp"], m["tn"], m["fn"]) == (2, 1, 2, 1)
    assert m["f1"] == pytest.approx(f1_score(labels, scores >= 0.5))
    assert m["precision"] == pytest.approx(2 / 3) and m["recall"] == pytest.approx(2 / 3)
    assert 0.5 < m["auroc"] < 1.0 and 0.5 < m["ap"] <= 1.0


def test_soft_labels_binarised_at_half():
    scores = np.array([0.9, 0.1, 0.7, 0.2])
    soft = np.array([0.8, 0.2, 0.5, 0.49])
    m = classification_metrics(scores, soft, 0.5)
    assert m["auroc"] == pytest.approx(1.0)
    assert (m["tp"], m["tn"]) == (2, 2)


def test_single_class_gives_nan_auroc():
    m = classification_metrics([0.2, 0.9], [1, 1], 0.5)
    assert math.isnan(m["auroc"]) and m["f1"] == pytest.approx(2 / 3)


def test_best_f1_threshold_is_the_argmax():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 500)
    scores = labels * 0.3 + rng.random(500)
    thr, f1 = best_f1_threshold(scores, labels)
    assert f1 == pytest.approx(classification_metrics(scores, labels, thr)["f1"])
    for t in np.linspace(0, 1.3, 27):
        assert classification_metrics(scores, labels, t)["f1"] <= f1 + 1e-9


def test_static_length_f1_picks_best_k():
    # rounds: accepted runs of length 3 then a reject, repeated: positions 0,1,2,3 with labels 1,1,1,0
    labels = np.array([1, 1, 1, 0] * 10)
    pos = np.array([0, 1, 2, 3] * 10)
    out = static_length_f1(labels, pos)
    assert out["k_best"] == 3 and out["f1_static_best"] == pytest.approx(1.0)
    assert out["f1_by_k"][0] == 0.0
    # never stopping (K > max position) predicts all positives
    assert out["f1_by_k"][4] == pytest.approx(f1_score(labels, np.ones_like(labels)))


def test_roc_points_thinned():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, 5000)
    pts = roc_pr_points(rng.random(5000), labels, max_points=100)
    assert len(pts["roc"][0]) <= 100 and pts["roc"][0][0] == 0.0 and pts["roc"][1][-1] == 1.0
