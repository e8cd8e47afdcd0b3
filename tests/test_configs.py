"""conf/: every train experiment composes (with `+experiment=`, as users type it) into a consistent run config."""

from __future__ import annotations

import importlib.util

import pytest
from hydra import compose, initialize_config_dir

from data_gen.labels import is_node, required_columns
from models.features.spec import feature_kind
from models.heads import head_family
from utils.cli import CONF_DIR, known_names

EXPECTED = {"disco_mbpp", "disco_specbench", "sprinter_wikitext2", "sprinter_mbpp", "specdecpp_mbpp", "smoke", "c2t_mbpp",
            "tree_mbpp"}


def compose_train(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=True)


def test_experiment_not_in_defaults():
    text = (CONF_DIR / "train.yaml").read_text()
    assert "experiment:" not in text.split("_self_")[0]  # users add it with +experiment=
    assert EXPECTED <= set(known_names("experiment"))


TRAIN_EXPERIMENTS = known_names("experiment")  # conf/experiment/*.yaml train heads
STUDIES = [f"study/{n}" for n in known_names("experiment/study")]  # conf/experiment/study/*.yaml decode


@pytest.mark.parametrize("name", STUDIES)
def test_every_study_composes_for_decode(name):
    """Decode studies compose against conf/decode.yaml, name their policies and an out_dir under results/."""
    from hydra import compose, initialize_config_dir

    from decode.policies import parse_spec
    from utils.cli import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("decode", overrides=[f"+experiment={name}"])
    assert cfg.mode in ("run", "tune", "sweep") and cfg.policies
    for spec in cfg.policies:
        parse_spec(str(spec))
    assert str(cfg.out_dir).startswith("results/")


def test_experiment_for_the_other_stage_is_one_line(cli):
    r = cli("train", f"+experiment={STUDIES[0]}")
    assert r.returncode == 2 and r.stderr.strip() == f"error: experiment '{STUDIES[0]}' is a decoding study: " \
        f"python -m decode +experiment={STUDIES[0]}"
    r = cli("decode", "+experiment=disco_mbpp")
    assert r.returncode == 2 and "trains a head: python -m train +experiment=disco_mbpp" in r.stderr
    assert "decode studies: study/disco_humaneval, study/disco_mbpp," in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", TRAIN_EXPERIMENTS)
def test_every_experiment_composes(name):
    cfg = compose_train(f"+experiment={name}")
    assert cfg.experiment_name == name
    required_columns(cfg.labels)
    feat = head_family(cfg.model.kind).features
    if feat == "hidden":  # hidden-state heads need traces that store the draft hidden state
        assert cfg.trace.store_hidden, name
    assert cfg.trace.kind in ("target_ar", "interleaved", "tree", "eagle_chain", "eagle_tree")
    # token-tree node heads train on tree traces with the tree label, chain heads on chain traces (issue 30)
    from data_gen.kinds import trace_kind

    tree = feature_kind(feat).tree
    assert trace_kind(cfg.trace).tree == tree and is_node(cfg.labels) == tree, name
    assert cfg.trace_root and cfg.monitor == "val/auroc"
    limits = [cfg.split_limits[s] for s in ("train", "validation", "test")]
    assert all(v is None or v > 0 for v in limits)
    # output folders follow one scheme for runs and multiruns
    assert cfg.hydra.run.dir.startswith(cfg.log_dir) and cfg.hydra.sweep.dir.startswith(cfg.log_dir)


def test_paper_settings():
    assert compose_train("+experiment=sprinter_wikitext2").labels.tau == 1.2
    assert compose_train("+experiment=sprinter_wikitext2").trace.kind == "interleaved"
    spp = compose_train("+experiment=specdecpp_mbpp")
    assert (spp.trace.kind, spp.labels.name, spp.model.kind) == ("target_ar", "accept_prob", "specdecpp")
    assert compose_train("+experiment=smoke").pair.name == "tiny_random"
    assert compose_train("+experiment=disco_mbpp").model.k == 10


def test_logger_none_and_trainer_groups():
    assert compose_train("logger=none").logger.wandb is None
    assert compose_train().logger.wandb.mode == "offline"
    assert compose_train("trainer=fast_dev_run").trainer.fast_dev_run is True


def _has_optuna_sweeper() -> bool:
    try:
        return importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _has_optuna_sweeper(), reason="optional extra `optuna` not installed")
def test_optuna_search_composes():
    cfg = compose_train("+experiment=disco_mbpp", "hparams_search=disco_optuna")
    assert cfg.optimized_metric == "val/auroc" and cfg.hydra.sweeper.direction == "maximize"


def test_specbench_study_tunes_on_one_prompt_per_task():
    from hydra import compose as hcompose
    from omegaconf import OmegaConf

    from data_gen.prompts import load_prompts

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hcompose("decode", overrides=["+experiment=study/specbench"])
    tune_set = load_prompts(OmegaConf.merge(cfg.dataset, cfg.tune.dataset), "validation", cfg.tune.limit)
    assert sorted(p.meta["task"] for p in tune_set) == sorted(
        ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"])


@pytest.mark.parametrize("launcher, target", [("slurm", "SlurmLauncher"), ("submitit_local", "LocalLauncher")])
def test_data_gen_launchers_compose(launcher, target):
    """The data_gen fan-out launchers resolve to hydra-submitit-launcher's classes (in the dev and slurm extras)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[dev]'")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("data_gen", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith(target)
    assert str(cfg.hydra.launcher.submitit_folder).endswith(".submitit/%j")


def test_decode_logger_defaults_off_and_sweeps_get_a_wandb_callback():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("decode", return_hydra_config=True)
        on = compose("replay", overrides=["logger=wandb"])
    assert cfg.logger.wandb is None and on.logger.wandb.mode == "offline"
    assert cfg.hydra.callbacks.wandb_sweep._target_ == "decode.wandb_log.SweepCallback"
