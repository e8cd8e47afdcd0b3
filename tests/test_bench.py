"""bench/: every script is a Hydra entry on its own conf/bench/<script>.yaml (the stages' CLI convention), imports
the packages normally, and writes under results/ through an `out_dir` key."""

from __future__ import annotations

import importlib

import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import REPO
from utils.cli import CONF_DIR, known_names

SCRIPTS = sorted(p.stem for p in (REPO / "bench").glob("*.py") if p.stem != "__init__")
# the stop-head probes write beside the study they extend; the measurements moved from bench/results/ write one tree
STOP_HEADS = {"cost_sweep", "extra_features", "feature_ablation", "label_variants"}
RESULTS_BENCH = {"cpu_dtype", "decode_vs_transformers", "distill_metrics", "head_features", "head_gemm",
                 "lean_forward", "small_ops", "stop_rule_probe", "trace_throughput"}


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
