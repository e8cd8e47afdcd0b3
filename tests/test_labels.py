"""Label schemes (data_gen/labels.py) on hand-computed rows."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from data_gen.labels import (LabelScheme, is_conditional, is_node, is_soft, make_labels, make_mask, required_columns)
from data_gen.labels import scheme as build_scheme
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


# ------------------------------------------------------------------------- a new scheme: one class + one yaml


class DraftOverTarget(LabelScheme):
    """A scheme only this test knows: 1[q(x) ≥ factor · p(x)] (the draft at least `factor` times as sure as the
    target)."""

    columns = ("q_draft", "p_draft")

    def labels(self, col):
        q, p = col["q_draft"].astype(np.float64), col["p_draft"].astype(np.float64)
        return (q >= float(self.params.get("factor", 1.0)) * p).astype(np.float32)


@pytest.fixture
def user_conf(tmp_path):
    """A user's conf dir holding labels/draft_over_target.yaml (this module's class)."""
    root = tmp_path / "user_conf"
    (root / "labels").mkdir(parents=True)
    (root / "labels" / "draft_over_target.yaml").write_text(
        f"# a test scheme\n_target_: {__name__}.DraftOverTarget\nname: draft_over_target\nfactor: 1.0\n")
    return root


def test_a_scheme_is_read_from_its_class(user_conf):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", ["labels=draft_over_target", "labels.factor=2.0", f"hydra.searchpath=[file://{user_conf}]"])
    s = build_scheme(cfg.labels)
    assert isinstance(s, DraftOverTarget) and not is_soft(cfg.labels) and not is_node(cfg.labels)
    assert required_columns(cfg.labels) == ("q_draft", "p_draft") and make_mask(COLS, cfg.labels) is None
    # q/p = 0.5, 1.2, 3.0: at least 2 on the last row only
    np.testing.assert_array_equal(make_labels(COLS, cfg.labels), [0, 0, 1])
    assert is_node(scheme("on_path")) and is_conditional(scheme("on_path_given_parent"))
    assert is_conditional({"name": "on_path_given_parent"})  # a checkpoint's dict from before `_target_`: by name
    with pytest.raises(UserError, match="is not a data_gen.labels.LabelScheme"):
        make_labels(COLS, OmegaConf.create({"_target_": "collections.OrderedDict", "name": "x"}))


@pytest.mark.slow
def test_a_new_scheme_trains_a_head_through_the_train_command(user_conf, tmp_path, cli):
    """`python -m train +experiment=smoke labels=draft_over_target hydra.searchpath=[file://DIR]` as a user types it
    (the tiny pair): the head trains on the scheme's labels and its checkpoint records the class."""
    import json

    from data_gen import store
    from models.heads import load_head

    run_dir = tmp_path / "run"
    done = cli("train", "+experiment=smoke", "labels=draft_over_target", "labels.factor=1.0", "logger=none",
               "trainer.max_epochs=1", f"trace_root={tmp_path / 'traces'}", f"hydra.searchpath=[file://{user_conf}]",
               f"hydra.run.dir={run_dir}")
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["labels"]["name"] == "draft_over_target"
    test, _ = store.load_traces(next((tmp_path / "traces").rglob("*test*")))
    y = DraftOverTarget().labels({c: np.asarray(test[c]) for c in ("q_draft", "p_draft")})
    assert results["test/rows"] == len(y) and results["test/positive_rate"] == pytest.approx(float(y.mean()))
    assert 0 < y.mean() < 1 and np.isfinite(results["test/auroc"])
    bundle = load_head(results["ckpt_path"])
    assert bundle.labels["_target_"] == f"{__name__}.DraftOverTarget" and not is_conditional(bundle.labels)
