"""models.features.nodes, the token-tree node kinds (issue 30): the c2t / tree_node / tree_node_plus feature kinds give the same rows from a
models.tree.Tree (decode's `node_rows`) as from that tree's trace columns, the on_path label scheme, and train →
checkpoint → eval on tiny tree traces, compared with the joint probability and q_token rather than max q / −H_q."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf, open_dict

from data_gen.contract import trace_columns
from models.features.spec import FeatureSpec, feature_kind
from utils.cli import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

NODE_KINDS = ("c2t", "tree_node", "tree_node_plus")
CLOSE = "pair.draft.layers=[0,1,2]"  # the tiny target with a 3-of-4-layer draft: trees accept several tokens
TINY = [CLOSE, "trace.max_new_tokens=6", "trace.tree_topk=3", "trace.tree_depth=3", "+max_prompt_tokens=16",
        "split_limits.train=4", "split_limits.validation=2", "split_limits.test=2", "data.batch_size=256"]


@pytest.fixture(scope="module")
def close_pair(tiny_cfg):
    from models.pair import load_pair

    return load_pair(OmegaConf.merge(tiny_cfg, {"draft": {"layers": [0, 1, 2]}}))


def table_columns(rows: list[dict], k: int = 10) -> dict:
    """tree_batch rows → the stored Arrow table → trace columns, as train and eval read them."""
    from data_gen.store import _tree_table

    ds = datasets.Dataset(_tree_table(rows, k))
    return trace_columns(ds, ds.column_names)


# ------------------------------------------------------------------------------- (a) decode rows = trace rows


def test_node_rows_equal_the_trace_rows_exactly(close_pair, monkeypatch):
    """Every tree data_gen grows (recorded by wrapping models.tree.grow): node_rows on it equals from_columns on its
    stored rows bit for bit, for every node kind, for all nodes and for a subset whose parents are not in it
    (tree_node_plus: with the root context and verification numbers the trace hands the tree)."""
    import models.tree
    from data_gen.traces import Item, tree_batch
    from models.features.context import ContextIndex
    from models.lm import LM

    grown, grow = [], models.tree.grow

    def recording(*args, **kw):
        out = grow(*args, **kw)
        out[0].context = ContextIndex(out[0].context.toks)  # the trace's index moves on along y: keep the root's
        grown.append(out[0])
        return out

    monkeypatch.setattr(models.tree, "grow", recording)
    items = [Item(f"p{i}", "test", "tree", close_pair.tokenizer.encode(t)) for i, t in enumerate(("def f(x):", "a = 1"))]
    rows = tree_batch(close_pair, items, OmegaConf.create({"kind": "tree", "max_new_tokens": 5, "tree_topk": 3,
                                                           "tree_depth": 3}))
    cols = table_columns(rows)
    support = LM.of(close_pair, "draft").support
    assert len(grown) == len(set(zip(cols["prompt_id"].tolist(), cols["position"].tolist()))) > 2
    for name in NODE_KINDS:
        kind, spec = feature_kind(name), FeatureSpec(name, k=10)
        assert kind.tree and spec.dim == len(kind.names(spec))
        x = kind.from_columns({c: cols[c] for c in kind.columns(spec)}, spec)
        assert x.dtype == torch.float32 and x.shape == (len(cols["node"]), spec.dim)
        decoded = torch.cat([kind.node_rows(t, list(range(len(t))), spec, support) for t in grown])
        assert torch.equal(decoded, x), name
        # decode's builders pass no support: the tree carries the draft's (what the traces were computed on)
        assert torch.equal(torch.cat([kind.node_rows(t, list(range(len(t))), spec) for t in grown]), x), name
        t = grown[0]
        deep = [i for i in range(len(t)) if t.depth[i] == max(t.depth)]  # their parents are not asked for
        assert torch.equal(kind.node_rows(t, deep, spec, support), x[deep])
    # the tree_node row: top-k of the parent, ..., the parent's own q_token (1 at depth 1)
    spec = FeatureSpec("tree_node", k=10)
    x = feature_kind("tree_node").from_columns(cols, spec).numpy()
    names = spec.names
    assert names[:2] == ["top1", "top2"] and names[-1] == "parent_q"
    np.testing.assert_array_equal(x[:, names.index("joint")], cols["joint"])
    np.testing.assert_array_equal(x[:, names.index("log_joint")], np.log(cols["joint"]))
    row = {(p, t, n): i for i, (p, t, n) in enumerate(zip(cols["prompt_id"], cols["position"], cols["node"]))}
    want = [1.0 if par < 0 else cols["q_token"][row[p, t, par]]
            for p, t, par in zip(cols["prompt_id"], cols["position"], cols["parent"])]
    np.testing.assert_array_equal(x[:, -1], np.asarray(want, np.float32))
    assert (cols["depth"] == 3).any() and (x[cols["depth"] > 1, -1] != 1.0).any()
    # tree_node_plus: tree_node's row, then the verify and copy node groups (stored columns, read as they are)
    plus = FeatureSpec("tree_node_plus", k=10)
    xp = feature_kind("tree_node_plus").from_columns(cols, plus).numpy()
    np.testing.assert_array_equal(xp[:, : spec.dim], x)
    assert plus.names[spec.dim :] == ["target_entropy", "target_margin", "copy_len", "lookup_hit", "lookup_len"]
    for j, c in enumerate(("root_target_entropy", "root_target_margin", "copy_len", "lookup_hit", "lookup_len")):
        np.testing.assert_array_equal(xp[:, spec.dim + j], cols[c])
    assert (cols["root_target_entropy"][cols["position"] == 0] == 0).all()
    assert (cols["root_target_entropy"][cols["position"] > 0] > 0).all() and (cols["copy_len"] > 0).any()
    # rows in another order (a shuffled table): the parent is found by (prompt, position, node), same rows
    perm = np.random.default_rng(0).permutation(len(cols["node"]))
    shuffled = feature_kind("tree_node").from_columns({c: v[perm] for c, v in cols.items()}, spec).numpy()
    np.testing.assert_array_equal(shuffled, x[perm])


def test_node_kind_capabilities():
    """What the stages ask a kind: tree, its baselines, whether it reads top-k; no chain-round decoder."""
    with pytest.raises(UserError, match="token-tree nodes"):
        feature_kind("c2t").decoder(FeatureSpec("c2t"))
    assert not feature_kind("disco").tree and feature_kind("disco").baselines == ("max_q", "neg_entropy")
    assert feature_kind("tree_node").baselines == ("joint", "q_token") and feature_kind("tree_node").reads_probs
    assert not feature_kind("c2t").reads_probs and FeatureSpec("c2t").names == ["joint", "parent_entropy", "depth"]
    plus, node = FeatureSpec("tree_node_plus"), FeatureSpec("tree_node")
    assert feature_kind("tree_node_plus").tree and feature_kind("tree_node_plus").baselines == ("joint", "q_token")
    assert plus.reads_probs and not plus.reads_hidden and plus.needs_context and plus.needs_verify
    assert not (node.needs_context or node.needs_verify or FeatureSpec("c2t").needs_context)
    assert plus.dim == node.dim + 5 and plus.names[: node.dim] == node.names
    with pytest.raises(UserError, match="token-tree nodes"):
        feature_kind("tree_node_plus").decoder(plus)


# ---------------------------------------------------------------------------------------------- (b) the label


def test_on_path_labels():
    from data_gen.labels import make_labels, make_weights, required_columns

    cfg = OmegaConf.create({"name": "on_path"})
    assert required_columns(cfg) == ("on_path",)
    cols = {"on_path": np.array([True, False, True]), "position": np.array([0, 0, 1])}
    y = make_labels(cols, cfg)
    assert y.dtype == np.float32 and y.tolist() == [1.0, 0.0, 1.0]
    assert make_weights(cols, cfg).tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(UserError, match="trace=tree"):  # chain traces have no on_path column
        make_labels({"draft_token": np.zeros(2), "target_token": np.zeros(2)}, cfg)
    with pytest.raises(UserError, match="labels=on_path"):  # a chain label on tree traces names the tree label
        make_labels(cols, OmegaConf.create({"name": "greedy_match"}))
    with pytest.raises(UserError, match="reach_weight"):
        make_weights(cols, OmegaConf.create({"name": "on_path", "reach_weight": 0.5}))


# ------------------------------------------------------------------------------- (c) train, (d) eval, end to end


@pytest.fixture(scope="module")
def tree_traces(tmp_path_factory, close_pair):
    """Tiny tree traces for train/validation/test (c2t_mbpp's settings shrunk), generated once in-process."""
    from data_gen.contract import split_cfg
    from data_gen.run import generate

    root = tmp_path_factory.mktemp("tree_traces")
    cfg = train_cfg("c2t", root)
    for split in ("train", "validation", "test"):
        generate(split_cfg(cfg, split), split, close_pair)
    return root


def train_cfg(kind: str, root, *extra: str):
    from hydra import compose, initialize_config_dir

    from utils.cli import CONF_DIR

    exp = {"c2t": "c2t_mbpp", "tree_node": "tree_mbpp", "tree_node_plus": "tree_plus_mbpp"}[kind]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"+experiment={exp}", "pair=tiny_random", "logger=none", f"trace_root={root}",
                                          "trainer.max_epochs=2", *TINY, *extra])
    with open_dict(cfg):
        cfg.trainer.enable_progress_bar = False
        cfg.progress = False
    return cfg


