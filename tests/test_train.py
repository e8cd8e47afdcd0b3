"""train: data module, module, `python -m train` on tiny traces (fast_dev_run per head, a short multirun),
checkpoint → load_head round trip, and the one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from models.heads import load_head
from train.job import run
from train.module import StopHeadModule
from utils.cli import CONF_DIR, UserError

RESULT_KEYS = {"test/auroc", "test/ap", "test/f1", "test/f1_static_best", "threshold", "ckpt_path"}


def fake_traces(split: str, n_prompts: int = 10, rows: int = 40, d: int = 16, seed: int = 0, pair_id="tiny_random",
                hidden=True, prefix="p"):
    """Trace rows (the data_gen contract's columns) whose acceptance is learnable from top-1 prob and hidden[0]."""
    rng = np.random.default_rng(seed)
    n = n_prompts * rows
    logits = rng.normal(size=(n, 30)) * rng.uniform(0.3, 5, size=(n, 1))
    q = np.exp(logits - logits.max(1, keepdims=True))
    q /= q.sum(1, keepdims=True)
    topk = -np.sort(-q, 1)[:, :10]
    h = rng.normal(size=(n, d))
    score = 6 * (topk[:, 0] - 0.4) + 2 * h[:, 0]
    acc = rng.random(n) < 1 / (1 + np.exp(-score))
    draft = rng.integers(0, 50, n)
    cols = {
        "prompt_id": np.repeat([f"{prefix}{split}-{i}" for i in range(n_prompts)], rows).tolist(),
        "split": [split] * n,
        "kind": ["target_ar"] * n,
        "position": np.tile(np.arange(rows), n_prompts).astype(np.int32),
        "draft_token": draft.astype(np.int32),
        "target_token": np.where(acc, draft, draft + 1).astype(np.int32),
        "q_draft": topk[:, 0].astype(np.float32),
        "p_draft": np.clip(topk[:, 0] * np.where(acc, 1.5, 0.2), 0, 1).astype(np.float32),
        "tvd": np.where(acc, 0.2, 0.7).astype(np.float32),
        "draft_entropy": (-(q * np.log(q + 1e-30)).sum(1)).astype(np.float32),
        "target_entropy": np.ones(n, np.float32),
        "draft_topk": topk.astype(np.float32).tolist(),
    }
    if hidden:
        cols["draft_hidden"] = h.astype(np.float16).tolist()
    manifest = {"pair_id": pair_id, "tokenizer_hash": "tok", "rows": n, "topk": 10, "hidden_size": d if hidden else 0}
    return datasets.Dataset.from_dict(cols), manifest


def splits(**kw):
    traces, manifests = {}, {}
    for i, s in enumerate(("train", "validation", "test")):
        traces[s], manifests[s] = fake_traces(s, seed=i, **kw)
    return traces, manifests


def cfg_for(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["pair=tiny_random", "logger=none", *overrides])
    with open_dict(cfg):
        cfg.trainer.enable_progress_bar = False
    return cfg


@pytest.mark.parametrize(
    "model,labels",
    [("disco", "greedy_match"), ("sprinter", "ratio"), ("specdecpp", "accept_prob")],
)
def test_fast_dev_run_each_head_round_trips(tmp_path, model, labels):
    cfg = cfg_for(f"model={model}", f"labels={labels}", "trainer=fast_dev_run")
    traces, manifests = splits()
    res = run(cfg, tmp_path, traces, manifests)
    assert RESULT_KEYS <= set(res)
    assert json.loads((tmp_path / "results.json").read_text())["ckpt_path"] == res["ckpt_path"]
    bundle = load_head(res["ckpt_path"])
    assert bundle.kind == model and bundle.pair_id == "tiny_random" and bundle.labels["name"] == labels
    # the reloaded head gives exactly the trained module's outputs, from raw features, then the calibration
    # fitted on validation (stored in the checkpoint)
    module = StopHeadModule.load_from_checkpoint(res["ckpt_path"]).eval()
    x = torch.randn(9, bundle.spec.dim) * 3
    cal = bundle.calibration
    assert cal["mode"] == "platt" and cal["temperature"] > 0 and res["calibration"] == cal
    with torch.no_grad():
        torch.testing.assert_close(bundle.logit(x), module(x), rtol=0, atol=0)
        torch.testing.assert_close(bundle.prob(x), torch.sigmoid(module(x) / cal["temperature"] + cal["bias"]))
    assert module.threshold == bundle.threshold == res["threshold"]
    assert not torch.allclose(bundle.head.std, torch.ones_like(bundle.head.std))  # normalisation fitted and saved


# every key results.json has had: train reports through eval's functions (eval.metrics, eval.plots) since issue 28
RESULTS_JSON_KEYS = {
    "test/auroc", "test/ap", "test/f1", "test/precision", "test/recall", "test/f1_static_best", "test/k_static_best",
    "test/positive_rate", "test/rows", "val/auroc", "threshold", "threshold_mode", "calibration", "test/ece",
    "ckpt_path", "kind", "labels", "pair_id", "draft_files", "dataset", "speed_rule", "train_rows", "epochs",
    "test/auroc_max_q", "test/auroc_neg_entropy", "roc_png", "pr_png",
}


def test_results_json_keeps_its_keys_and_eval_gives_the_same_numbers(tmp_path):
    """results.json's ECE and training-free AUROCs are what `python -m eval` computes (eval.classifier) for the same
    head on the test traces' own columns."""
    from data_gen.contract import trace_columns
    from eval.classifier import baseline_auroc, calibration
    from models.features.spec import features_from_columns

    cfg = cfg_for("model=disco", "trainer=fast_dev_run")
    traces, manifests = splits()
    run(cfg, tmp_path, traces, manifests)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved) == RESULTS_JSON_KEYS
    assert Path(saved["roc_png"]).is_file() and Path(saved["pr_png"]).is_file()
    cols = trace_columns(traces["test"], traces["test"].column_names)
    y = (cols["draft_token"] == cols["target_token"]).astype(np.float32)  # greedy_match
    assert saved["test/auroc_max_q"] == baseline_auroc(cols, y)["max_q"]
    assert saved["test/auroc_neg_entropy"] == baseline_auroc(cols, y)["neg_entropy"]
    bundle = load_head(saved["ckpt_path"])
    scores = bundle.prob(features_from_columns(cols, bundle.spec)).numpy()
    assert saved["test/ece"] == pytest.approx(calibration(scores, y)["ece"], abs=1e-6)


