"""eval.bar: the stop-head bar's ratios, gap and paired intervals follow from the per-prompt rows by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from utils.cli import UserError
from utils.files import jsonl_path, read_jsonl


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def folders(tmp_path):
    rng = np.random.default_rng(0)
    n = 40
    tcost = rng.uniform(800, 1200, n)
    # cost per prompt: the head 10% cheaper than svip on every prompt, static K-opt 5% dearer, the oracle 30% cheaper
    factor = {"learned": 0.9 * 0.8, "svip": 0.8, "max_confidence": 0.85, "static_opt": 0.84, "oracle": 0.56}
    rep = tmp_path / "replay"
    rep.mkdir()
    rows = [{"method": m, "prompt_id": f"p{i}", "new_tokens": 128, "target_cost_ms": float(tcost[i]),
             "cost_ms": float(tcost[i] * f * rng.uniform(0.97, 1.03))} for m, f in factor.items() for i in range(n)]
    write_rows(rep / "prompts.jsonl", rows)
    speed = {m: sum(r["target_cost_ms"] for r in rows if r["method"] == m)
             / sum(r["cost_ms"] for r in rows if r["method"] == m) for m in factor}
    table = {m: {"cost_model_speedup": s, "score_auroc": {"learned": 0.87, "max_confidence": 0.79, "svip": 0.78}.get(m)}
             for m, s in speed.items()}
    table["synthetic[auroc=0.99]"] = {"cost_model_speedup": 9.0}
    (rep / "replay.json").write_text(json.dumps({"eval": table, "settings": {"tune": "v", "eval": "t", "c": 0.2}}))
    wall = tmp_path / "wall"
    wall.mkdir()
    wrows = []
    for i in range(n):
        wrows.append({"method": "target", "prompt_id": f"p{i}", "new_tokens": 64, "wall_s": 3.0})
        wrows.append({"method": "svip", "prompt_id": f"p{i}", "new_tokens": 64, "wall_s": 2.4 * rng.uniform(0.95, 1.05)})
        wrows.append({"method": "learned", "prompt_id": f"p{i}", "new_tokens": 64, "wall_s": 2.2 * rng.uniform(0.95, 1.05)})
    write_rows(wall / "prompts.jsonl", wrows)
    (wall / "summary.json").write_text(json.dumps({"target": {"speedup": 1.0}, "svip": {"speedup": 1.25},
                                                   "learned": {"speedup": 1.36}}))
    return rep, wall, speed, wrows


def test_bar_by_hand(folders, tmp_path):
    from eval.bar import run

    rep, wall, speed, wrows = folders
    cfg = OmegaConf.create({"bar": {"replay": str(rep), "wall": str(wall), "out": str(tmp_path / "bar.json"),
                                    "n_resamples": 500}})
    out = run(cfg)
    r = out["replay"]
    assert r["best_learned"] == "learned" and r["best_training_free"] == "svip"  # not the oracle, not synthetic
    assert r["ratio"] == pytest.approx(speed["learned"] / speed["svip"])
    gap = (speed["learned"] - speed["static_opt"]) / (speed["oracle"] - speed["static_opt"])
    assert r["gap_closed"] == pytest.approx(gap)
    assert r["ratio_ci"][0] < r["ratio"] < r["ratio_ci"][1] and r["ratio_ci"][0] > 1.05  # 10% on every prompt
    assert out["auroc"] == {"head": 0.87, "max_q": 0.79, "neg_entropy": 0.78}
    w = out["wall"]
    tps = {m: sum(x["new_tokens"] for x in wrows if x["method"] == m) / sum(x["wall_s"] for x in wrows if x["method"] == m)
           for m in ("learned", "svip")}
    assert w["prompts"] == 40 and w["ratio"] == pytest.approx(tps["learned"] / tps["svip"])
    assert w["ratio_ci"][0] < w["ratio"] < w["ratio_ci"][1]
    assert json.loads((tmp_path / "bar.json").read_text())["replay"]["ratio"] == pytest.approx(r["ratio"])


def test_bar_refuses_a_wall_run_without_the_replays_methods(folders, tmp_path):
    from eval.bar import run

    rep, wall, _, _ = folders
    (wall / "summary.json").write_text(json.dumps({"target": {}, "learned": {}}))
    cfg = OmegaConf.create({"bar": {"replay": str(rep), "wall": str(wall), "out": str(tmp_path / "b.json"),
                                    "n_resamples": 100}})
    with pytest.raises(UserError, match="did not decode"):
        run(cfg)
    assert not (tmp_path / "b.json").exists()  # nothing half-written


def test_carry_over_per_group(folders, tmp_path, monkeypatch):
    """Another prompt set replayed with MBPP's choices: per group, the MBPP verdict's two methods' ratio by hand."""
    import eval.bar as bar

    rep, _, _, _ = folders
    carry = tmp_path / "specbench"
    carry.mkdir()
    rows = read_jsonl(rep / "prompts.jsonl")
    src = jsonl_path(rep / "prompts.jsonl")
    (carry / src.name).write_bytes(src.read_bytes())
    (carry / "replay.json").write_text(json.dumps({"eval": json.loads((rep / "replay.json").read_text())["eval"],
                                                   "settings": {"tune": "mbpp-val", "eval": "traces/sb"}}))
    monkeypatch.setattr(bar, "prompt_groups", lambda folder: {f"p{i}": "qa" if i < 10 else "math" for i in range(40)})
    cfg = OmegaConf.create({"bar": {"replay": str(rep), "carry_over": [str(carry)], "out": str(tmp_path / "b.json"),
                                    "n_resamples": 100}})
    groups = bar.run(cfg)["carry_over"]["specbench"]["groups"]
    assert {g: v["prompts"] for g, v in groups.items()} == {"all": 40, "math": 30, "qa": 10}

    def speed(m, ids):
        mine = [r for r in rows if r["method"] == m and int(r["prompt_id"][1:]) in ids]
        return sum(r["target_cost_ms"] for r in mine) / sum(r["cost_ms"] for r in mine)

    qa = range(10)
    assert groups["qa"]["ratio"] == pytest.approx(speed("learned", qa) / speed("svip", qa))
    assert groups["all"]["speedup"]["oracle"] == pytest.approx(speed("oracle", range(40)))


