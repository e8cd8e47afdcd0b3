"""The training job behind `python -m train` (train/__main__.py composes the config and calls `run`).

One job top to bottom: load or generate the traces for train/validation/test (data_gen; the pair is loaded once and
only if something must be generated), build features and labels (TraceDataModule), fit the head with early
stopping on `val/auroc`, keep the best checkpoint (it carries the threshold chosen on validation and everything
decode needs), calibrate it and store its speed rule, reload it with `models.heads.load_head`, test it, and write:

- `results.json` (test/auroc, test/ap, test/f1, test/f1_static_best, threshold, ckpt_path, ...),
- `checkpoints/best.ckpt` with `roc.png` and `pr.png` beside it (and to W&B as plots when W&B is on),
- `csv/` (always) and `wandb/` (offline by default; `wandb sync <run dir>/wandb/offline-run-*` uploads later).

Its numbers and plots come from eval's one definition of each (eval.metrics: metrics, ECE, the training-free
baselines; eval.plots: the curves), so results.json and `python -m eval` agree on the same rows. Which baselines, and
whether the chain-only steps run (the speed rule, the static-length F1), is the feature kind's business: token-tree
node heads (`model=c2t | tree_node` on `trace=tree`, `labels=on_path | on_path_given_parent`; `FeatureKind.tree`) are
compared with the joint probability and q_token and skip both; their report adds both node views
(eval.classifier.node_views: `test/auroc_path*` over every node, `test/auroc_cond*` on the nodes whose parent is on
the path), so an unconditional and a conditional head are read on the same two tasks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from utils import wandb_run
from data_gen.contract import HEAD_SPLITS as SPLITS
from data_gen.contract import split_cfg
from utils.cli import UserError

log = logging.getLogger("train")


def quiet_lightning() -> None:
    """Keep stdout readable: Lightning's banner/tips off, known-harmless warnings filtered (errors still show)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for pattern in (".*LeafSpec.*", ".*smaller than the logging interval.*", ".*does not have many workers.*",
                    ".*anonymous setting.*"):
        warnings.filterwarnings("ignore", message=pattern)


# --------------------------------------------------------------------------------------------------------- traces


def load_traces(cfg: DictConfig) -> tuple[dict, dict]:
    """({split: Dataset}, {split: manifest}) for train/validation/test, generating what is missing with data_gen.

    A complete folder made with the same settings is reused without loading the models; otherwise the pair is
    loaded once (for all splits) and `data_gen.run.generate` makes or resumes the traces, with its progress bar.
    `extra_train` datasets' train traces are found or made the same way and appended to the train split.
    """
    from data_gen import store
    from data_gen.run import generate

    explicit = cfg.get("trace_dirs") or {}
    pair = None

    def load_or_generate(scfg: DictConfig, split: str, what: str):
        nonlocal pair
        folder = store.trace_folder(scfg, split)
        try:
            found = store.read_manifest(folder)
        except UserError:
            found = None  # corrupt manifest: generate() decides (resume, or one line saying what to do)
        if found and found.get("complete") and found.get("config_hash") == store.config_hash(scfg):
            return store.load_traces(folder)
        if pair is None:
            from models.pair import load_pair

            print(f"{what} traces missing or incomplete at {folder}: generating them (pair {cfg.pair.name})", flush=True)
            pair = load_pair(cfg.pair)
        return store.load_traces(generate(scfg, split, pair))

    traces, manifests = {}, {}
    for split in SPLITS:
        if explicit.get(split):
            traces[split], manifests[split] = store.load_traces(Path(str(explicit[split])))
            check_pair_id(cfg, split, manifests[split])  # before any generation for the other splits
            continue
        traces[split], manifests[split] = load_or_generate(split_cfg(cfg, split), split, split)
    extra = extra_train_cfgs(cfg)
    if extra:
        from datasets import concatenate_datasets

        parts, folders = [traces["train"]], []
        for scfg in extra:
            what = f"extra train ({scfg.dataset.name})"
            ds, man = load_or_generate(scfg, "train", what)
            check_pair_id(cfg, what, man)
            parts.append(ds)
            folders.append(str(store.trace_folder(scfg, "train")))
        traces["train"] = concatenate_datasets(parts)
        manifests["train"] = dict(manifests["train"], extra_train=folders)
    return traces, manifests


