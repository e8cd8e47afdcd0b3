"""The τ-vs-verified-nodes sweep (eval.tree_sweep), C2T's node saving at equal τ, and issue 30's bar (eval.tree_bar):
curves on tiny tree traces, the interpolation and its bootstrap on hand-made curves, the bar's keys and pass flags."""

from __future__ import annotations

import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from tests.test_tree_traces import TREE, close_pair, trace_items  # noqa: F401  (close_pair: a fixture)
from tests.test_decode_tree import _profile
from utils.cli import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ("def f(x):", "import os\nclass A:", "hello world", "for i in range(3):", "x = [1, 2")


def sweep_cfg(**over):
    base = {"policies": [], "policy": {}, "temperature": 0.0, "tuned": None, "learned": None, "c2t": None,
            "grid": {"nodes": [1, 2, 4, 32], "threshold_quantiles": [0.3, 0.6, 0.9]}, "reference_nodes": 2}
    return OmegaConf.create({**base, **over})


@pytest.fixture(scope="module")
def tiny_sweep(close_pair, tmp_path_factory):  # noqa: F811
    """The sweep of all three families on five prompts' depth-3, top-3 trees, with random heads saved to files."""
    from eval.tree_replay import candidates_from_columns, head_scores
    from eval.tree_sweep import sweep
    from tests.test_decode import make_head, save_head

    _, rows = trace_items(close_pair, texts=TEXTS, max_new=16, topk=3, depth=3)
    cols = {k: np.concatenate([np.asarray(r[k]) if np.ndim(r[k]) else np.repeat(r[k], r["n"]) for r in rows])
            for k in rows[0] if k != "n"}
    cands = candidates_from_columns(cols)
    d = tmp_path_factory.mktemp("heads")
    ckpts = {}
    for kind in ("tree_node", "c2t"):
        bundle = make_head(close_pair, kind, seed=1)
        bundle.calibration = {"temperature": 0.3, "bias": 1.0, "mode": "platt"}  # spread the random head's scores
        ckpts[kind] = str(save_head(bundle, d / f"{kind}.ckpt"))
    cfg = sweep_cfg(learned=ckpts["tree_node"], c2t=ckpts["c2t"])
    prof = _profile(slope=0.1, c=0.05)
    curves, notes = sweep(cfg, cands, {"topk": 3, "depth": 3, "stride": 1}, prof,
                          lambda b: head_scores(b, cols, {"pair_id": close_pair.pair_id}, "tiny"))
    return cfg, cands, prof, curves, notes


def test_sweep_curves_on_tiny_traces(tiny_sweep):
    """Every family has its grid; eagle2's τ and nodes never fall as N grows (and, per recorded tree, more nodes never
    accept less); at N past the tree's size learned_tree verifies what eagle2 does (every node), so their rounds agree;
    c2t grows as its threshold falls; depth capped at the trace's 3."""
    from eval.tree_replay import accepted
    from eval.tree_sweep import build_one, curve

    cfg, cands, prof, curves, notes = tiny_sweep
    assert set(curves) == {"eagle2", "eagle2_threshold", "learned_tree", "learned_tree_threshold", "c2t"}
    assert [p["param"]["N"] for p in curves["eagle2"]] == [1, 2, 4, 32]
    assert [p["param"]["quantile"] for p in curves["c2t"]] == [0.9, 0.6, 0.3]
    assert "capped at the trace depth 3" in notes["eagle2"]
    e = curve(curves["eagle2"])
    assert np.all(np.diff(e["tau"]) >= -1e-12) and np.all(np.diff(e["nodes"]) > 0)
    assert e["tau"][-1] > e["tau"][0] > 1.0
    tree = {"topk": 3, "depth": 3}
    built = [build_one(cfg, "eagle2", {"nodes": n}, tree, prof)[0] for n in (1, 2, 4, 32)]
    for c in cands:
        for t, on in zip(c.trees, c.on_path):
            acc = [accepted(t, on, b.pick(t)) for b in built]
            assert acc == sorted(acc)
    for key in ("tokens", "rounds", "nodes"):
        np.testing.assert_array_equal(curves["learned_tree"][-1]["sums"][key], curves["eagle2"][-1]["sums"][key])
    for fam in ("c2t", "eagle2_threshold", "learned_tree_threshold"):
        c = curve(curves[fam])
        assert np.all(np.diff(c["nodes"]) >= 0) and c["nodes"][-1] > c["nodes"][0], fam


