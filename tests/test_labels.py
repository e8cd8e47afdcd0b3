"""Label schemes (data_gen/labels.py) on hand-computed rows."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from data_gen.labels import is_soft, make_labels, required_columns
from tests.conftest import REPO
from utils.cli import UserError

COLS = {
    "draft_token": np.array([1, 2, 3], dtype=np.int32),
    "target_token": np.array([1, 5, 3], dtype=np.int32),
    "tvd": np.array([0.1, 0.5, 0.75], dtype=np.float32),
    "q_draft": np.array([0.2, 0.6, 0.3], dtype=np.float32),
    "p_draft": np.array([0.4, 0.5, 0.1], dtype=np.float32),
}


def scheme(name, **over):
    cfg = OmegaConf.load(REPO / "conf" / "labels" / f"{name}.yaml")
    return OmegaConf.merge(cfg, over)


def test_greedy_match():
    np.testing.assert_array_equal(make_labels(COLS, scheme("greedy_match")), [1, 0, 1])


def test_tvd_soft_and_hard():
    np.testing.assert_allclose(make_labels(COLS, scheme("tvd")), [0.9, 0.5, 0.25], atol=1e-6)
    np.testing.assert_array_equal(make_labels(COLS, scheme("tvd", hard_threshold=0.5)), [1, 1, 0])
    assert is_soft(scheme("tvd")) and not is_soft(scheme("tvd", hard_threshold=0.5))


@pytest.mark.parametrize("tau, expected", [(1.0, [1, 0, 0]), (1.5, [1, 1, 0]), (4.0, [1, 1, 1])])
def test_ratio_tau(tau, expected):
    # q/p = 0.5, 1.2, 3.0: accepted when q/p <= tau
    np.testing.assert_array_equal(make_labels(COLS, scheme("ratio", tau=tau)), expected)
    assert not is_soft(scheme("ratio", tau=tau))


def test_accept_prob():
    out = make_labels(COLS, scheme("accept_prob"))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [1.0, 0.5 / 0.6, 0.1 / 0.3], atol=1e-6)
    assert is_soft(scheme("accept_prob"))


def test_labels_from_a_dataset_and_errors():
    from datasets import Dataset

    ds = Dataset.from_dict({k: v.tolist() for k, v in COLS.items()})
    np.testing.assert_array_equal(make_labels(ds, scheme("greedy_match")), [1, 0, 1])
    assert required_columns(scheme("ratio")) == ("q_draft", "p_draft")
    with pytest.raises(UserError, match="needs trace column"):
        make_labels({"draft_token": COLS["draft_token"]}, scheme("greedy_match"))
    with pytest.raises(UserError, match="unknown label scheme"):
        make_labels(COLS, OmegaConf.create({"name": "nope"}))


def test_sum_min_is_one_minus_tvd():
    np.testing.assert_allclose(make_labels(COLS, scheme("sum_min")), [0.9, 0.5, 0.25], rtol=1e-6)
    assert is_soft(scheme("sum_min"))


def test_reach_weights():
    """Reach R = Π of the earlier rows' acceptances in the round; weight R + (1 − R)·w."""
    from data_gen.labels import make_weights

    cols = {**COLS, "position": np.arange(3, dtype=np.int32), "prompt_id": np.array(["a"] * 3),
            "kind": np.array(["target_ar"] * 3)}
    np.testing.assert_array_equal(make_weights(cols, scheme("greedy_match")), [1, 1, 1])  # default: off
    # hard reach: rounds end at a rejection (row 1), so every row is reachable
    np.testing.assert_array_equal(make_weights(cols, scheme("greedy_match", reach_weight=0.0)), [1, 1, 1])
    # soft reach min(1, p/q) = [1, 5/6, 1/3]; rows 0-1 form one round (row 1 rejected greedily), row 2 a new one
    w = make_weights(cols, scheme("accept_prob", reach_weight=0.2, reach="soft"))
    np.testing.assert_allclose(w, [1.0, 1.0, 1.0], rtol=1e-6)
    cols["target_token"] = cols["draft_token"].copy()  # all accepted greedily: one round of three rows
    w = make_weights(cols, scheme("accept_prob", reach_weight=0.2, reach="soft"))
    r = np.array([1.0, 1.0, 5 / 6])
    np.testing.assert_allclose(w, r + (1 - r) * 0.2, rtol=1e-6)
    with pytest.raises(UserError, match="reach_weight"):
        make_weights(cols, scheme("greedy_match", reach_weight=2.0))