def test_qwen_bar_gathers_a_scale_by_hand(folders, tmp_path):
    """eval.qwen_bar: the best wall method's speedup and interval from the per-prompt rows, the heads' and trees'
    replay ratios from their files, nulls and a `missing` line for runs not made, and the large scale's fields on top."""
    from eval.qwen_bar import gather

    _, wall, _, wrows = folders
    summary = json.loads((wall / "summary.json").read_text())
    summary["learned"].update({"measured_c": 0.04, "mean_accepted_length": 3.1,
                               "draft_weights": {"path": "w.safetensors", "fingerprint": "0123abcd"}})
    (wall / "summary.json").write_text(json.dumps(summary))
    heads, trees = tmp_path / "heads.json", tmp_path / "trees.json"
    heads.write_text(json.dumps({"replay": {"ratio": 1.01, "ratio_ci": [1.0, 1.02], "prompts": 300}}))
    trees.write_text(json.dumps({"best_tree_vs_chain": {"value": 1.2, "ci": [1.1, 1.3]}, "best_tree": "eagle2"}))
    runs = {"pair": "big", "mbpp": str(wall), "humaneval": str(tmp_path / "none"), "heads": str(heads),
            "trees": str(trees)}
    cfg = OmegaConf.create({"large": runs, "small": {**runs, "pair": "small", "heads": None}, "n_resamples": 300})
    res = gather(cfg)
    tps = {m: sum(x["new_tokens"] for x in wrows if x["method"] == m) / sum(x["wall_s"] for x in wrows if x["method"] == m)
           for m in ("learned", "target")}
    big = res["scales"]["large"]["mbpp"]
    assert big["method"] == "learned" and res["mbpp_best"] == 1.36 and big["prompts"] == 40
    assert big["draft"] == "0123abcd"  # which weights decoded it, by content
    lo, hi = big["speedup_ci"]
    assert lo < tps["learned"] / tps["target"] < hi and lo > 1.3  # 2.2 s against 3.0 s on every prompt
    assert (res["c"], res["tau_best"], res["replay_prompts"], res["learned_vs_ev_replay"]) == (0.04, 3.1, 300, 1.01)
    assert res["tree_vs_chain_replay"] == 1.2 and res["humaneval_best"] is None
    assert res["scales"]["small"]["learned_vs_ev_replay"] is None
    assert any(m.startswith("large humaneval") for m in res["missing"])
    assert any(m.startswith("small heads") for m in res["missing"])