@pytest.mark.parametrize("kind", NODE_KINDS)
def test_train_and_eval_a_node_head(kind, tree_traces, close_pair, tmp_path):
    """train on tree traces → a checkpoint load_head reads (spec.kind c2t / tree_node / tree_node_plus) whose
    results.json compares it with the joint probability and q_token (the AUROCs of those columns on the test
    nodes), no chain-only numbers; the lead's decode interface scores a grown tree's nodes; python -m eval reports
    the same numbers."""
    from data_gen.labels import make_labels
    from eval.classifier import run as evaluate
    from eval.metrics import classification_metrics
    from models.features.context import ContextIndex
    from models.heads import load_head
    from models.lm import LM
    from models.tree import TopkExpander, grow
    from train.inputs import load_traces
    from train.job import run

    cfg = train_cfg(kind, tree_traces)
    assert (cfg.trace.kind, cfg.labels.name, cfg.model.kind) == ("tree", "on_path", kind)
    traces, manifests = load_traces(cfg)  # complete folders: reused, nothing generated
    res = run(cfg, tmp_path / "run", traces, manifests)
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["ckpt_path"] == res["ckpt_path"] and (tmp_path / "run" / "csv" / "metrics.csv").is_file()
    test = trace_columns(traces["test"], ["joint", "q_token", "on_path"])
    y = make_labels(test, OmegaConf.create({"name": "on_path"}))
    assert 0 < y.mean() < 1 and saved["test/rows"] == len(y)
    assert saved["test/auroc_joint"] == classification_metrics(test["joint"], y, 0.5)["auroc"]
    assert saved["test/auroc_q_token"] == classification_metrics(test["q_token"], y, 0.5)["auroc"]
    assert "test/auroc_max_q" not in saved and "test/auroc_neg_entropy" not in saved
    assert saved["test/f1_static_best"] is None and saved["speed_rule"] is None
    assert np.isfinite(saved["test/auroc"]) and saved["labels"]["name"] == "on_path"

    bundle = load_head(res["ckpt_path"])
    assert bundle.kind == kind and bundle.spec.kind == kind and bundle.calibration["mode"] == "platt"
    nodes_kind = feature_kind(bundle.spec.kind)
    assert nodes_kind.tree
    draft = LM.of(close_pair, "draft")
    ids = close_pair.tokenizer.encode("def f(x):")
    tree, _, _ = grow(draft, draft.new_cache(), ids, TopkExpander(3, 3), context=ContextIndex(ids), verify=(1.0, 0.5))
    nodes = list(range(len(tree)))[1:]
    x = nodes_kind.node_rows(tree, nodes, bundle.spec)
    p = bundle.prob(x)
    assert x.shape == (len(nodes), bundle.spec.dim) and p.shape == (len(nodes),) and ((p > 0) & (p < 1)).all()

    out = tmp_path / "eval"
    report = evaluate(OmegaConf.create({"split": "test", "ckpt": res["ckpt_path"], "out_dir": str(out),
                                        "traces": str(next(tree_traces.glob("*--test-*"))), "threshold": None}))
    assert report["kind"] == kind and report["rows"] == len(y) and report["k_static_best"] is None
    assert report["auroc"] == pytest.approx(saved["test/auroc"], abs=1e-6)
    assert report["baseline_auroc"] == {"joint": saved["test/auroc_joint"], "q_token": saved["test/auroc_q_token"]}
    assert "sprinter_theory" not in report and set(report["per_position_auroc"]) <= {"0", "1", "2"}
    md = (out / "report.md").read_text()
    assert "| joint probability | q(token) |" in md and "depth − 1" in md
    assert (out / "roc.png").is_file() and json.loads((out / "report.json").read_text())["kind"] == kind