def test_node_saving_on_the_tiny_sweep(tiny_sweep):
    """The reference is eagle2's own point at N=2; learned_tree's saving is read inside its curve, its interval holds
    the estimate, and c2t gets its row."""
    from eval.tree_sweep import curve, node_saving

    _, _, _, curves, _ = tiny_sweep
    res = node_saving(curves, 1, resamples=300)
    e = curve(curves["eagle2"])
    assert res["reference"] == {"tau": pytest.approx(e["tau"][1]), "nodes": pytest.approx(e["nodes"][1])}
    assert set(res["families"]) == {"eagle2_threshold", "learned_tree", "learned_tree_threshold", "c2t"}
    r = res["families"]["learned_tree"]
    assert r["nodes"] is not None and r["saving"] == pytest.approx(1 - r["nodes"] / e["nodes"][1])
    assert r["saving_ci"] is not None and r["saving_ci"][0] <= r["saving"] <= r["saving_ci"][1]


def test_interpolation_on_hand_made_curves():
    """nodes at τ_ref between adjacent points, the first crossing on a curve that dips, null outside the range."""
    from eval.tree_sweep import counts, nodes_at, saving, tau_at

    taus, nodes = [1.0, 1.5, 2.0, 2.2], [1, 2, 4, 8]
    assert nodes_at(1.75, taus, nodes) == pytest.approx(3.0)
    assert nodes_at(2.0, taus, nodes) == pytest.approx(4.0)
    assert nodes_at(2.1, taus, nodes) == pytest.approx(6.0)
    assert nodes_at(2.5, taus, nodes) is None and nodes_at(0.9, taus, nodes) is None
    assert saving((1.75, 6.0), {"tau": taus, "nodes": nodes}) == pytest.approx(0.5)
    assert np.isnan(saving((2.5, 6.0), {"tau": taus, "nodes": nodes}))
    assert tau_at(3.0, taus, nodes) == pytest.approx(1.75)
    assert nodes_at(1.75, [1.0, 2.0, 1.5, 2.5], [1, 2, 3, 4]) == pytest.approx(1.75)
    np.testing.assert_array_equal(counts(np.array([[0, 0, 2], [1, 2, 2]]), 3), [[2, 0, 1], [0, 1, 2]])


def test_path_scores_are_what_the_threshold_meets():
    """A learned builder's thresholds are quantiles of the P it prunes by: an on_path head's P capped by its parent's,
    a conditional head's product along the root path — on each recorded tree's own rows."""
    from types import SimpleNamespace

    from eval.tree_sweep import path_scores

    trees = [SimpleNamespace(parents=[-1, 0, 0, 1]), SimpleNamespace(parents=[-1, 0])]
    cands = [SimpleNamespace(trees=trees, rows=[np.array([0, 1, 2, 3]), np.array([4, 5])])]
    scores = np.array([0.5, 0.8, 0.4, 0.9, 0.3, 0.6])
    np.testing.assert_allclose(path_scores(SimpleNamespace(conditional=False), cands, scores),
                               [0.5, 0.5, 0.4, 0.5, 0.3, 0.3])
    np.testing.assert_allclose(path_scores(SimpleNamespace(conditional=True), cands, scores),
                               [0.5, 0.4, 0.2, 0.36, 0.3, 0.18])


