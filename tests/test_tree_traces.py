"""Tree traces (data_gen trace=tree) and their greedy replay (eval.tree_replay): the rows' structure, labels and
features against direct computations, the shard/resume contract, hand-computed replays, and agreement with decode."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from data_gen.run import generate, verify_cmd
from data_gen.store import load_traces
from tests.test_data_gen import make_cfg
from tests.test_decode_tree import _profile
from utils.cli import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

TREE = ["trace=tree", "trace.max_new_tokens=6", "trace.tree_topk=3", "trace.tree_depth=3", "max_prompt_tokens=16"]
TEXTS = ("def f(x):", "import os\nclass A:", "hello world")


def tree_rows(folder):
    ds, manifest = load_traces(folder)
    cols = ds.with_format("numpy")[:]
    order = np.lexsort((cols["node"], cols["position"], cols["prompt_id"]))
    return {k: np.asarray(v)[order] for k, v in cols.items()}, manifest


@pytest.fixture(scope="module")
def close_pair(tiny_cfg):
    """The tiny target with a 3-of-4-layer draft: acceptance high enough that trees accept several tokens."""
    from models.pair import load_pair

    return load_pair(OmegaConf.merge(tiny_cfg, {"draft": {"layers": [0, 1, 2]}}))


def trace_items(pair, texts=TEXTS, max_new=16, topk=3, depth=3):
    from data_gen.traces import Item, tree_batch

    items = [Item(f"p{i}", "test", "tree", pair.tokenizer.encode(t)) for i, t in enumerate(texts)]
    cfg = OmegaConf.create({"kind": "tree", "max_new_tokens": max_new, "tree_topk": topk, "tree_depth": depth})
    return items, tree_batch(pair, items, cfg)


@torch.no_grad()
def test_rows_are_trees_with_greedy_labels_and_the_extractors_features(close_pair):
    """Parents precede children; depth, joint and q_token follow the parent; on_path is the direct check against
    target-only greedy; the DISCO features are DraftStep's on the parent's distribution from a cache-free pass; the
    copy columns are the chain's ContextIndex on prompt + y[:t] + the node's path; the verify columns are H_p and the
    top-2 margin of the target's distribution that produced y[t − 1] (a cache-free target pass), 0 at t = 0."""
    from decode.loop import autoregressive
    from models.distributions import draft_probs, entropy, top2_margin
    from models.features.context import ContextIndex
    from models.features.signals import DraftStep
    from models.lm import LM

    items, rows = trace_items(close_pair, max_new=10)
    draft, target = LM.of(close_pair, "draft"), LM.of(close_pair, "target")
    for it, r in zip(items, rows):
        y = autoregressive(close_pair, it.prefix, 10, eos=set(close_pair.eos_ids)).tokens
        assert int(r["length"][0]) == len(y) and sorted(set(r["position"])) == list(range(len(y)))
        checked = 0
        for t in range(len(y)):
            at = np.flatnonzero(r["position"] == t)
            nodes = list(r["node"][at])
            assert nodes == list(range(len(at)))
            want = (0.0, 0.0)
            if t > 0:
                logits, _ = target(it.prefix + y[: t - 1], target.new_cache(), last=1)
                p = draft_probs(logits[0])
                want = (float(entropy(p)), float(top2_margin(p)))
            np.testing.assert_allclose(r["root_target_entropy"][at], want[0], atol=1e-4)
            np.testing.assert_allclose(r["root_target_margin"][at], want[1], atol=1e-4)
            for j in at:
                node, par = int(r["node"][j]), int(r["parent"][j])
                assert par < node
                pj = at[par] if par >= 0 else None
                assert r["depth"][j] == (1 if par < 0 else r["depth"][pj] + 1)
                joint_par = 1.0 if par < 0 else r["joint"][pj]
                assert r["joint"][j] == pytest.approx(joint_par * r["q_token"][j], rel=1e-5)
                path, cur = [], j
                while cur is not None:
                    path.insert(0, int(r["token"][cur]))
                    p = int(r["parent"][cur])
                    cur = at[p] if p >= 0 else None
                assert bool(r["on_path"][j]) == (path == y[t : t + len(path)])
                copy = ContextIndex(it.prefix + y[:t] + path[:-1]).copy_features(path[-1])
                assert [r["copy_len"][j], r["lookup_hit"][j], r["lookup_len"][j]] == copy
                if checked < 12:  # the parent's distribution by a fresh, cache-free draft pass
                    ctx = it.prefix + y[:t] + path[:-1]
                    logits, _ = draft(ctx, draft.new_cache(), last=1)
                    q = draft_probs(logits[0])
                    step = DraftStep(probs=q, token=path[-1], hidden=None, position_in_round=0, position=t)
                    np.testing.assert_allclose(r["draft_topk"][j], step.topk(10).numpy(), atol=1e-5)
                    assert r["draft_entropy"][j] == pytest.approx(float(step.entropy), abs=1e-5)
                    assert r["q_token"][j] == pytest.approx(float(q[path[-1]]), abs=1e-5)
                    checked += 1
        assert r["on_path"].any()
    assert any((r["copy_len"] > 1).any() for r in rows) and any(r["lookup_hit"].any() for r in rows)


