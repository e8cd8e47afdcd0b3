"""data_gen.labels' conditional node scheme and models.features.nodes.compose_path (issue 30): labels=on_path_given_parent's row mask (parents looked up within their own
(prompt_id, position) tree), the product composition along root paths, the two node views of a head, learned_tree's
branch on a conditional head (and c2t's refusal), and the scheme refused on chain traces in one line."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf

from utils.cli import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

COND = OmegaConf.create({"name": "on_path_given_parent"})


def two_trees(shuffle: bool = False) -> dict:
    """Two trees of one prompt (positions 0 and 1) with the same node ids and different on-path nodes, so a parent
    looked up by node id alone would read the other tree's label; rows optionally shuffled (the lookup's slow path).

    tree at 0: 0 on, 1 off (roots); 2 on under 0; 3 off under 1; 4 off under 2
    tree at 1: 0 off, 1 on (roots); 2 off under 0; 3 on under 1; 4 off under 2
    """
    cols = {
        "prompt_id": np.array(["p"] * 10),
        "position": np.array([0] * 5 + [1] * 5),
        "node": np.array([0, 1, 2, 3, 4] * 2),
        "parent": np.array([-1, -1, 0, 1, 2] * 2),
        "depth": np.array([1, 1, 2, 2, 3] * 2),
        "on_path": np.array([1, 0, 1, 0, 0, 0, 1, 0, 1, 0], dtype=bool),
        "q_token": np.array([0.6, 0.3, 0.5, 0.2, 0.4, 0.4, 0.5, 0.3, 0.9, 0.1], dtype=np.float32),
    }
    cols["joint"] = cols["q_token"].copy()
    for i in range(10):  # joint = Π q along the path (parents precede children within a tree here)
        if cols["parent"][i] >= 0:
            cols["joint"][i] *= cols["joint"][i - cols["node"][i] + cols["parent"][i]]
    cols["draft_entropy"] = np.linspace(0.5, 2.0, 10).astype(np.float32)
    if shuffle:
        order = np.random.default_rng(0).permutation(10)
        cols = {k: v[order] for k, v in cols.items()}
    return cols


# the conditional rows of two_trees(): tree 0 drops node 3 (parent 1 off); tree 1 drops nodes 2 and 4
MASK = [True, True, True, False, True, True, True, False, True, False]


@pytest.mark.parametrize("shuffle", [False, True])
def test_mask_looks_parents_up_in_their_own_tree(shuffle):
    from data_gen.labels import is_conditional, make_labels, make_mask, required_columns

    cols = two_trees(shuffle)
    want = np.array(MASK)
    if shuffle:
        order = np.random.default_rng(0).permutation(10)
        want = want[order]
    assert set(required_columns(COND)) >= {"on_path", "node", "parent", "prompt_id", "position"}
    assert make_mask(cols, COND).tolist() == want.tolist()
    assert make_labels(cols, COND).tolist() == cols["on_path"].astype(np.float32).tolist()
    assert make_mask(cols, OmegaConf.create({"name": "on_path"})) is None  # on_path labels every node
    assert is_conditional(COND) and is_conditional({"name": "on_path_given_parent"})
    assert not is_conditional({"name": "on_path"}) and not is_conditional(None)


def test_compose_path_product_and_min_in_any_row_order():
    from models.features.nodes import compose_path, parent_rows

    cols = two_trees()
    p = np.array([0.5, 0.4, 0.8, 0.5, 0.5, 0.9, 0.1, 0.2, 0.6, 1.0])
    par = parent_rows(cols)
    assert par.tolist() == [-1, -1, 0, 1, 2, -1, -1, 5, 6, 7]
    prod = compose_path(p, par, "product")
    np.testing.assert_allclose(prod[:5], [0.5, 0.4, 0.4, 0.2, 0.2])
    np.testing.assert_allclose(prod[5:], [0.9, 0.1, 0.18, 0.06, 0.18])
    np.testing.assert_allclose(compose_path(p, par, "min")[:5], [0.5, 0.4, 0.5, 0.4, 0.5])
    order = np.random.default_rng(1).permutation(10)  # children before parents: still composed level by level
    inv = np.argsort(order)
    moved = np.where(par[order] >= 0, inv[par[order]], -1)  # each row's parent at its new row
    np.testing.assert_allclose(compose_path(p[order], moved, "product"), prod[order])
    # the q_tokens composed by product are the joints
    np.testing.assert_allclose(compose_path(cols["q_token"], par), cols["joint"], rtol=1e-6)
    with pytest.raises(ValueError, match="missing"):
        compose_path([0.5, 0.5], [1, 0])  # a cycle: no root to start from


def test_node_views_score_each_task_on_its_rows():
    from eval.classifier import node_views
    from eval.metrics import classification_metrics
    from models.features.nodes import compose_path, parent_rows

    cols = two_trees()
    par, y = parent_rows(cols), cols["on_path"].astype(np.float32)
    p = np.array([0.7, 0.2, 0.6, 0.5, 0.1, 0.3, 0.8, 0.4, 0.9, 0.2])
    base = {"joint": cols["joint"], "q_token": cols["q_token"]}
    auroc = lambda s, t: classification_metrics(s, t, 0.5)["auroc"]  # noqa: E731
    cond = node_views(p, cols["on_path"], par, base, ("joint", "q_token"), conditional=True)
    plain = node_views(p, cols["on_path"], par, base, ("joint", "q_token"), conditional=False)
    m = np.array(MASK)
    assert cond["cond"]["rows"] == 7 and cond["path"]["rows"] == 10
    assert cond["cond"]["auroc"] == plain["cond"]["auroc"] == auroc(p[m], y[m])  # both: the head's own P there
    assert cond["cond"]["auroc_q_token"] == auroc(cols["q_token"][m], y[m])
    assert cond["path"]["auroc"] == auroc(compose_path(p, par), y)  # a conditional head: its product on every node
    assert plain["path"]["auroc"] == auroc(p, y) and plain["path"]["auroc_joint"] == auroc(cols["joint"], y)


def test_datamodule_keeps_only_the_conditional_rows():
    from models.features.spec import FeatureSpec
    from train.datamodule import TraceDataModule

    traces = {}
    for i, split in enumerate(("train", "validation", "test")):
        cols = two_trees()
        cols["prompt_id"] = np.array([f"p{i}"] * 10)
        traces[split] = cols
    dm = TraceDataModule(traces, COND, FeatureSpec("c2t"), normalize=False)
    dm.setup()
    m = np.array(MASK)
    for split in ("train", "validation", "test"):
        d = dm.data[split]
        assert len(d["x"]) == len(d["y"]) == len(d["w"]) == len(d["pos"]) == len(d["base"]["joint"]) == m.sum()
        assert d["y"].tolist() == traces[split]["on_path"][m].astype(np.float32).tolist()
        np.testing.assert_allclose(d["base"]["joint"], traces[split]["joint"][m])
    nodes = dm.data["test"]["nodes"]  # every node, for the report's path view
    assert len(nodes["x"]) == 10 and nodes["parent_row"].tolist() == [-1, -1, 0, 1, 2, -1, -1, 5, 6, 7]
    assert "nodes" not in dm.data["train"]


def test_scheme_refused_on_chain_traces_in_one_line():
    from data_gen.labels import make_labels, make_mask

    chain = {"draft_token": np.zeros(3), "target_token": np.zeros(3), "position": np.arange(3),
             "prompt_id": np.array(["a"] * 3), "q_draft": np.ones(3), "p_draft": np.ones(3)}
    for fn in (make_labels, make_mask):
        with pytest.raises(UserError, match="trace=tree") as err:
            fn(chain, COND)
        assert "\n" not in str(err.value) and "on_path_given_parent" in str(err.value)
    with pytest.raises(UserError, match="reach_weight"):
        from data_gen.labels import make_weights

        make_weights(two_trees(), OmegaConf.create({"name": "on_path_given_parent", "reach_weight": 0.5}))
    # a chain label on tree traces names both tree labels
    with pytest.raises(UserError, match="on_path_given_parent"):
        make_labels(two_trees(), OmegaConf.create({"name": "greedy_match"}))


def fake_bundle(scheme: str):
    """What the builders read off a node head: its spec's kind, label scheme, threshold and path."""
    return SimpleNamespace(spec=SimpleNamespace(kind="tree_node"), labels={"name": scheme}, threshold=0.3,
                           path=f"{scheme}.ckpt")