def test_training_learns_and_beats_static(tmp_path):
    cfg = cfg_for("model=disco", "trainer.max_epochs=15", "data.batch_size=64")
    res = run(cfg, tmp_path, *splits())
    assert res["test/auroc"] > 0.75
    assert res["test/f1"] > res["test/f1_static_best"]
    assert (Path(res["ckpt_path"]).parent / "roc.png").is_file() and (tmp_path / "csv" / "metrics.csv").is_file()


def test_sampler_and_fixed_threshold(tmp_path):
    cfg = cfg_for("data.imbalance=sampler", "threshold_mode=fixed", "threshold=0.7", "trainer=fast_dev_run")
    res = run(cfg, tmp_path, *splits())
    assert res["threshold"] == 0.7 and load_head(res["ckpt_path"]).threshold == 0.7


def test_reject_weight_sets_the_loss_weight(tmp_path):
    """data.reject_weight=r weighs rejected rows r times accepted ones (BCE pos_weight 1/r), stored in the head's
    hyperparameters; with the class-balanced sampler it is refused before any training."""
    res = run(cfg_for("data.reject_weight=6", "trainer=fast_dev_run"), tmp_path / "a", *splits())
    hp = torch.load(res["ckpt_path"], map_location="cpu", weights_only=False)["hyper_parameters"]
    assert hp["pos_weight"] == pytest.approx(1 / 6)
    with pytest.raises(UserError, match="reject_weight"):
        run(cfg_for("data.reject_weight=6", "data.imbalance=sampler", "trainer=fast_dev_run"), tmp_path / "b", *splits())


def test_rerun_into_the_same_run_dir_replaces_best_ckpt(tmp_path):
    """README's main job writes runs/disco/checkpoints/best.ckpt; a second run there replaces it (Lightning would
    otherwise write best-v1.ckpt and leave best.ckpt, the path every later command names, on the old head)."""
    paths = []
    for threshold in (0.3, 0.7):
        cfg = cfg_for("threshold_mode=fixed", f"threshold={threshold}", "trainer.max_epochs=1")
        paths.append(run(cfg, tmp_path, *splits())["ckpt_path"])
    assert paths[0] == paths[1] and Path(paths[1]).name == "best.ckpt"
    assert sorted(p.name for p in Path(paths[1]).parent.glob("*.ckpt")) == ["best.ckpt"]
    assert load_head(paths[1]).threshold == 0.7


