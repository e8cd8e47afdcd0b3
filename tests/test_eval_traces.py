"""eval.traces on a small fabricated trace table whose statistics are known by construction."""

from __future__ import annotations

import json

import numpy as np
import pytest
from datasets import Dataset

from eval.traces import oracle_rounds, trace_statistics, write_plots


def fake_traces(with_xent: bool) -> Dataset:
    """Two continuations; acceptance pattern per continuation fixed so the oracle rounds are known by hand.

    prompt a (kind target_ar): match pattern 1 1 0 1 0 1 1  → rounds [2, 1, 2(censored)]
    prompt b:                  match pattern 0 1 1 1        → rounds [0, 3(censored)]
    Entropy is low on matches and high on mismatches, so correlation with acceptance must come out negative.
    """
    match = np.array([1, 1, 0, 1, 0, 1, 1, 0, 1, 1, 1], dtype=bool)
    n = len(match)
    pid = ["a"] * 7 + ["b"] * 4
    position = np.r_[np.arange(7), np.arange(4)].astype(np.int32)
    target = np.arange(n, dtype=np.int32) % 5
    draft = np.where(match, target, (target + 1) % 5).astype(np.int32)
    h = np.where(match, 0.2, 2.0) + np.linspace(0, 0.1, n)
    tvd = np.where(match, 0.1, 0.4)  # consistent with Pinsker for KL = 0.2 H_q below
    q = np.where(match, 0.6, 0.5)
    p = np.where(match, 0.7, 0.1)
    cols = {
        "prompt_id": pid, "split": ["test"] * n, "kind": ["target_ar"] * n, "position": position,
        "draft_token": draft, "target_token": target, "q_draft": q.astype(np.float32), "p_draft": p.astype(np.float32),
        "tvd": tvd.astype(np.float32), "draft_entropy": h.astype(np.float32), "target_entropy": h.astype(np.float32),
        "draft_topk": np.tile(np.linspace(0.5, 0.0, 10, dtype=np.float32), (n, 1)).tolist(),
    }
    if with_xent:
        cols["cross_entropy"] = (1.2 * h).astype(np.float32)  # ratio exactly 1.2, KL = 0.2 H_q
    return Dataset.from_dict(cols)


def test_oracle_rounds_by_hand():
    acc = np.array([1, 1, 0, 1, 0, 1, 1, 0, 1, 1, 1], dtype=bool)
    starts = np.zeros(11, dtype=bool)
    starts[[0, 7]] = True
    r = oracle_rounds(acc, starts)
    assert r["length"].tolist() == [2, 1, 2, 0, 3]
    assert r["complete"].tolist() == [True, True, False, True, False]


def test_trace_statistics_known_answers(tmp_path):
    res = trace_statistics(fake_traces(with_xent=True), bins=4)
    s = res["stats"]
    assert s["rows"] == 11 and s["missing_columns"] == []
    o = s["oracle_sl"]
    assert o["rounds"] == 5 and o["censored_rounds"] == 2
    assert o["mean"] == pytest.approx(8 / 5)
    assert o["std"] == pytest.approx(np.std([2, 1, 2, 0, 3]))
    assert o["mean_complete_only"] == pytest.approx(1.0)
    assert o["histogram"] == {0: 1, 1: 1, 2: 2, 3: 1}
    for name in ("min(1,p/q)", "1-TVD", "greedy match"):
        assert s["entropy_vs_acceptance"][name]["spearman"] < -0.5
    assert s["xent_ratio"]["quantiles"]["0.5"] == pytest.approx(1.2, rel=1e-4)
    b = s["acceptance_bounds"]
    # c fitted = (1.2 - 1)/2 = 0.1; Pinsker 1 - sqrt(0.1 H) never exceeds actual 1 - TVD here, by construction
    assert b["c_fitted"] == pytest.approx(0.1, rel=1e-3)
    assert b["pinsker_violations"] == 0.0
    written = write_plots(res, tmp_path)
    names = {p.name for p in written}
    assert {"entropy_vs_acceptance.png", "oracle_sl_hist.png", "xent_ratio_hist.png", "acceptance_bounds.png"} <= names
    assert all(p.stat().st_size > 1000 for p in written)


def test_missing_cross_entropy_is_named():
    s = trace_statistics(fake_traces(with_xent=False))["stats"]
    assert s["missing_columns"] == ["cross_entropy"]
    assert "pinsker_mean" not in s["acceptance_bounds"]
    assert s["acceptance_bounds"]["entropy_estimate_mean"] == pytest.approx(
        float(np.mean(1 - np.sqrt(0.15 * np.asarray(fake_traces(False)["draft_entropy"])))), rel=1e-5)
    json.dumps(s)  # the report is JSON-serialisable


def test_run_on_generated_tiny_traces(tmp_path, tiny_pair):
    from hydra import compose, initialize_config_dir

    from data_gen.run import generate
    from eval.traces import run
    from tests.conftest import REPO
    from utils.cli import UserError

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        gen_cfg = compose("data_gen", ["pair=tiny_random", "dataset=mbpp", f"trace_root={tmp_path / 't'}", "limit=4",
                                       "progress=false", "trace.max_new_tokens=12"])
        folder = generate(gen_cfg, "test", tiny_pair)
        cfg = compose("eval_traces", [f"traces={folder}", f"out_dir={tmp_path / 'out'}"])
        missing = compose("eval_traces", [f"traces={tmp_path / 'nope'}", f"out_dir={tmp_path / 'out2'}"])
    stats = run(cfg)
    saved = json.loads((tmp_path / "out" / "trace_stats.json").read_text())
    assert saved["rows"] == stats["rows"] > 0 and saved["pair_id"] == "tiny_random"
    o = saved["oracle_sl"]
    # every row belongs to exactly one oracle round: accepted rows + one closing mismatch per complete round
    assert sum(int(k) * v for k, v in o["histogram"].items()) + o["rounds"] - o["censored_rounds"] == saved["rows"]
    sp = saved["speedup_prediction"]
    assert sp["alpha_from"] == "greedy match" and sp["best_gamma"] >= 1 and len(sp["per_gamma"]) == 10
    assert (tmp_path / "out" / "speedup_prediction.png").is_file()
    with pytest.raises(UserError, match="does not exist"):
        run(missing)
    assert not (tmp_path / "out2").exists()