def test_tree_traces_keep_the_shard_and_resume_contract(tmp_path, tiny_pair, capsys):
    """Two shard jobs + verify equal one job; a deleted shard is regenerated to the same rows; another tree bound is
    another folder; sampling is refused in one line."""
    import shutil

    kw = [*TREE, "limit=3", "prompts_per_shard=1"]
    whole = generate(make_cfg(tmp_path / "one", *kw), "train", tiny_pair)
    assert whole.name.endswith("-w3-d3--train-lim3")
    root = tmp_path / "two"
    folder = generate(make_cfg(root, *kw, "num_shards=2", "shard_id=1"), "train", tiny_pair)
    assert sorted(p.name for p in folder.glob("shard-*")) == ["shard-00001"]
    with pytest.raises(UserError, match="incomplete"):
        verify_cmd(make_cfg(root, *kw, "num_shards=2"), "train")
    generate(make_cfg(root, *kw, "num_shards=2", "shard_id=0"), "train", tiny_pair)
    verify_cmd(make_cfg(root, *kw, "num_shards=2"), "train")
    a, ma = tree_rows(folder)
    b, mb = tree_rows(whole)
    assert ma["rows"] == mb["rows"] and ma["tree"] == {"topk": 3, "depth": 3, "stride": 1}
    for key in a:
        if a[key].dtype.kind == "f":
            np.testing.assert_allclose(a[key], b[key], atol=1e-5, err_msg=key)
        else:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    shutil.rmtree(whole / "shard-00001")
    capsys.readouterr()
    generate(make_cfg(tmp_path / "one", *kw), "train", tiny_pair)
    assert "resuming" in capsys.readouterr().out
    c, _ = tree_rows(whole)
    np.testing.assert_array_equal(c["token"], b["token"])
    with pytest.raises(UserError, match="temperature=0"):
        generate(make_cfg(tmp_path / "s", *kw, "trace.temperature=0.7"), "train", tiny_pair)


def _candidates():
    """One prompt, n = 4. At t=0: a(rank 1, on) → c(rank 1, on) → e(rank 1, off); b(rank 2, off). At t=3 (and
    everywhere else): a single off-path rank-1 node."""
    from eval.tree_replay import Candidates
    from models.tree import Tree

    t0 = Tree(root_q=None)
    a = t0.add(-1, 1, 0.6, 1)
    t0.add(-1, 2, 0.3, 2)
    c = t0.add(a, 3, 0.5, 1)
    t0.add(c, 4, 0.5, 1)
    one = Tree(root_q=None)
    one.add(-1, 9, 0.9, 1)
    on0 = np.array([True, False, True, False])
    off = np.array([False])
    return Candidates("p", 4, [t0, one, one, one], [on0, off, off, off], [np.arange(4)] + [np.arange(1)] * 3)