def extra_train_cfgs(cfg: DictConfig) -> list[DictConfig]:
    """Per-dataset configs for `extra_train` (dataset configs composed into `extra_train.<name>`, e.g. by
    `- /dataset@extra_train.python_stdlib: python_stdlib` in an experiment's defaults; `limit` in the entry caps its
    prompts). Their train-split traces are appended to the head's train rows; validation and test stay the main
    dataset's, so calibration, the speed rule and every reported number are on the main dataset's prompts."""
    from omegaconf import open_dict

    out = []
    for name, dcfg in (cfg.get("extra_train") or {}).items():
        if dcfg is None:
            continue
        scfg = cfg.copy()
        with open_dict(scfg):
            ds = OmegaConf.to_container(dcfg, resolve=True)
            limit = ds.pop("limit", None)
            if "loader" not in ds:
                raise UserError(f"extra_train.{name} is not a dataset config (no loader); compose one with "
                                f"'- /dataset@extra_train.{name}: <dataset>' in the experiment's defaults")
            scfg.dataset = OmegaConf.create(ds)
            scfg.limit = limit
            scfg.extra_train = None
        out.append(scfg)
    return out


def check_pair_id(cfg: DictConfig, split: str, manifest: dict) -> None:
    want, got = str(cfg.pair.name), str(manifest.get("pair_id"))
    if got != want:
        raise UserError(
            f"the {split} traces were made with pair {got} but this run's config says pair={want}; "
            f"use pair={got} or regenerate the traces for {want}"
        )


def check_manifests(cfg: DictConfig, manifests: dict) -> dict:
    """Refuse traces from another pair (or mixed pairs); return the train manifest."""
    for split, man in manifests.items():
        check_pair_id(cfg, split, man)
    hashes = {str(m.get("tokenizer_hash")) for m in manifests.values()}
    if len(hashes) > 1:
        raise UserError(f"trace splits disagree on the tokenizer ({sorted(hashes)}); regenerate them with one pair")
    return manifests["train"]


def text_classes(cfg: DictConfig, manifest: dict) -> str:
    """The `text` group's token classes of the traces' tokenizer (the pair's, checked by hash), packed for the spec."""
    from models.features.text import pack_classes, token_classes
    from models.pair import load_tokenizer, tokenizer_hash

    tok = load_tokenizer(cfg.pair)
    if tokenizer_hash(tok) != str(manifest.get("tokenizer_hash")):
        raise UserError(f"pair {cfg.pair.name}'s tokenizer is not the one these traces were made with; use their pair")
    return pack_classes(token_classes(tok))


def feature_spec(cfg: DictConfig, manifest: dict):
    """The head's feature spec: the feature kind its family reads (models.heads), sized from the traces' manifest."""
    from models.features.spec import FeatureSpec, feature_kind
    from models.heads import head_family, head_kinds

    kind = str(cfg.model.kind)
    if kind not in head_kinds():
        raise UserError(f"unknown model.kind '{kind}'; known: {', '.join(head_kinds())}")
    features = feature_kind(head_family(kind).features)
    if features.reads_probs or features.tree:
        k = int(cfg.model.get("k", 10))
        have = int(manifest.get("topk", k))
        if features.reads_probs and have < k:
            raise UserError(f"{kind} head needs top-{k} probabilities but the traces stored top-{have}; "
                            f"set model.k<={have}")
        if not features.grouped:
            return FeatureSpec(features.name, k=k)
        groups = list(cfg.model.get("groups") or [])
        text = text_classes(cfg, manifest) if "text" in groups else ""
        try:
            spec = FeatureSpec(features.name, k=k, groups=groups, text_classes=text)
        except ValueError as err:
            raise UserError(f"model.groups: {err}") from None
        if spec.reads_hidden:
            d = int(manifest.get("hidden_size", 0) or 0)
            if d <= 0:
                raise UserError("model.groups has 'hidden' but these traces have no hidden states; regenerate with "
                                "trace.store_hidden=true or drop 'hidden' from model.groups")
            spec = FeatureSpec(features.name, k=k, d=d, groups=groups, text_classes=text)
        return spec
    d = int(manifest.get("hidden_size", 0) or 0)
    if d <= 0:
        raise UserError(
            f"head kind '{kind}' reads draft hidden states but these traces have none; "
            "regenerate with trace.store_hidden=true (the experiment configs set it)"
        )
    return FeatureSpec(features.name, k=int(manifest.get("topk", 10)), d=d)


