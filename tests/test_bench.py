"""bench/: every script is a Hydra entry on its own conf/bench/<script>.yaml (the stages' CLI convention), imports
the packages normally, and writes under results/ through an `out_dir` key."""

from __future__ import annotations

import importlib
import json
from collections import Counter

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import REPO
from utils.cli import CONF_DIR, known_names

SCRIPTS = sorted(p.stem for p in (REPO / "bench").glob("*.py") if p.stem != "__init__")
# the stop-head probes write beside the study they extend; the measurements moved from bench/results/ write one tree
STOP_HEADS = {"cost_sweep", "extra_features", "feature_ablation", "label_variants"}
RESULTS_BENCH = {"cpu_dtype", "decode_vs_transformers", "distill_metrics", "head_gemm", "int8_rows",
                 "lean_forward", "small_ops", "trace_throughput", "tree_sampling"}


def compose_bench(script: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(f"bench/{script}", overrides=list(overrides), return_hydra_config=True)


def test_every_script_has_a_config_and_every_config_a_script():
    assert SCRIPTS and SCRIPTS == known_names("bench")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_config_composes(script):
    cfg = compose_bench(script)
    assert cfg.task_name == f"bench/{script}"
    assert cfg.hydra.run.dir.startswith(f"{cfg.log_dir}/bench/{script}/")
    want = "results/stop_heads" if script in STOP_HEADS else "results/bench" if script in RESULTS_BENCH else "results/"
    assert str(cfg.out_dir).startswith(want)
    if "pair" in cfg:  # a pair is a conf/pair group, as in the stages
        assert cfg.pair.name in known_names("pair")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_is_a_hydra_entry_importing_the_packages_normally(script):
    text = (REPO / "bench" / f"{script}.py").read_text()
    assert f'hydra_entry("bench/{script}")(run)()' in text
    assert "sys.path" not in text and "argparse" not in text and "bench/results" not in text
    assert callable(importlib.import_module(f"bench.{script}").run)


def test_a_user_mistake_is_one_line(cli, tmp_path):
    r = cli("bench.cost_sweep", "cost_profile=no/such/profile.json", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: no cost profile at no/such/profile.json; make one with python -m decode.profile "
        "out=no/such/profile.json"]


def test_tree_sampling_gof_tells_the_targets_law_from_a_biased_one():
    """bench.tree_sampling's χ²: samples of the law pass, samples of a law off by 0.05 fail, rare outcomes pool."""
    from bench.tree_sampling import gof

    rng, n = np.random.default_rng(0), 6000
    law = {0: 0.5, 1: 0.3, 2: 0.1996, 3: 0.0004}  # outcome 3 expects 2.4 < 5: pooled with the never-drawn rest
    fair = Counter(rng.choice(4, n, p=list(law.values())).tolist())
    biased = Counter(rng.choice(4, n, p=[0.45, 0.35, 0.1996, 0.0004]).tolist())
    assert gof(fair, law, n)["p_value"] > 1e-3 and gof(biased, law, n)["p_value"] < 1e-4
    assert gof(fair, law, n)["cells"] == 4  # three cells + the pooled rest
    assert gof(Counter({7: n}), {}, n)["p_value"] is None  # nothing expected above the floor: no test


@pytest.mark.real
def test_tree_sampling_on_the_real_pair_is_the_targets_law(cli, tmp_path):
    """Exact sampling with a token tree on the packaged pair: the first two tokens' law is the target's (issue 30)."""
    r = cli("bench.tree_sampling", "prompts=1", "samples=250", "builders=[eagle2]", f"out_dir={tmp_path}",
            f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((tmp_path / "tree_sampling.json").read_text())
    row = out["rows"][0]
    assert out["pass"] and row["x1_x2"]["p_value"] is not None and row["x1_x2"]["dof"] >= 1
    assert row["verified_nodes_first_round"] > 1  # a tree was verified, not a single token