def test_traces_from_another_pair_refused(tmp_path):
    traces, manifests = splits(pair_id="smollm2_135m")
    with pytest.raises(UserError, match="made with pair smollm2_135m but .*pair=tiny_random"):
        run(cfg_for("trainer=fast_dev_run"), tmp_path, traces, manifests)


def test_label_scheme_needs_missing_column(tmp_path):
    traces, manifests = splits()
    traces = {s: ds.remove_columns(["q_draft"]) for s, ds in traces.items()}
    with pytest.raises(UserError, match="label scheme 'ratio' needs trace column"):
        run(cfg_for("labels=ratio", "trainer=fast_dev_run"), tmp_path, traces, manifests)


def test_hidden_head_without_hidden_states(tmp_path):
    traces, manifests = splits(hidden=False)
    with pytest.raises(UserError, match="store_hidden=true"):
        run(cfg_for("model=sprinter", "trainer=fast_dev_run"), tmp_path, traces, manifests)


def test_empty_split_refused(tmp_path):
    traces, manifests = splits()
    traces["validation"] = traces["validation"].select([])
    with pytest.raises(UserError, match="validation split has no trace rows"):
        run(cfg_for("trainer=fast_dev_run"), tmp_path, traces, manifests)


def test_prompt_in_two_splits_refused(tmp_path):
    traces, manifests = splits()
    traces["test"] = fake_traces("train", seed=5)[0]  # prompt ids of the train split
    with pytest.raises(UserError, match="appear in both the train and test traces"):
        run(cfg_for("trainer=fast_dev_run"), tmp_path, traces, manifests)


# ------------------------------------------------------------------------------------- CLI on the tiny pair


@pytest.fixture(scope="module")
def smoke_traces(tmp_path_factory, tiny_pair):
    """The smoke experiment's traces, generated once in-process (the CLI runs below then reuse them)."""
    from data_gen.run import generate
    from data_gen.contract import split_cfg

    root = tmp_path_factory.mktemp("traces")
    cfg = cfg_for("+experiment=smoke", f"trace_root={root}")
    with open_dict(cfg):
        cfg.progress = False
    for split in ("train", "validation", "test"):
        generate(split_cfg(cfg, split), split, tiny_pair)
    return root


@pytest.mark.slow
def test_cli_smoke_run(cli, smoke_traces, tmp_path):
    run_dir = tmp_path / "run"
    res = cli("train", "+experiment=smoke", f"trace_root={smoke_traces}", f"hydra.run.dir={run_dir}", "logger=none")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == str(run_dir)
    results = json.loads((run_dir / "results.json").read_text())
    assert RESULT_KEYS <= set(results) and Path(results["ckpt_path"]).is_file()
    assert "F1 best static length" in res.stdout


@pytest.mark.slow
def test_cli_multirun_two_jobs_and_summary(cli, smoke_traces, tmp_path):
    sweep = tmp_path / "sweep"
    res = cli("train", "-m", "+experiment=smoke", f"trace_root={smoke_traces}", f"hydra.sweep.dir={sweep}",
              "labels=ratio", "labels.tau=1,1.5", "trainer.max_epochs=1")
    assert res.returncode == 0, res.stderr[-3000:]
    results = sorted(sweep.glob("*/results.json"))
    assert len(results) == 2
    taus = sorted(json.loads(p.read_text())["labels"]["tau"] for p in results)
    assert taus == [1.0, 1.5]
    # each job is its own W&B run (offline, under its job folder), grouped by the sweep
    assert all(list((p.parent / "wandb").glob("offline-run-*")) for p in results)
    assert "sweep summary" in res.stdout and "labels.tau=1.5" in res.stdout  # the Hydra callback's table
    summ = cli("train.summarize", str(sweep))
    assert summ.returncode == 0 and "labels.tau=1.5" in summ.stdout and (sweep / "summary.md").is_file()


def test_cli_unknown_experiment_one_line(cli):
    res = cli("train", "+experiment=no_such_experiment")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0
    assert "unknown experiment 'no_such_experiment'" in res.stderr and "disco_mbpp" in res.stderr


