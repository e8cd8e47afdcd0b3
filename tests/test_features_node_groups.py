"""models.features.nodes' node groups (tree_node_plus, issue 30): node heads with the chain heads' richer inputs — the copy group on a context that
branches per node (hand-made context with known values), the policy-free verify group, decode handing each round's
tree the trace's context and verification numbers, and older tree traces refused for it in one line (tree_node still
reads them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from models.features.context import ContextIndex
from models.features.layout import COPY
from models.features.nodes import node_copy_columns
from models.features.spec import FeatureSpec, feature_kind
from models.tree import Tree
from utils.cli import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

PLUS = FeatureSpec("tree_node_plus", k=4)


def hand_tree() -> Tree:
    """Context [1, 2, 3, 4, 1, 2]; root children 3 (rank 1) and 9 (rank 2); 4 under 3; 5 under 9; 3 under 4."""
    v = 12
    q = lambda i: torch.softmax(torch.arange(v, dtype=torch.float32) * 0.1 * (i + 2), -1)  # noqa: E731
    t = Tree(root_q=q(-1), context=ContextIndex([1, 2, 3, 4, 1, 2]), verify=(0.7, 0.25))
    a = t.add(-1, 3, 0.5, 1)
    b = t.add(-1, 9, 0.2, 2)
    c = t.add(a, 4, 0.6, 1)
    t.add(b, 5, 0.3, 1)
    t.add(c, 3, 0.4, 1)
    for i in (a, b, c):
        t.q[i] = q(i)
    return t


def test_copy_and_verify_on_a_hand_made_context():
    """copy_len: the longest n-gram ending at x that occurred earlier (context + the node's path up to its parent);
    lookup: the context's last ≤ 3 tokens' most recent continuation; verify: the tree's numbers on every node."""
    t = hand_tree()
    # x=3 after [1,2,3,4,1,2]: 1,2,3 occurred (4,1,2,3 did not) → 3; lookup: (4,1,2) never continued, (1,2) → 3
    # x=9: nowhere → 0; lookup still (1,2) → 3 ≠ 9, length 2
    # x=4 after ..,1,2,3: 1,2,3,4 occurred → 4; lookup (1,2,3) → 4, length 3
    # x=5 after ..,1,2,9: 0; lookup: (1,2,9), (2,9), (9) never continued → 0
    # x=3 after ..,1,2,3,4: 3 occurred, (4,3) did not → 1; lookup (2,3,4) → 1 ≠ 3, length 3
    want = [[3, 1, 2], [0, 0, 2], [4, 1, 3], [0, 0, 0], [1, 0, 3]]
    toks = list(t.context.toks)
    assert node_copy_columns(t.context, t.parents, t.tokens, list(range(5))).tolist() == want
    assert t.context.toks == toks  # the index is left as found (paths pushed and rolled back)
    assert node_copy_columns(t.context, t.parents, t.tokens, [4, 1]).tolist() == [want[4], want[1]]
    # the chain's definition on the flattened context, node by node
    for i, path in enumerate(([], [], [3], [9], [3, 4])):
        assert ContextIndex(toks + path).copy_features(t.tokens[i]) == want[i]
    x = feature_kind("tree_node_plus").node_rows(t, list(range(5)), PLUS).numpy()
    names = PLUS.names
    np.testing.assert_array_equal(x[:, [names.index(c) for c in COPY]], np.asarray(want, np.float32))
    np.testing.assert_allclose(x[:, names.index("target_entropy")], 0.7)
    np.testing.assert_allclose(x[:, names.index("target_margin")], 0.25)
    node = FeatureSpec("tree_node", k=4)  # the first columns are tree_node's row
    base = feature_kind("tree_node").node_rows(t, list(range(5)), node).numpy()
    np.testing.assert_array_equal(x[:, : node.dim], base)
    # a tree without its context / verification numbers is refused (decode must hand them over)
    bare = hand_tree()
    bare.context = None
    with pytest.raises(RuntimeError, match="Tree.context"):
        feature_kind("tree_node_plus").node_rows(bare, [0], PLUS)
    bare = hand_tree()
    bare.verify = None
    with pytest.raises(RuntimeError, match="Tree.verify"):
        feature_kind("tree_node_plus").node_rows(bare, [0], PLUS)
    assert feature_kind("tree_node").node_rows(bare, [0], node).shape == (1, node.dim)  # tree_node needs neither


def test_one_group_alone_for_the_ablation():
    """model.groups picks either node group: the row is tree_node's + that group's values (equal to the full row's
    columns), only what it reads is asked of decode, and a chain group is refused; no groups = both (older heads)."""
    t = hand_tree()
    kind = feature_kind("tree_node_plus")
    full = kind.node_rows(t, list(range(5)), PLUS).numpy()
    for groups, cols, context, verify in ((["copy"], list(COPY), True, False),
                                          (["verify"], ["target_entropy", "target_margin"], False, True)):
        spec = FeatureSpec("tree_node_plus", k=4, groups=groups)
        node = FeatureSpec("tree_node", k=4)
        assert spec.names == node.names + cols
        assert (spec.needs_context, spec.needs_verify) == (context, verify)
        x = kind.node_rows(t, list(range(5)), spec).numpy()
        np.testing.assert_array_equal(x, full[:, [PLUS.names.index(c) for c in spec.names]])
    assert FeatureSpec("tree_node_plus", k=4, groups=["copy", "verify"]).names == PLUS.names
    with pytest.raises(ValueError, match="takes the groups verify, copy"):
        FeatureSpec("tree_node_plus", groups=["token"])
    with pytest.raises(ValueError, match="takes the groups none"):
        FeatureSpec("tree_node", groups=["copy"])


@torch.no_grad()
def test_decode_hands_the_tree_the_traces_context_and_verification(tiny_cfg, monkeypatch):
    """Each decode round's tree (learned_tree with a tree_node_plus head, greedy) carries prompt + the output so far
    and the last verification's H_p and margin; the trace's tree at the same position stores the same (up to float
    rounding of the target's passes), and a node on the same root path gets the same tree_node_plus row."""
    import decode.tree
    from decode.loop import speculative
    from decode.learned_trees import LearnedTree
    from models.pair import load_pair
    from tests.test_decode import make_head
    from tests.test_tree_traces import trace_items
    from tests.test_decode_tree import _profile

    pair = load_pair(OmegaConf.merge(tiny_cfg, {"draft": {"layers": [0, 1, 2]}}))
    items, rows = trace_items(pair, max_new=12, topk=3, depth=3)
    bundle = make_head(pair, "tree_node_plus", seed=1)
    kind, spec = feature_kind("tree_node_plus"), bundle.spec
    seen, grow = [], decode.tree.grow_tree

    def recording(*args, **kw):
        out = grow(*args, **kw)
        tree = out[0]
        seen.append((tree, list(tree.context.toks), tree.verify, kind.node_rows(tree, list(range(len(tree))), spec)))
        return out

    monkeypatch.setattr(decode.tree, "grow_tree", recording)
    compared = 0
    for it, r in zip(items, rows):
        seen.clear()
        builder = LearnedTree(bundle=bundle, topk=3, max_depth=3, max_nodes=12, profile=_profile(c=0.05))
        assert builder.needs_context and builder.needs_verify_stats
        y = speculative(pair, it.prefix, builder, 12, eos=set(pair.eos_ids)).tokens
        cols = {k: (np.asarray(v) if np.ndim(v) else np.repeat(v, r["n"])) for k, v in r.items() if k != "n"}
        xt = kind.from_columns(cols, spec).numpy()
        assert len(seen) > 2
        for tree, toks, ver, xd in seen:
            t = len(toks) - len(it.prefix)
            assert toks == it.prefix + y[:t]
            at = np.flatnonzero(r["position"] == t)
            np.testing.assert_allclose(ver, (r["root_target_entropy"][at[0]], r["root_target_margin"][at[0]]),
                                       atol=1e-4)
            assert (t == 0) == (ver == (0.0, 0.0))
            path_row = {path_row_key(at, r, i): at[i] for i in range(len(at))}  # the trace's nodes by root path
            for i in range(len(tree)):
                key, cur = [], i
                while cur >= 0:
                    key.insert(0, tree.tokens[cur])
                    cur = tree.parents[cur]
                j = path_row.get(tuple(key))
                if j is not None:
                    np.testing.assert_allclose(xd[i].numpy(), xt[j], atol=1e-4)
                    compared += 1
    assert compared > 50


def path_row_key(at, r, node: int) -> tuple:
    """The root path (tokens) of trace node `node` of the tree whose rows are `at` (node i is row at[i])."""
    key, cur = [], node
    while cur >= 0:
        key.insert(0, int(r["token"][at[cur]]))
        cur = int(r["parent"][at[cur]])
    return tuple(key)


def old_tree_columns(n_prompts: int = 2, seed: int = 0) -> dict:
    """Tree-trace columns as TREE_FORMAT 1 stored them (no verify / copy columns): one 4-node tree per prompt."""
    rng = np.random.default_rng(seed)
    n = 4 * n_prompts
    topk = np.sort(rng.random((n, 10)), axis=1)[:, ::-1]
    return {"prompt_id": np.repeat([f"p{seed}_{i}" for i in range(n_prompts)], 4), "split": np.array(["x"] * n),
            "kind": np.array(["tree"] * n), "position": np.zeros(n, np.int32), "node": np.tile([0, 1, 2, 3], n_prompts),
            "parent": np.tile([-1, -1, 0, 0], n_prompts), "depth": np.tile([1, 1, 2, 2], n_prompts),
            "rank": np.tile([1, 2, 1, 2], n_prompts), "token": rng.integers(0, 50, n),
            "q_token": rng.random(n).astype(np.float32), "joint": rng.random(n).astype(np.float32),
            "draft_entropy": rng.random(n).astype(np.float32),
            "on_path": np.tile([True, False, True, False], n_prompts),
            "length": np.full(n, 4, np.int32), "draft_topk": (topk / topk.sum(1, keepdims=True)).astype(np.float32)}


def test_old_tree_traces_refused_for_tree_node_plus_in_one_line():
    """Tree traces from before the verify / copy columns: tree_node_plus is refused in one line naming the columns
    and the fix, at training and wherever rows are read from columns (replay, sweep); tree_node still trains."""
    import datasets

    from train.datamodule import TraceDataModule

    labels = OmegaConf.create({"name": "on_path"})
    traces = {split: datasets.Dataset.from_dict(old_tree_columns(seed=i))
              for i, split in enumerate(("train", "validation", "test"))}
    TraceDataModule(traces, labels, FeatureSpec("tree_node")).setup()
    with pytest.raises(UserError) as err:
        TraceDataModule(traces, labels, FeatureSpec("tree_node_plus")).setup()
    msg = str(err.value)
    assert "\n" not in msg and "root_target_entropy" in msg and "copy_len" in msg and "overwrite=true" in msg
    with pytest.raises(UserError) as err:
        feature_kind("tree_node_plus").from_columns(old_tree_columns(), FeatureSpec("tree_node_plus"))
    assert "\n" not in str(err.value) and "overwrite=true" in str(err.value)


def test_an_older_tree_trace_format_is_refused_in_one_line(tmp_path, tiny_pair):
    """A tree trace folder of an older TREE_FORMAT (its config hash differs) is refused by name, not reused or mixed;
    overwrite=true regenerates it with the new columns."""
    import json

    from data_gen import store
    from data_gen.run import generate
    from data_gen.tree_format import TREE_FORMAT
    from tests.test_data_gen import make_cfg
    from tests.test_tree_traces import TREE

    cfg = make_cfg(tmp_path, *TREE, "limit=1")
    folder = generate(cfg, "test", tiny_pair)
    assert {"root_target_entropy", "copy_len"} <= set(store.load_traces(folder)[0].column_names)
    path = folder / store.MANIFEST
    manifest = json.loads(path.read_text())
    assert manifest["config"]["tree_format"] == TREE_FORMAT
    del manifest["config"]["tree_format"]  # as format 1 wrote it (and so another config hash)
    manifest["config_hash"] = "0123456789ab"
    path.write_text(json.dumps(manifest))
    with pytest.raises(UserError) as err:
        generate(cfg, "test", tiny_pair)
    assert "\n" not in str(err.value) and "format 1" in str(err.value) and "overwrite=true" in str(err.value)
    generate(make_cfg(tmp_path, *TREE, "limit=1", "overwrite=true"), "test", tiny_pair)
    assert json.loads(path.read_text())["config"]["tree_format"] == TREE_FORMAT