# -------------------------------------------------------------------------------------------------------- logging


def make_loggers(cfg: DictConfig, run_dir: Path) -> list:
    """CSV always; W&B (offline by default, under the run dir) unless `logger=none`. W&B trouble never stops a run."""
    from lightning.pytorch.loggers import CSVLogger

    loggers = [CSVLogger(save_dir=str(run_dir), name="csv", version="")]
    wcfg = (cfg.get("logger") or {}).get("wandb")
    if not wcfg:
        return loggers
    try:
        from lightning.pytorch.loggers import WandbLogger

        mode = str(wcfg.get("mode", "offline"))
        os.environ["WANDB_MODE"] = mode
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ["WANDB_DIR"] = str(run_dir)  # per job: a multirun must not reuse job 0's folder
        group, name = wandb_run.sweep_names(cfg, run_dir)
        wandb_logger = WandbLogger(
            project=str(wcfg.get("project", "specstop")),
            entity=wcfg.get("entity"),
            group=group,
            name=name,
            tags=list(wcfg.get("tags") or []),
            save_dir=str(run_dir),
            offline=mode == "offline",
            config=OmegaConf.to_container(cfg, resolve=True),
        )
        wandb_logger.experiment  # start the run now so a failure is caught here  # noqa: B018
        loggers.append(wandb_logger)
    except Exception as err:  # noqa: BLE001 - any W&B failure degrades to CSV only
        warnings.warn(f"W&B disabled for this run ({type(err).__name__}: {err}); CSV logs still written", stacklevel=1)
    return loggers


# ---------------------------------------------------------------------------------------------------------- plots


def save_curves(points: dict, base_points: dict, results: dict, out_dir: Path, title: str) -> dict[str, Path]:
    """ROC and PR curves as PNG files in `out_dir` (beside the checkpoint), drawn by eval.plots as `python -m eval`
    draws them; the ROC has the training-free scores on the same rows (`base_points`: name → (fpr, tpr)) beside the
    head's."""
    from eval import plots
    from eval.metrics import BASELINE_LABELS

    paths = {}
    if "roc" in points:
        curves = {"head": (*points["roc"], results["test/auroc"])}
        curves.update({BASELINE_LABELS[n]: (*curve, results[f"test/auroc_{n}"]) for n, curve in base_points.items()
                       if curve})
        paths["roc"] = plots.roc(curves, out_dir / "roc.png", title=f"ROC: {title}")
    if "pr" in points:
        paths["pr"] = plots.pr({"head": (*points["pr"], results["test/ap"])}, out_dir / "pr.png", title=f"PR: {title}")
    return paths


def log_curves_wandb(loggers: list, points: dict, pngs: dict) -> None:
    """ROC/PR as W&B line plots (tables) plus the PNGs, on the run's W&B logger if any."""
    for lg in loggers:
        if type(lg).__name__ != "WandbLogger":
            continue
        try:
            import wandb

            axes = {"roc": ("fpr", "tpr"), "pr": ("recall", "precision")}
            payload = {}
            for name, (xs, ys) in points.items():
                table = wandb.Table(data=[[a, b] for a, b in zip(xs, ys)], columns=list(axes[name]))
                payload[f"test/{name}_curve"] = wandb.plot.line(table, *axes[name], title=f"test {name.upper()}")
                payload[f"test/{name}_png"] = wandb.Image(str(pngs[name]))
            lg.experiment.log(payload)
        except Exception as err:  # noqa: BLE001
            warnings.warn(f"could not log curves to W&B ({err})", stacklevel=1)


# ------------------------------------------------------------------------------------------------------------ run