def test_replay_on_hand_made_candidates():
    """Chains and a static shape on a hand-made candidate set: τ, nodes and levels by hand."""
    from decode.tree_builders import TreeStatic
    from eval.tree_replay import chains, replay_prompt, summarize

    prof = _profile(slope=0.5, c=0.1)
    cand = _candidates()
    ch = chains(3, prof)
    r3 = replay_prompt(ch["chain_3"], cand, prof)  # t=0: a, c on → 3 tokens; t=3: 1 token (capped at n)
    assert r3["tokens"] == [3, 1] and r3["accepted"] == [2, 0] and r3["nodes"] == [3, 3] and r3["levels"] == [3, 3]
    assert r3["cost"] == pytest.approx(2 * prof.round_steps(3, 3)) and prof.round_steps(3, 3) == pytest.approx(2.8)
    r1 = replay_prompt(ch["chain_1"], cand, prof)  # t=0: 2 tokens; t=2: 1; t=3: 1
    assert r1["tokens"] == [2, 1, 1] and r1["nodes"] == [1, 1, 1]
    wide = TreeStatic(branching=[2, 2], max_depth=2, profile=prof)  # 6 nodes; b's and c's second child are missing
    rw = replay_prompt(wide, cand, prof)
    assert rw["tokens"] == [3, 1] and rw["nodes"] == [6, 6] and rw["levels"] == [2, 2]
    res = summarize({"wide": [rw, rw], "chain_1": [r1, r1]}, resamples=200)
    assert res["builders"]["wide"]["tau"] == pytest.approx(2.0) and res["builders"]["chain_1"]["tau"] == pytest.approx(4 / 3)
    assert res["best_tree"] == "wide" and res["best_chain"] == "chain_1"
    want = (4 / (2 * prof.round_steps(2, 6, [2]))) / (4 / (3 * prof.round_steps(1, 1)))
    assert res["best_tree_vs_chain"]["value"] == pytest.approx(want)
    # with the profile's tree curves, the tree's rounds are priced by them and the chains' are not
    prof.draft_level_ms, prof.target_tree_ms = [0.3] * 4, [1.0 + 0.8 * i for i in range(8)]
    assert replay_prompt(wide, cand, prof)["cost"] == pytest.approx(2 * (0.1 + 0.3 + 1.0 + 0.8 * 6))
    assert replay_prompt(ch["chain_3"], cand, prof)["cost"] == pytest.approx(2 * prof.round_steps(3, 3))