def test_sprinter_on_tiny_interleaved_traces(tmp_path, tiny_pair):
    """Real data_gen traces (interleaved, hidden states stored) → SPRINTER head; the spec's d is the draft's hidden size."""
    from data_gen.run import generate
    from data_gen.contract import split_cfg
    from train.inputs import load_traces

    cfg = cfg_for("+experiment=smoke", "trace=interleaved", "model=sprinter", "labels=ratio", "labels.tau=1.5",
                  "trainer=fast_dev_run", "logger=none", f"trace_root={tmp_path / 'traces'}", "trace.max_new_tokens=12",
                  "split_limits.train=4", "split_limits.validation=2", "split_limits.test=2")
    with open_dict(cfg):
        cfg.progress = False
    for split in ("train", "validation", "test"):
        generate(split_cfg(cfg, split), split, tiny_pair)
    traces, manifests = load_traces(cfg)  # complete folders are reused without loading the pair
    res = run(cfg, tmp_path / "run", traces, manifests)
    bundle = load_head(res["ckpt_path"])
    assert bundle.spec.kind == "hidden" and bundle.spec.d == tiny_pair.draft.config.hidden_size
    assert bundle.tokenizer_hash == tiny_pair.tokenizer_hash
    bundle.check_pair(tiny_pair)


def test_trace_dirs_from_another_pair_refused_before_generation(smoke_traces):
    """`trace_dirs.train=DIR` holding another pair's traces: one UserError before anything is generated."""
    from train.inputs import load_traces

    folder = next(smoke_traces.glob("tiny_random--*--train-*"))
    cfg = cfg_for("pair=smollm2_135m", f"trace_dirs.train={folder}", f"trace_root={smoke_traces}")
    with pytest.raises(UserError, match="made with pair tiny_random but this run's config says pair=smollm2_135m"):
        load_traces(cfg)


def test_extra_train_appends_another_datasets_train_rows(smoke_traces, tiny_pair, monkeypatch):
    """`extra_train.<name>` (a composed dataset config): its train-split traces, generated when missing, are appended
    to the train rows only; validation and test stay the main dataset's, and the train manifest names the folders."""
    import models.pair
    from train.inputs import load_traces

    monkeypatch.setattr(models.pair, "load_pair", lambda cfg: tiny_pair)  # the stdlib traces are made with the tiny pair
    base = cfg_for("+experiment=smoke", f"trace_root={smoke_traces}")
    cfg = cfg_for("+experiment=smoke", f"trace_root={smoke_traces}", "+dataset@extra_train.python_stdlib=python_stdlib",
                  "+extra_train.python_stdlib.limit=3")
    with open_dict(cfg):
        cfg.progress = False
    plain, _ = load_traces(base)
    traces, manifests = load_traces(cfg)
    ids = set(traces["train"]["prompt_id"])
    assert len({i for i in ids if i.startswith("stdlib-")}) == 3 and set(plain["train"]["prompt_id"]) < ids
    assert traces["train"].num_rows > plain["train"].num_rows
    for split in ("validation", "test"):
        assert traces[split]["prompt_id"] == plain[split]["prompt_id"]
    (folder,) = manifests["train"]["extra_train"]
    assert "python_stdlib" in folder and folder.endswith("--train-lim3")


def test_extra_train_entry_that_is_not_a_dataset_refused(smoke_traces):
    from train.inputs import load_traces

    cfg = cfg_for("+experiment=smoke", f"trace_root={smoke_traces}", "+extra_train.mine.limit=3")
    with pytest.raises(UserError, match="extra_train.mine is not a dataset config"):
        load_traces(cfg)


def test_callbacks_and_data_module_come_from_config(tmp_path):
    """conf/callbacks and conf/data are built by instantiate; the users' top-level overrides still reach them."""
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from models.features.spec import FeatureSpec
    from train.job import make_callbacks

    cfg = cfg_for("early_stopping.patience=2", "early_stopping.min_delta=0.01", "monitor=val/ap", "data.batch_size=16")
    callbacks, checkpoint = make_callbacks(cfg, tmp_path / "checkpoints")
    stopper = next(c for c in callbacks if isinstance(c, EarlyStopping))
    assert (stopper.patience, stopper.min_delta, stopper.monitor) == (2, 0.01, "val/ap")
    assert isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath == str(tmp_path / "checkpoints")
    assert checkpoint.monitor == "val/ap" and checkpoint.filename == "best"
    traces, _ = splits()
    dm = instantiate(cfg.data, _partial_=True)(traces=traces, labels_cfg=cfg.labels, spec=FeatureSpec("disco"), seed=0)
    assert dm.batch_size == 16 and dm.imbalance == "pos_weight"
    with open_dict(cfg):
        cfg.callbacks.model_checkpoint = None
    with pytest.raises(UserError, match="one ModelCheckpoint"):
        make_callbacks(cfg, tmp_path)