def test_learned_tree_composes_a_conditional_head_by_product():
    from decode.learned_trees import C2T, LearnedTree
    from models.cost import CostProfile
    from models.tree import Tree

    prof = CostProfile(key={}, draft_ms=[0.05], target_ms=[1.0] * 64, prefill_lengths=[1], prefill_target_ms=[1.0],
                       prefill_draft_ms=[0.05], context=1, repeats=1)
    tree = Tree(root_q=None)
    a = tree.add(-1, 1, 0.5, 1)
    tree.add(-1, 2, 0.3, 2)
    b = tree.add(a, 3, 0.6, 1)
    tree.add(b, 4, 0.9, 1)
    tree.score = [0.5, 0.4, 0.8, 0.9]  # scored already (the replay fills them from the trace)
    cond = LearnedTree(bundle=fake_bundle("on_path_given_parent"), profile=prof)
    plain = LearnedTree(bundle=fake_bundle("on_path"), profile=prof)
    np.testing.assert_allclose(cond.acceptance(tree), [0.5, 0.4, 0.4, 0.36])
    np.testing.assert_allclose(plain.acceptance(tree), [0.5, 0.4, 0.5, 0.5])
    assert cond.conditional and not plain.conditional
    assert cond.describe()["head_labels"] == "on_path_given_parent"
    assert C2T(bundle=fake_bundle("on_path"), profile=prof).threshold == 0.3
    with pytest.raises(UserError, match="learned_tree:CKPT") as err:
        C2T(bundle=fake_bundle("on_path_given_parent"), profile=prof)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_train_and_eval_a_conditional_node_head(tmp_path):
    """train with labels=on_path_given_parent on tiny tree traces: its rows are the conditional ones, results.json
    carries both views (the cond view is its own test AUROC; the path view ranks every node by the product) and
    python -m eval reports the same numbers."""
    import json

    from data_gen.contract import split_cfg, trace_columns
    from data_gen.labels import make_mask
    from data_gen.run import generate
    from eval.classifier import run as evaluate
    from models.pair import load_pair
    from tests.test_features_nodes import train_cfg  # tiny tree_mbpp settings (the close tiny pair)
    from train.inputs import load_traces
    from train.job import run

    root = tmp_path / "traces"
    cfg = train_cfg("tree_node", root, "labels=on_path_given_parent")
    pair = load_pair(cfg.pair)
    for split in ("train", "validation", "test"):
        generate(split_cfg(cfg, split), split, pair)
    traces, manifests = load_traces(cfg)
    res = run(cfg, tmp_path / "run", traces, manifests)
    test = trace_columns(traces["test"], ["on_path", "node", "parent", "prompt_id", "position"])
    mask = make_mask(test, COND)
    assert res["labels"]["name"] == "on_path_given_parent" and res["test/rows"] == mask.sum() < len(mask)
    assert res["test/rows_cond"] == mask.sum() and res["test/rows_path"] == len(mask)
    assert res["test/auroc_cond"] == pytest.approx(res["test/auroc"]) and np.isfinite(res["test/auroc_path"])
    assert res["test/auroc_cond_q_token"] == pytest.approx(res["test/auroc_q_token"])
    assert res["path_score"].startswith("product")
    report = evaluate(OmegaConf.create({"split": "test", "ckpt": res["ckpt_path"], "out_dir": str(tmp_path / "eval"),
                                        "traces": str(next(root.glob("*--test-*"))), "threshold": None}))
    assert report["rows"] == mask.sum() and report["auroc"] == pytest.approx(res["test/auroc"], abs=1e-6)
    assert report["node_views"]["path"]["auroc"] == pytest.approx(res["test/auroc_path"], abs=1e-6)
    assert json.loads((tmp_path / "run" / "results.json").read_text())["test/auroc_path"] == res["test/auroc_path"]