@pytest.mark.parametrize("name", ["eagle2", "learned_tree", "c2t", "learned_tree_plus"])
def test_dynamic_builders_replay_agrees_with_decode(close_pair, name):
    """On the same prompts, decode's rounds (greedy, float32) are the replay's: tokens per round and verified nodes,
    in every round not cut by the end of the continuation. For the learned builders the replay reads the head's
    scores off the trace rows (eval.tree_replay.head_scores' path: the kind's from_columns) while decode computes
    them from its own tree (node_rows), so this also checks the two feature paths agree inside the builder
    (learned_tree_plus: a tree_node_plus head, whose copy and verify columns decode gets from the loop)."""
    from decode.loop import speculative
    from decode.learned_trees import C2T, LearnedTree
    from decode.tree_builders import Eagle2
    from eval.tree_replay import candidates_from_columns, replay
    from models.features.spec import feature_kind
    from tests.test_decode import make_head

    prof = _profile(slope=0.0, c=0.05)
    items, rows = trace_items(close_pair, max_new=16, topk=3, depth=3)
    cols = {k: np.concatenate([np.asarray(r[k]) if np.ndim(r[k]) else np.repeat(r[k], r["n"]) for r in rows])
            for k in rows[0] if k != "n"}
    cands = candidates_from_columns(cols)
    scores, make = None, lambda: Eagle2(topk=3, max_depth=3, max_nodes=12, profile=prof)
    if name != "eagle2":
        kind = "tree_node_plus" if name == "learned_tree_plus" else "tree_node"
        bundle = make_head(close_pair, kind, seed=1)
        bundle.calibration = {"temperature": 0.3, "bias": 1.0, "mode": "platt"}  # spread the random head's scores
        scores = bundle.prob(feature_kind(kind).from_columns(cols, bundle.spec)).reshape(-1).double().numpy()
        cls = C2T if name == "c2t" else LearnedTree
        extra = {"threshold": float(np.median(scores))} if name == "c2t" else {}
        make = lambda: cls(bundle=bundle, topk=3, max_depth=3, max_nodes=12, profile=prof, **extra)  # noqa: E731
    longest = 0
    reps = replay(make(), cands, prof, scores, name)
    for it, cand, rep in zip(items, cands, reps):
        builder = make()
        dec = speculative(close_pair, it.prefix, builder, 16, eos=set(close_pair.eos_ids))
        assert len(dec.tokens) == cand.n
        emitted, t = [], 0
        for k, n in dec.rounds:
            emitted.append(min(n + 1, cand.n - t))
            t += emitted[-1]
        # the rounds decode grows to full depth (a leading run): past them it grows no deeper than the tokens left,
        # the replay's recorded trees are full-depth, so a head's selection there may differ
        full = [i for i, e in enumerate(np.cumsum([0] + emitted[:-1])) if cand.n - e - 1 >= builder.max_depth]
        assert rep["tokens"][: len(full)] == emitted[: len(full)] and sum(rep["tokens"]) == cand.n
        assert [rep["nodes"][i] for i in full] == [dec.rounds[i][0] for i in full]
        longest = max(longest, max(rep["accepted"]))
    assert longest >= 2  # trees that accept more than one drafted token


def test_replay_refuses_wrong_traces_and_settings(tmp_path, tiny_pair):
    from eval.tree_replay import builders, check_trace

    with pytest.raises(UserError, match="trace=tree"):
        check_trace({"trace_kind": "target_ar"}, tmp_path)
    with pytest.raises(UserError, match="stride=1"):
        check_trace({"trace_kind": "tree", "tree": {"stride": 2}}, tmp_path)
    cfg = OmegaConf.create({"policies": ["eagle2"], "policy": {"eagle2": {"topk": 2}}, "temperature": 0.0})
    with pytest.raises(UserError, match="topk"):
        builders(cfg, {"topk": 4, "depth": 5}, _profile())


def test_cli_end_to_end(tmp_path, cli):
    """python -m data_gen trace=tree, then python -m eval.tree_replay on it: both files, every builder and chain."""
    gen = cli("data_gen", "pair=tiny_random", "dataset=mbpp", "split=test", "limit=3", f"trace_root={tmp_path}",
              "progress=false", *TREE)
    assert gen.returncode == 0, gen.stderr[-2000:]
    folder = next(tmp_path.glob("tiny_random--mbpp--tree-*"))
    out = tmp_path / "out"
    rep = cli("eval.tree_replay", f"traces={folder}", f"out_dir={out}", "pair=tiny_random", "prompts=2",
              "resamples=200", "policy.eagle2.topk=3")
    assert rep.returncode == 0, rep.stderr[-2000:]
    res = json.loads((out / "tree_replay.json").read_text())
    assert set(res["builders"]) == {"tree_static", "sequoia", "eagle2", "chain_1", "chain_2", "chain_3", "chain_ev"}
    assert res["settings"]["prompts"] == 2 and "best_tree_vs_chain" in res
    assert all(r["tau"] >= 1.0 for r in res["builders"].values())
    assert "| eagle2 |" in (out / "tree_replay.md").read_text()
    assert (out / "speedup.png").stat().st_size > 1000
    bad = cli("eval.tree_replay", f"traces={tmp_path / 'missing'}", "pair=tiny_random")
    assert bad.returncode != 0 and "no traces at" in bad.stderr + bad.stdout