def _points(taus_a, taus_b, nodes, prompts=20, rounds=10):
    """Hand-made per-prompt sums: half the prompts at τ taus_a, half at taus_b, `nodes` per round throughout."""
    pts = []
    for ta, tb, n in zip(taus_a, taus_b, nodes):
        tau = np.array([ta, tb] * (prompts // 2))
        r = np.full(prompts, float(rounds))
        pts.append({"param": {"nodes": n}, "sums": {"tokens": tau * r, "rounds": r, "nodes": n * r, "levels": 3 * r,
                                                    "cost": 2 * r}})
    return pts


def test_node_saving_and_its_interval_by_hand():
    """eagle2 (1.5, 1) (2.0, 4) (2.5, 8), learned (1.5, 1) (2.5, 4) (3.0, 8) on average: at τ_ref = 2.0 the learned
    curve needs 2.5 nodes, saving 1 − 2.5/4 = 0.375, inside a non-degenerate paired interval; a reference past the
    learned curve's range gives null, not an extrapolation."""
    from eval.tree_sweep import node_saving

    curves = {"eagle2": _points([1.4, 1.9, 2.4], [1.6, 2.1, 2.6], [1, 4, 8]),
              "learned_tree": _points([1.5, 2.4, 2.9], [1.5, 2.6, 3.1], [1, 4, 8])}
    r = node_saving(curves, 1, resamples=500)["families"]["learned_tree"]
    assert r["nodes"] == pytest.approx(2.5) and r["saving"] == pytest.approx(0.375)
    lo, hi = r["saving_ci"]
    assert lo < 0.375 < hi and hi - lo < 0.5
    assert r["tau_at_equal_nodes"] == pytest.approx(2.5)
    far = {"eagle2": _points([1.4, 1.9, 3.4], [1.6, 2.1, 3.6], [1, 4, 8]), "learned_tree": curves["learned_tree"]}
    f = node_saving(far, 2, resamples=200)["families"]["learned_tree"]
    assert f["nodes"] is None and f["saving"] is None and "outside" in f["note"]


def bar_inputs(tmp_path, saving=0.2, saving_ci=(0.05, 0.3), wall_prompts=100):
    """Small hand-made inputs of eval.tree_bar."""
    d = tmp_path / "in"
    (d / "wall").mkdir(parents=True)
    sweep = {"settings": {"prompts": 500, "traces": "T", "reference_nodes": 8,
                          "command": "python -m eval.tree_sweep x"},
             "node_saving": {"reference": {"tau": 2.4, "nodes": 8.0}, "families": {
                 "learned_tree_threshold": {"tau": 2.4, "nodes": 8.0 * (1 - saving), "saving": saving,
                                            "saving_ci": list(saving_ci), "tau_at_equal_nodes": 2.6, "note": None},
                 "c2t": {"tau": 2.4, "nodes": 7.0, "saving": 0.125, "saving_ci": [0.0, 0.2], "tau_at_equal_nodes": 2.5,
                         "note": None}}}}
    replay = {"settings": {"prompts": 500, "traces": "T", "command": "python -m eval.tree_replay y"},
              "best_tree": "sequoia", "best_chain": "chain_3",
              "best_tree_vs_chain": {"value": 1.04, "ci": [1.01, 1.07]}}
    speeds = {"target": 1.0, "expected_value": 1.25, "oracle": 1.6, "sequoia": 1.22, "eagle2": 1.30}
    summary = {k: {"speedup": v, "n_prompts": wall_prompts, "new_tokens": 128 * wall_prompts}
               for k, v in speeds.items()}
    rows = [{"method": m, "prompt_id": f"p{i}", "new_tokens": 128, "wall_s": 128 / (20 * v * (1 + 0.1 * (i % 3)))}
            for m, v in speeds.items() for i in range(6)]
    files = {"sweep": d / "sweep.json", "replay": d / "replay.json", "wall": d / "wall" / "summary.json",
             "head": d / "head.json", "ceiling": d / "ceiling.json"}
    for name, obj in (("sweep", sweep), ("replay", replay), ("wall", summary),
                      ("head", {"test/auroc": 0.80, "test/auroc_joint": 0.76, "command": "python -m train z"}),
                      ("ceiling", {"rank_vector": [0.58, 0.12], "static_tree_vs_chain": 1.078,
                                   "command": "python -m eval.tree_ceiling"})):
        files[name].write_text(json.dumps(obj))
    (d / "wall" / "run.json").write_text(json.dumps({"max_new_tokens": 128, "policies": list(speeds)[1:],
                                                     "pair": "p", "dataset": "mbpp", "split": "test", "limit": 100}))
    (d / "wall" / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return files


def bar_cfg(files, out):
    cfg = OmegaConf.load("conf/tree_bar.yaml")
    cfg.inputs = {k: str(v) for k, v in files.items()}
    cfg.out, cfg.resamples = str(out), 300
    return cfg


def test_tree_bar_writes_the_keys_and_the_pass_flags(tmp_path):
    """Exactly the issue's keys in each section (plus sources and pass); the oracle is no chain; each flag follows its
    criterion: a CI reaching below 0 fails node_saving, a wall run under 100 prompts fails wall_size."""
    from eval.tree_bar import run

    out = tmp_path / "bar.json"
    run(bar_cfg(bar_inputs(tmp_path), out))
    bar = json.loads(out.read_text())
    assert set(bar) == {"replay", "wall", "auroc", "ceiling", "sources", "pass", "criteria", "notes", "date"}
    assert {"prompts", "tau_learned", "tau_eagle2", "nodes_learned", "nodes_eagle2", "node_saving", "node_saving_ci",
            "best_tree_vs_chain"} <= set(bar["replay"])
    assert {"prompts", "best_tree_speedup", "best_chain_speedup"} <= set(bar["wall"])
    assert set(bar["auroc"]) == {"head", "joint_prob"}
    assert set(bar["ceiling"]) == {"rank_vector", "static_tree_vs_chain"}
    assert set(bar["sources"]) == {"sweep", "replay", "wall", "head", "ceiling"}
    assert bar["sources"]["sweep"]["command"] == "python -m eval.tree_sweep x"
    assert bar["sources"]["wall"]["command"].startswith("python -m decode")
    assert bar["replay"]["node_saving"] == 0.2 and bar["replay"]["best_tree_vs_chain"] == 1.04
    assert bar["wall"]["best_chain"] == "expected_value" and bar["wall"]["best_tree"] == "eagle2"
    assert bar["wall"]["best_chain_speedup"] == 1.25 and bar["wall"]["ratio"] == pytest.approx(1.04)
    lo, hi = bar["wall"]["ratio_ci"]
    assert lo <= hi
    assert bar["pass"] == {"node_saving": True, "auroc": True, "wall_tree_vs_chain": False,
                           "sequoia_vs_expected_value": True, "replay_prompts": True, "wall_size": True}
    assert "node saving" in (tmp_path / "bar.md").read_text()
    out2 = tmp_path / "bar2.json"
    bar2 = run(bar_cfg(bar_inputs(tmp_path / "b", saving_ci=(-0.01, 0.4), wall_prompts=20), out2))
    assert bar2["pass"]["node_saving"] is False and bar2["pass"]["wall_size"] is False and bar2["pass"]["auroc"]


def test_tree_bar_scores_a_conditional_head_on_the_path_label(tmp_path):
    """The joint probability is a path score: a conditional head is compared by its composed P(on path), not by its
    own label where it beats the joint by construction (that reading goes to the notes)."""
    from eval.tree_bar import run

    files = bar_inputs(tmp_path)
    files["head"].write_text(json.dumps({"test/auroc": 0.97, "test/auroc_joint": 0.92, "test/auroc_q_token": 0.96,
                                         "test/auroc_path": 0.97, "test/auroc_path_joint": 0.96}))
    bar = run(bar_cfg(files, tmp_path / "bar.json"))
    assert bar["auroc"] == {"head": 0.97, "joint_prob": 0.96} and bar["pass"]["auroc"] is False
    assert any("own label" in n for n in bar["notes"]) is False  # equal readings: nothing to add
    files["head"].write_text(json.dumps({"test/auroc": 0.968, "test/auroc_joint": 0.924, "test/auroc_q_token": 0.96,
                                         "test/auroc_path": 0.971, "test/auroc_path_joint": 0.961}))
    bar = run(bar_cfg(files, tmp_path / "bar.json"))
    assert bar["auroc"] == {"head": 0.971, "joint_prob": 0.961} and bar["pass"]["auroc"] is False
    assert any("own label: AUROC 0.968 vs joint 0.924" in n for n in bar["notes"])


def test_tree_bar_refuses_a_missing_input_in_one_line(tmp_path, cli):
    """A missing input: one line naming the file and the command that makes it, and no bar written."""
    from eval.tree_bar import run

    files = bar_inputs(tmp_path)
    files["ceiling"].unlink()
    out = tmp_path / "bar.json"
    with pytest.raises(UserError, match="ceiling.json is missing; make it with `python -m eval.tree_ceiling") as err:
        run(bar_cfg(files, out))
    assert "\n" not in str(err.value) and not out.exists() and not (tmp_path / "bar.md").exists()
    args = [f"inputs.{k}={v}" for k, v in files.items()]
    done = cli("eval.tree_bar", *args, f"out={out}")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "inputs.ceiling" in lines[0] and not out.exists()


def test_sweep_cli_end_to_end(tmp_path, cli, tiny_pair):
    """python -m data_gen trace=tree, then python -m eval.tree_sweep with saved heads: the JSON (curves, reference
    point, a saving row per learned family), the table and the plot."""
    from tests.test_decode import make_head, save_head

    gen = cli("data_gen", "pair=tiny_random", "dataset=mbpp", "split=test", "limit=3", f"trace_root={tmp_path}",
              "progress=false", *TREE)
    assert gen.returncode == 0, gen.stderr[-2000:]
    folder = next(tmp_path.glob("tiny_random--mbpp--tree-*"))
    ckpt = {k: save_head(make_head(tiny_pair, k, seed=2), tmp_path / f"{k}.ckpt") for k in ("tree_node", "c2t")}
    out = tmp_path / "out"
    done = cli("eval.tree_sweep", f"traces={folder}", f"out_dir={out}", "pair=tiny_random",
               f"learned={ckpt['tree_node']}", f"c2t={ckpt['c2t']}", "prompts=3", "resamples=100",
               "grid.nodes=[1,2,4]", "reference_nodes=2", "grid.threshold_quantiles=[0.2,0.8]")
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads((out / "tree_sweep.json").read_text())
    assert [len(res["curves"][f]) for f in ("eagle2", "learned_tree", "c2t", "eagle2_threshold")] == [3, 3, 2, 2]
    assert res["settings"]["prompts"] == 3 and res["settings"]["command"].startswith("python -m eval.tree_sweep")
    assert res["node_saving"]["reference"]["nodes"] == pytest.approx(res["curves"]["eagle2"][1]["nodes"])
    assert set(res["node_saving"]["families"]) == {"eagle2_threshold", "learned_tree", "learned_tree_threshold", "c2t"}
    assert (out / "tree_sweep.png").stat().st_size > 1000 and "| eagle2 | N=2 |" in (out / "tree_sweep.md").read_text()