def run(cfg: DictConfig, run_dir: Path, traces: dict | None = None, manifests: dict | None = None) -> dict:
    """Train, test and report one head; returns the results dict (also written to run_dir/results.json)."""
    import lightning as L

    from data_gen.labels import required_columns

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    quiet_lightning()
    required_columns(cfg.labels)  # unknown label scheme → one line before any work
    L.seed_everything(int(cfg.seed), workers=True, verbose=False)
    if traces is None:
        traces, manifests = load_traces(cfg)
    manifest = check_manifests(cfg, manifests)
    spec = feature_spec(cfg, manifest)
    loggers = make_loggers(cfg, run_dir)
    try:
        fit = fit_head(cfg, run_dir, traces, manifest, spec, loggers)
        calibrate_checkpoint(fit.ckpt_path, fit.dm.data["validation"], str(cfg.get("calibration", "none")),
                             str(cfg.threshold_mode), float(cfg.threshold))
        speed = store_speed_rule(fit.ckpt_path, traces["validation"], manifests["validation"], cfg.get("speed_rule"))
        results = test_report(cfg, fit, spec, speed, loggers)
        (run_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    finally:
        wandb_run.finish()
    print_table(results)
    return results


@dataclass
class Fit:
    """What training leaves for the report: the best checkpoint, the data module (its test rows) and the trainer."""

    ckpt_path: Path
    dm: object  # train.datamodule.TraceDataModule
    best_score: float
    epochs: int


def fit_head(cfg: DictConfig, run_dir: Path, traces: dict, manifest: dict, spec, loggers: list) -> Fit:
    """Features and labels (TraceDataModule), the head (StopHeadModule), Lightning fit with early stopping on
    `cfg.monitor`, test on the best checkpoint (last state when there is none, e.g. fast_dev_run)."""
    import lightning as L
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from train.datamodule import TraceDataModule
    from train.module import StopHeadModule

    data = cfg.data
    dm = TraceDataModule(
        traces, cfg.labels, spec, batch_size=data.batch_size, num_workers=data.num_workers,
        imbalance=data.imbalance, normalize=data.normalize, seed=int(cfg.seed), reject_weight=data.get("reject_weight"),
    )
    dm.setup("fit")
    module = StopHeadModule(
        kind=str(cfg.model.kind), spec=spec.to_dict(), arch=OmegaConf.to_container(cfg.model.arch, resolve=True),
        labels=OmegaConf.to_container(cfg.labels, resolve=True), lr=float(cfg.model.lr),
        weight_decay=float(cfg.model.weight_decay), pos_weight=float(dm.pos_weight),
        threshold_mode=str(cfg.threshold_mode), threshold=float(cfg.threshold),
        pair_id=str(manifest.get("pair_id")), tokenizer_hash=str(manifest.get("tokenizer_hash")),
        mean=dm.mean.tolist(), std=dm.std.tolist(),
    )
    ckpt_dir = run_dir / "checkpoints"
    # no version counter: a rerun into the same run dir (README's hydra.run.dir=runs/disco) replaces best.ckpt
    # instead of writing best-v1.ckpt beside it and leaving the path every command names on the old head
    checkpoint = ModelCheckpoint(dirpath=str(ckpt_dir), filename="best", monitor=cfg.monitor, mode="max",
                                 save_top_k=1, save_last=False, auto_insert_metric_name=False,
                                 enable_version_counter=False)
    stopper = EarlyStopping(monitor=cfg.monitor, mode="max", patience=int(cfg.early_stopping.patience),
                            min_delta=float(cfg.early_stopping.min_delta))
    trainer = L.Trainer(**OmegaConf.to_container(cfg.trainer, resolve=True), default_root_dir=str(run_dir),
                        logger=loggers, callbacks=[checkpoint, stopper])
    trainer.fit(module, datamodule=dm)
    ckpt_path = checkpoint.best_model_path
    if not ckpt_path:  # fast_dev_run or no validation: keep the last state
        ckpt_path = str(ckpt_dir / "last.ckpt")
        trainer.save_checkpoint(ckpt_path)
    trainer.test(module, datamodule=dm, ckpt_path=ckpt_path, verbose=False)
    best = checkpoint.best_model_score
    return Fit(Path(ckpt_path), dm, float(best) if best is not None else math.nan, int(trainer.current_epoch))


def test_report(cfg: DictConfig, fit: Fit, spec, speed: dict | None, loggers: list) -> dict:
    """The calibrated head reloaded from its checkpoint on the test rows: metrics next to the training-free scores
    on the same rows, ROC/PR curves beside the checkpoint (and to the loggers)."""
    from eval.metrics import (baseline_auroc, baseline_scores, classification_metrics, expected_calibration_error,
                              roc_pr_points, static_length_f1)
    from models.heads import load_head
    from models.pair import draft_files

    bundle = load_head(fit.ckpt_path)
    test = fit.dm.data["test"]
    y = test["y"].numpy()
    scores = bundle.prob(test["x"]).numpy()
    metrics = classification_metrics(scores, y, bundle.threshold)
    # a static speculation length is a chain baseline (DISCO App. D); a tree's nodes have no such cut
    static = {"f1_static_best": None, "k_best": None} if spec.family.tree else static_length_f1(y, test["pos"].numpy())
    results = {
        "test/auroc": metrics["auroc"],
        "test/ap": metrics["ap"],
        "test/f1": metrics["f1"],
        "test/precision": metrics["precision"],
        "test/recall": metrics["recall"],
        "test/f1_static_best": static["f1_static_best"],
        "test/k_static_best": static["k_best"],
        "test/positive_rate": float((test["y"] >= 0.5).float().mean()),
        "test/rows": len(scores),
        "val/auroc": fit.best_score,
        "threshold": bundle.threshold,
        "threshold_mode": str(cfg.threshold_mode),
        "calibration": bundle.calibration,
        "test/ece": expected_calibration_error(scores, y),
        "ckpt_path": str(fit.ckpt_path.resolve()),
        "kind": bundle.kind,
        "labels": OmegaConf.to_container(cfg.labels, resolve=True),
        "pair_id": bundle.pair_id,
        "draft_files": draft_files(cfg.pair),  # the draft whose traces trained it (their config hash holds the same)
        "dataset": str(cfg.dataset.name),
        "speed_rule": speed,
        "train_rows": len(fit.dm.data["train"]["y"]),
        "epochs": fit.epochs,
    }
    # the kind's training-free scores (max q / −H_q for chain kinds, joint / q_token for node kinds) from the test rows'
    # own trace columns (the data module keeps them); a hidden-state head is compared with none here, as before
    baselines = {}
    if spec.reads_probs or spec.family.tree:
        names = spec.family.baselines
        baselines = baseline_scores(test["base"], names)
        results.update({f"test/auroc_{name}": auroc for name, auroc in baseline_auroc(test["base"], y, names).items()})
    nodes = test.get("nodes")
    if nodes is not None:  # a node head on both tasks, whatever it was trained on (eval.classifier.node_views)
        from data_gen.labels import is_conditional
        from eval.classifier import node_views

        views = node_views(bundle.prob_rows(nodes["x"]), nodes["on_path"], nodes["parent_row"], nodes["base"], spec.family.baselines,
                           is_conditional(bundle.labels))
        for view in ("path", "cond"):  # test/auroc_path, test/auroc_path_joint, ..., test/rows_cond, ...
            for k, v in views[view].items():
                key = k.replace("auroc", f"auroc_{view}", 1) if k.startswith("auroc") else f"{k}_{view}"
                results[f"test/{key}"] = v
        results["path_score"] = views["path_score"]
    points = roc_pr_points(scores, y)
    base_points = {name: roc_pr_points(b, y).get("roc") for name, b in baselines.items()}
    pngs = save_curves(points, base_points, results, fit.ckpt_path.parent,
                       f"{cfg.get('experiment_name', bundle.kind)} ({bundle.kind})")
    results.update({f"{k}_png": str(v) for k, v in pngs.items()})
    for lg in loggers:
        lg.log_metrics({k: v for k, v in results.items() if k.startswith("test/") and isinstance(v, (int, float))})
    log_curves_wandb(loggers, points, pngs)
    return results


def calibrate_checkpoint(path: Path, val: dict, mode: str, threshold_mode: str, threshold: float) -> dict:
    """Fit the head's calibration on the validation rows and store it in the checkpoint (models.heads).

    The best-F1 threshold is re-chosen on the calibrated validation scores (the same cut, since the map is monotone;
    it is rewritten so decode compares calibrated probabilities with a threshold on the same scale).
    """
    import torch

    from eval.metrics import best_f1_threshold
    from models.calibration import fit_calibration
    from models.heads import load_head, update_head_meta

    bundle = load_head(path)
    logits = bundle.logit(val["x"]).cpu()
    calib = fit_calibration(logits, val["y"], mode, val.get("w"))
    entries = {"calibration": calib}
    if threshold_mode == "best_f1":
        scores = torch.sigmoid(logits / calib["temperature"] + calib["bias"])
        entries["threshold"], _ = best_f1_threshold(scores, val["y"])
    update_head_meta(path, **entries)
    return calib


def store_speed_rule(path: Path, val_ds, val_manifest: dict, conf) -> dict | None:
    """Choose the head's stop rule for speed on the validation traces (eval.replay.speed_rule: the cost model under
    the profile the traces were made with) and store it in the checkpoint, so `learned:<ckpt>` decodes with it
    without a tuning step. Skipped (None, with a note) for heads the replay cannot run and traces with no profile."""
    from data_gen.contract import trace_columns
    from eval.continuations import CONTINUATION_COLUMNS, continuations
    from eval.replay import speed_rule
    from models.cost import CostProfile
    from models.heads import load_head, update_head_meta

    if not conf or not conf.get("thresholds"):
        return None
    bundle = load_head(path)
    if bundle.spec.family.tree:
        print(f"speed rule: not chosen ({bundle.kind} head scores token-tree nodes; decode's tree builders size the "
              "tree from its P(on_path))", flush=True)
        return None
    greedy = val_manifest.get("trace_kind") == "target_ar" and float(val_manifest.get("temperature") or 0) == 0.0
    if not bundle.spec.reads_probs or not greedy or not val_manifest.get("cost_profile"):
        print(f"speed rule: not chosen ({bundle.kind} head, {val_manifest.get('trace_kind')} traces"
              f"{'' if val_manifest.get('cost_profile') else ', no cost profile in the traces'}); decode uses the "
              "stored threshold", flush=True)
        return None
    profile = CostProfile.from_dict(val_manifest["cost_profile"])
    conts = continuations(trace_columns(val_ds, [c for c in CONTINUATION_COLUMNS if c in val_ds.column_names]))
    choice = speed_rule(bundle, conts, profile, list(conf.thresholds))
    update_head_meta(path, decode_rule={k: choice[k] for k in ("rule", "threshold") if k in choice})
    return choice


def print_table(results: dict) -> None:
    from eval.metrics import BASELINE_LABELS

    r = results
    lab = r["labels"]
    scheme = lab.get("name") + (f" tau={lab['tau']}" if "tau" in lab else "")
    tree = r.get("test/k_static_best") is None  # node heads: rows are candidate-tree nodes, no static length
    what, share = ("candidate-tree nodes", "on the accepted path") if tree else ("drafted positions", "accepted")
    print(f"\n{r['kind']} head on {r['dataset']} ({scheme}), test split: {r['test/rows']} {what}, "
          f"{100 * r['test/positive_rate']:.1f}% {share}")
    rows = [
        ("AUROC", r["test/auroc"]),
        *[(f"AUROC of {label} (training-free, same rows)", r[f"test/auroc_{key}"])
          for key, label in BASELINE_LABELS.items() if f"test/auroc_{key}" in r],
        ("average precision", r["test/ap"]),
        (f"F1 @ threshold {r['threshold']:.3f} ({r['threshold_mode']} on validation)", r["test/f1"]),
    ]
    if not tree:
        rows.append((f"F1 best static length (K={r['test/k_static_best']})", r["test/f1_static_best"]))
    for view, what in (("path", "every node, label on_path"), ("cond", "nodes whose parent is on the path")):
        if f"test/auroc_{view}" in r:  # node heads: both tasks (eval.classifier.node_views)
            base = " ".join(f"{BASELINE_LABELS[k]} {r[f'test/auroc_{view}_{k}']:.4f}" for k in BASELINE_LABELS
                            if f"test/auroc_{view}_{k}" in r)
            rows.append((f"AUROC {view} ({what}, {r[f'test/rows_{view}']} rows; {base})", r[f"test/auroc_{view}"]))
    sr = r.get("speed_rule")
    if sr:
        rule = sr["rule"] + (f" {sr['threshold']:g}" if sr.get("threshold") is not None else "")
        rows.append((f"validation cost-model speedup, stop rule for decode: {rule}", sr["cost_model_speedup"]))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value:.4f}")
    print(f"  checkpoint: {r['ckpt_path']}")
