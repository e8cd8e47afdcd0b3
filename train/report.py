"""The train job's test report: the reloaded head's metrics on the test rows beside the training-free baselines
(and, for node heads, both node views), its ROC/PR curves, and the table printed at the end of `python -m train`.

Every number and curve comes from eval's one definition of it (eval.metrics, eval.plots, eval.classifier), so
results.json and `python -m eval` agree on the same rows.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


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


def test_report(cfg: DictConfig, fit, spec, speed: dict | None, loggers: list) -> dict:
    """The calibrated head reloaded from its checkpoint on the test rows (`fit`: train.job.Fit): metrics next to the
    training-free scores on the same rows, ROC/PR curves beside the checkpoint (and to the loggers)."""
    from eval.metrics import baseline_auroc, baseline_scores, roc_pr_points
    from models.heads import load_head

    bundle = load_head(fit.ckpt_path)
    test = fit.dm.data["test"]
    y = test["y"].numpy()
    scores = bundle.prob(test["x"]).numpy()
    results = _test_metrics(cfg, fit, spec, speed, bundle, scores)
    # the kind's training-free scores (max q / −H_q for chain kinds, joint / q_token for node kinds) from the test rows'
    # own trace columns (the data module keeps them); a hidden-state head is compared with none here, as before
    baselines = {}
    if spec.reads_probs or spec.family.tree:
        names = spec.family.baselines
        baselines = baseline_scores(test["base"], names)
        results.update({f"test/auroc_{name}": auroc for name, auroc in baseline_auroc(test["base"], y, names).items()})
    if test.get("nodes") is not None:  # a node head on both tasks, whatever it was trained on
        results.update(_node_views(test["nodes"], bundle, spec))
    points = roc_pr_points(scores, y)
    base_points = {name: roc_pr_points(b, y).get("roc") for name, b in baselines.items()}
    pngs = save_curves(points, base_points, results, fit.ckpt_path.parent,
                       f"{cfg.get('experiment_name', bundle.kind)} ({bundle.kind})")
    results.update({f"{k}_png": str(v) for k, v in pngs.items()})
    for lg in loggers:
        lg.log_metrics({k: v for k, v in results.items() if k.startswith("test/") and isinstance(v, (int, float))})
    log_curves_wandb(loggers, points, pngs)
    return results


def _test_metrics(cfg: DictConfig, fit, spec, speed: dict | None, bundle, scores) -> dict:
    """results.json's head metrics and run facts (before the baselines, node views and plots are added)."""
    from eval.metrics import classification_metrics, expected_calibration_error, static_length_f1
    from models.pair import draft_files

    test = fit.dm.data["test"]
    y = test["y"].numpy()
    metrics = classification_metrics(scores, y, bundle.threshold)
    # a static speculation length is a chain baseline (DISCO App. D); a tree's nodes have no such cut
    static = {"f1_static_best": None, "k_best": None} if spec.family.tree else static_length_f1(y, test["pos"].numpy())
    return {
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


def _node_views(nodes: dict, bundle, spec) -> dict:
    """A node head's two views (eval.classifier.node_views) as results entries: test/auroc_path, test/auroc_path_joint,
    ..., test/rows_cond, ..., and path_score."""
    from data_gen.labels import is_conditional
    from eval.classifier import node_views

    views = node_views(bundle.prob_rows(nodes["x"]), nodes["on_path"], nodes["parent_row"], nodes["base"],
                       spec.family.baselines, is_conditional(bundle.labels))
    out = {}
    for view in ("path", "cond"):
        for k, v in views[view].items():
            key = k.replace("auroc", f"auroc_{view}", 1) if k.startswith("auroc") else f"{k}_{view}"
            out[f"test/{key}"] = v
    out["path_score"] = views["path_score"]
    return out


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
