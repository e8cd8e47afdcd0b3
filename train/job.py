"""The training job behind `python -m train` (train/__main__.py composes the config and calls `run`).

One job top to bottom: load or generate the traces for train/validation/test (train.inputs: data_gen; the pair is
loaded once and only if something must be generated), build the data module (`conf/data`: features and labels), the
LightningModule (`conf/model`: the head) and the callbacks (`conf/callbacks`: best checkpoint on `monitor`, early
stopping) with `instantiate` as the lightning-hydra-template does, fit, calibrate the best checkpoint and store its
speed rule, then test it (train.report) and write:

- `results.json` (test/auroc, test/ap, test/f1, test/f1_static_best, threshold, ckpt_path, ...),
- `checkpoints/best.ckpt` with `roc.png` and `pr.png` beside it (and to W&B as plots when W&B is on),
- `csv/` (always) and `wandb/` (offline by default; `wandb sync <run dir>/wandb/offline-run-*` uploads later).

Which baselines, and whether the chain-only steps run (the speed rule, the static-length F1), is the feature kind's
business: token-tree node heads (`model=c2t | tree_node` on `trace=tree`, `labels=on_path | on_path_given_parent`;
`FeatureKind.tree`) are compared with the joint probability and q_token and skip both; their report adds both node
views (eval.classifier.node_views), so an unconditional and a conditional head are read on the same two tasks.
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

from train.inputs import check_manifests, feature_spec, load_traces
from train.report import print_table, test_report
from utils import wandb_run
from utils.cli import UserError

log = logging.getLogger("train")


def quiet_lightning() -> None:
    """Keep stdout readable: Lightning's banner/tips off, known-harmless warnings filtered (errors still show)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for pattern in (".*LeafSpec.*", ".*smaller than the logging interval.*", ".*does not have many workers.*",
                    ".*anonymous setting.*"):
        warnings.filterwarnings("ignore", message=pattern)


# -------------------------------------------------------------------------------------------------------- logging


def keep_earlier_csv(folder: Path) -> Path | None:
    """Lightning's CSV logger starts metrics.csv afresh, so a resumed run (train.eagle's second invocation) or a rerun
    in the same folder would lose the earlier curve: keep it as metrics-1.csv, metrics-2.csv, … (returned)."""
    old = folder / "metrics.csv"
    if not old.is_file():
        return None
    k = 1
    while (folder / f"metrics-{k}.csv").exists():
        k += 1
    return old.rename(folder / f"metrics-{k}.csv")


def make_loggers(cfg: DictConfig, run_dir: Path) -> list:
    """CSV always; W&B (offline by default, under the run dir) unless `logger=none`. W&B trouble never stops a run."""
    from lightning.pytorch.loggers import CSVLogger

    keep_earlier_csv(run_dir / "csv")
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


# ------------------------------------------------------------------------------------------------------------ run


def run(cfg: DictConfig, run_dir: Path, traces: dict | None = None, manifests: dict | None = None) -> dict:
    """Train, test and report one head; returns the results dict (also written to run_dir/results.json)."""
    import lightning as L

    from data_gen.labels import scheme

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    quiet_lightning()
    scheme(cfg.labels)  # unknown label scheme → one line before any work
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
    """The data module (`cfg.data`), the head (`cfg.model`) and the callbacks (`cfg.callbacks`), built from config;
    Lightning fit, then test on the best checkpoint (last state when there is none, e.g. fast_dev_run)."""
    import lightning as L
    from hydra.utils import instantiate

    dm = instantiate(cfg.data, _partial_=True)(traces=traces, labels_cfg=cfg.labels, spec=spec, seed=int(cfg.seed))
    dm.setup("fit")
    module = instantiate(cfg.model, _partial_=True, _recursive_=False)(
        spec=spec.to_dict(), labels=cfg.labels, pos_weight=float(dm.pos_weight),
        threshold_mode=str(cfg.threshold_mode), threshold=float(cfg.threshold),
        pair_id=str(manifest.get("pair_id")), tokenizer_hash=str(manifest.get("tokenizer_hash")),
        drafter=str(manifest.get("drafter", "student")), mean=dm.mean.tolist(), std=dm.std.tolist(),
    )
    ckpt_dir = run_dir / "checkpoints"
    callbacks, checkpoint = make_callbacks(cfg, ckpt_dir)
    trainer = L.Trainer(**OmegaConf.to_container(cfg.trainer, resolve=True), default_root_dir=str(run_dir),
                        logger=loggers, callbacks=callbacks)
    trainer.fit(module, datamodule=dm)
    ckpt_path = checkpoint.best_model_path
    if not ckpt_path:  # fast_dev_run or no validation: keep the last state
        ckpt_path = str(ckpt_dir / "last.ckpt")
        trainer.save_checkpoint(ckpt_path)
    trainer.test(module, datamodule=dm, ckpt_path=ckpt_path, verbose=False)
    best = checkpoint.best_model_score
    return Fit(Path(ckpt_path), dm, float(best) if best is not None else math.nan, int(trainer.current_epoch))


def make_callbacks(cfg: DictConfig, ckpt_dir: Path) -> tuple[list, object]:
    """The callbacks `cfg.callbacks` names (null entries dropped), a checkpoint callback's empty `dirpath` set to
    `ckpt_dir`; returns (callbacks, the ModelCheckpoint whose best file the job calibrates and tests)."""
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = []
    for c in (cfg.get("callbacks") or {}).values():
        if c is not None:
            callbacks.append(instantiate(c, **({"dirpath": str(ckpt_dir)} if "dirpath" in c and c.dirpath is None else {})))
    checkpoints = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    if len(checkpoints) != 1:
        raise UserError(f"callbacks must hold one ModelCheckpoint (the job tests its best file); got {len(checkpoints)}")
    return callbacks, checkpoints[0]


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
    from data_gen.kinds import greedy_rounds
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
    if not bundle.spec.reads_probs or not greedy_rounds(val_manifest) or not val_manifest.get("cost_profile"):
        print(f"speed rule: not chosen ({bundle.kind} head, {val_manifest.get('trace_kind')} traces"
              f"{'' if val_manifest.get('cost_profile') else ', no cost profile in the traces'}); decode uses the "
              "stored threshold", flush=True)
        return None
    profile = CostProfile.from_dict(val_manifest["cost_profile"])
    conts = continuations(trace_columns(val_ds, [c for c in CONTINUATION_COLUMNS if c in val_ds.column_names]))
    choice = speed_rule(bundle, conts, profile, list(conf.thresholds))
    update_head_meta(path, decode_rule={k: choice[k] for k in ("rule", "threshold") if k in choice})
    return choice


