"""A stop head as a classifier on trace rows: what `python -m eval` computes and writes (eval/__main__.py composes
the config and calls `run`).

For each checkpoint, on the traces it was trained from (its training run's pair × dataset × trace × `split`, found
through the run's saved Hydra config, or `traces=DIR`): AUROC, AP, F1/precision/recall/confusion at the checkpoint's
threshold and at the best-F1 threshold (eval.metrics), ECE (torchmetrics BinaryCalibrationError, 15 equal-width
bins) with a reliability diagram, AUROC per bucket of position in the draft round and in the continuation, the best
static speculation length's F1 (DISCO App. D), and for a SPRINTER head the Theorem 1/2 predictions (eval.theory).

A token-tree node head (c2t, tree_node: its feature kind has `tree`) is evaluated the same way on the nodes of a
`trace=tree` folder (labels on_path), with what differs taken from its feature kind: the training-free baselines are
the joint probability and q_token (`FeatureKind.baselines`), the position buckets are by depth − 1 (the node's place on
its drafted path, `FeatureKind.positions`), and the chain-only static-length F1 is left out (None).

A node head is also read two ways whatever its label scheme (`node_views`, train's test report too): `path` — label
on_path over every node, the head's P(on path) (a conditional head's P composed by product along the root path,
models.features.nodes.compose_path) against the joint probability and q_token; `cond` — the nodes whose parent is on the
path (the root's children always), label on_path, the head's own P against the same baselines. The main numbers are
on the rows the head's scheme labels (all nodes for on_path; the `cond` rows for on_path_given_parent, whose row mask
`data_gen.labels.make_mask` applies to every metric, the calibration and the thresholds).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from data_gen.contract import check_compatible, default_trace_folder
from eval.metrics import BASELINE_LABELS, baseline_auroc, baseline_scores, expected_calibration_error
from utils.cli import UserError, output_dir
from utils.files import json_text

ROUND_BUCKETS = [(0, 0), (1, 1), (2, 2), (3, 3), (4, 7), (8, 15), (16, None)]
CONT_BUCKETS = [(0, 15), (16, 31), (32, 63), (64, 127), (128, 255), (256, None)]
N_BINS = 15
COLUMNS = ("prompt_id", "kind", "position", "draft_token", "target_token", "q_draft", "p_draft", "tvd",
           "draft_entropy", "draft_topk", "draft_hidden")


# ------------------------------------------------------------------------------------------------ which traces


def ckpt_paths(value) -> list[Path]:
    """`ckpt=PATH`, `ckpt=[A,B]` or `ckpt='A,B'` → paths."""
    if value is None or value == "":
        raise UserError("no checkpoint given; pass ckpt=PATH (a .ckpt written by python -m train), or ckpt=[A,B]")
    items = list(value) if isinstance(value, (list, tuple, ListConfig)) else str(value).split(",")
    return [Path(str(v).strip()) for v in items if str(v).strip()]


def load_split(folder: Path, split: str):
    from data_gen.store import load_traces

    if not Path(folder).exists():
        raise UserError(
            f"no {split} traces at {folder}; generate them (python -m data_gen ... split={split}) or pass traces=DIR"
        )
    return load_traces(folder)


# ---------------------------------------------------------------------------------------------------- metrics


def bucket_label(lo: int, hi: int | None) -> str:
    return str(lo) if hi == lo else (f"{lo}+" if hi is None else f"{lo}-{hi}")


def per_bucket_auroc(scores, labels, positions, buckets) -> dict:
    """AUROC within each position bucket (NaN where a bucket holds one class), with its row count."""
    from eval.metrics import classification_metrics

    out = {}
    for lo, hi in buckets:
        sel = (positions >= lo) & (positions <= (hi if hi is not None else np.iinfo(np.int64).max))
        if sel.sum() == 0:
            continue
        m = classification_metrics(scores[sel], labels[sel], 0.5)
        out[bucket_label(lo, hi)] = {"auroc": m["auroc"], "rows": int(sel.sum()), "positive_rate": float((labels[sel] >= 0.5).mean())}
    return out


def calibration(scores, labels) -> dict:
    """ECE (eval.metrics, as train reports it) and the reliability curve (sklearn), on labels binarised at 0.5."""
    from sklearn.calibration import calibration_curve

    y = (np.asarray(labels) >= 0.5).astype(np.int64)
    s = np.clip(np.asarray(scores, dtype=np.float64), 0.0, 1.0)
    true, pred = calibration_curve(y, s, n_bins=N_BINS, strategy="uniform")
    return {"ece": expected_calibration_error(s, y, N_BINS),
            "reliability": {"predicted": pred.tolist(), "observed": true.tolist()}}


def sprinter_report(cols: dict, scores: np.ndarray, threshold: float, starts: np.ndarray, sampled: bool) -> dict:
    """SPRINTER Theorem 1/2 predictions from the head's measured TPR/FPR on these traces (eval.theory).

    Theorem classes: acceptable = q(x) ≤ p(x) (ratio label with τ = 1, whatever τ the head was trained with);
    a false positive is accepting a token with q(x) > p(x). Also measured on the traces themselves: the runs of
    consecutive verifier accepts (what Theorem 2 predicts, on trace contexts rather than SPRINTER's own rollouts).
    """
    from eval import theory
    from eval.traces import oracle_rounds

    q = cols["q_draft"].astype(np.float64)
    p = cols["p_draft"].astype(np.float64)
    acceptable = q <= p
    accept = scores >= threshold
    tpr = float(accept[acceptable].mean()) if acceptable.any() else math.nan
    fpr = float(accept[~acceptable].mean()) if (~acceptable).any() else math.nan
    runs = oracle_rounds(acceptable, starts)
    complete = runs["length"][runs["complete"]]
    out = theory.sprinter_predictions(tpr, fpr, float(cols["tvd"].astype(np.float64).mean()), float(acceptable.mean()), complete)
    verifier_runs = oracle_rounds(accept, starts)
    out["verifier_run_length_on_traces"] = float(verifier_runs["length"][verifier_runs["complete"]].mean()) \
        if verifier_runs["complete"].any() else math.nan
    out["draft_tokens_sampled_from_q"] = bool(sampled)
    if sampled:  # the exact per-step estimate needs x ~ q (eval.theory.sprinter_tvd_from_rows)
        out.update(theory.sprinter_tvd_from_rows(q, p, accept))
    return out


def node_views(scores, on_path, parent_row, base: dict, names, conditional: bool) -> dict:
    """A node head's AUROC in the two views (module docstring), each beside the training-free scores on its rows.

    `scores`: the head's P on every node of the trees; `on_path`, `parent_row` (models.features.nodes.parent_rows) and
    `base` (the trace columns of the baselines `names`, eval.metrics.BASELINES) on the same rows; `conditional`: the
    head predicts P(on path | parent on path) (data_gen.labels.is_conditional), so its path view is the product along
    the path. Returns {"path" | "cond": {rows, positive_rate, auroc, auroc_<baseline>, ...}, "path_score": what the
    path view ranks by}."""
    from eval.metrics import classification_metrics
    from models.features.nodes import compose_path, parent_on_path_rows

    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(on_path).astype(np.float32)
    cond = parent_on_path_rows(parent_row, on_path)
    path = compose_path(s, parent_row, "product") if conditional else s
    out: dict = {"path_score": "product of P along the root path" if conditional else "P"}
    for view, sel, head in (("path", np.ones(len(s), bool), path), ("cond", cond, s)):
        yy = y[sel]
        row = {"rows": int(sel.sum()), "positive_rate": float(yy.mean()) if len(yy) else math.nan,
               "auroc": classification_metrics(head[sel], yy, 0.5)["auroc"]}
        rows_base = {c: v[sel] for c, v in base.items()}
        row.update({f"auroc_{k}": v for k, v in baseline_auroc(rows_base, yy, names).items()})
        out[view] = row
    return out


def scored_rows(bundle, ds, folder: Path):
    """The columns `evaluate` reads from a trace split, their labels under the head's scheme and the head's scores
    (every row: a conditional scheme's mask is applied by the caller, after the node views that need all nodes)."""
    from data_gen.contract import trace_columns
    from data_gen.labels import make_labels, required_columns
    from eval.metrics import baseline_columns
    from models.features.spec import features_from_columns, needed_columns

    names = list(ds.column_names)
    labels_cfg = OmegaConf.create(bundle.labels)
    kind = bundle.spec.family
    want = [c for c in dict.fromkeys(COLUMNS + tuple(required_columns(labels_cfg)) + needed_columns(bundle.spec)
                                     + tuple(kind.position_columns) + baseline_columns(kind.baselines)) if c in names]
    if not bundle.spec.reads_hidden and "draft_hidden" in want:
        want.remove("draft_hidden")
    if kind.tree:  # the two node views need each node's parent row and label
        want += [c for c in ("on_path", "node", "parent", "prompt_id", "position") if c in names and c not in want]
    cols = trace_columns(ds, want)
    y = make_labels(cols, labels_cfg)
    x = features_from_columns(cols, bundle.spec)
    scores = bundle.prob_rows(x)
    if not np.isfinite(scores).all():
        raise UserError(f"checkpoint {bundle.path} produced non-finite scores on {folder}; the head is broken, retrain it")
    return cols, y, scores, labels_cfg


def _at_thresholds(scores, y, threshold: float) -> dict:
    """The head's classification numbers at its checkpoint's threshold and at the best-F1 threshold (`evaluate`)."""
    from eval.metrics import best_f1_threshold, classification_metrics

    at_ckpt = classification_metrics(scores, y, threshold)
    best_thr, _ = best_f1_threshold(scores, y)
    at_best = classification_metrics(scores, y, best_thr)
    return {
        "auroc": at_ckpt["auroc"],
        "ap": at_ckpt["ap"],
        "threshold": threshold,
        "f1": at_ckpt["f1"],
        "precision": at_ckpt["precision"],
        "recall": at_ckpt["recall"],
        "confusion": {k: at_ckpt[k] for k in ("tp", "fp", "tn", "fn")},
        "best_f1_threshold": best_thr,
        "best_f1": at_best["f1"],
        "best_f1_precision": at_best["precision"],
        "best_f1_recall": at_best["recall"],
        "best_f1_confusion": {k: at_best[k] for k in ("tp", "fp", "tn", "fn")},
    }


def evaluate(bundle, ds, manifest: dict, folder: Path) -> dict:
    """Every item-1 number (and item 3 for SPRINTER heads) for one checkpoint on one loaded trace split."""
    from data_gen.labels import is_conditional, make_mask
    from eval.metrics import baseline_columns, roc_pr_points, static_length_f1
    from models.features.nodes import parent_rows
    from models.features.trace import continuation_starts
    from models.heads import head_family

    check_compatible(bundle, manifest, folder, list(ds.column_names))
    if len(ds) == 0:
        raise UserError(f"the traces {folder} have no rows; regenerate them with a larger limit")
    kind = bundle.spec.family
    cols, y, scores, labels_cfg = scored_rows(bundle, ds, folder)
    views = None
    if kind.tree and "on_path" in cols:
        base = {c: cols[c] for c in baseline_columns(kind.baselines) if c in cols}
        views = node_views(scores, cols["on_path"], parent_rows(cols), base, kind.baselines,
                           is_conditional(bundle.labels))
    mask = make_mask(cols, labels_cfg)  # a conditional scheme's rows: every number below is on them
    if mask is not None:
        cols = {c: v[mask] for c, v in cols.items()}
        y, scores = y[mask], scores[mask]
    round_pos = np.asarray(kind.positions(cols))  # chain: position in the draft round; tree node: depth − 1
    cont_pos = np.asarray(cols["position"]).astype(np.int64)
    static = {"f1_static_best": None, "k_best": None} if kind.tree else static_length_f1(y, round_pos)
    calib = calibration(scores, y)
    report = {
        "ckpt": str(bundle.path),
        "kind": bundle.kind,
        "labels": dict(bundle.labels),
        "pair_id": bundle.pair_id,
        "traces": str(folder),
        "rows": int(len(y)),
        "positive_rate": float((y >= 0.5).mean()),
        **_at_thresholds(scores, y, float(bundle.threshold)),
        "ece": calib["ece"],
        "reliability": calib["reliability"],
        "per_position_auroc": {b: v["auroc"] for b, v in per_bucket_auroc(scores, y, round_pos, ROUND_BUCKETS).items()},
        "per_position_detail": per_bucket_auroc(scores, y, round_pos, ROUND_BUCKETS),
        "per_continuation_position_auroc": per_bucket_auroc(scores, y, cont_pos, CONT_BUCKETS),
        "f1_static_best": static["f1_static_best"],
        "k_static_best": static["k_best"],
        "curves": roc_pr_points(scores, y),
        "position_axis": "depth − 1 (position on the drafted path)" if kind.tree else "position in the draft round",
        "baseline_auroc": baseline_auroc(cols, y, kind.baselines),
        "baseline_curves": {k: roc_pr_points(v, y) for k, v in baseline_scores(cols, kind.baselines).items()},
    }
    if views is not None:
        report["node_views"] = views
    verifier = head_family(bundle.kind, getattr(bundle, "arch", None)).verifier
    if not kind.tree and verifier and all(c in cols for c in ("q_draft", "p_draft", "tvd")):
        trace_cfg = (manifest.get("config") or {}).get("trace") or {}
        sampled = str(trace_cfg.get("kind")) == "interleaved" or float(trace_cfg.get("temperature", 0) or 0) > 0
        report["sprinter_theory"] = sprinter_report(cols, scores, bundle.threshold, continuation_starts(cols), sampled)
    return report


# ---------------------------------------------------------------------------------------------------- output


def unique_names(reports: list[dict]) -> list[str]:
    """Short curve labels: `<kind>:<training run dir>` (the ckpt's grandparent), made unique."""
    names = []
    for r in reports:
        path = Path(r["ckpt"])
        run = path.parent.parent.name if path.parent.name == "checkpoints" else path.stem
        base = f"{r['kind']}:{run}"
        name, i = base, 2
        while name in names:
            name, i = f"{base}#{i}", i + 1
        names.append(name)
    return names


def _fmt(v) -> str:
    return "nan" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.4f}"


def markdown(reports: list[dict], names: list[str]) -> str:
    """One comparison table (a row per checkpoint), then per-position AUROC and SPRINTER theory where present."""
    head = "| checkpoint | labels | rows | pos. rate | AUROC | AP | thr | F1@thr | P@thr | R@thr | best-F1 thr | best F1 | ECE | static F1 (K) |"
    lines = ["# Stop-head evaluation", "", head, "|" + "---|" * (head.count("|") - 1)]
    for n, r in zip(names, reports):
        lab = r["labels"].get("name", "?") + (f" τ={r['labels']['tau']}" if "tau" in r["labels"] else "")
        # – for node heads: a static speculation length is a chain baseline
        static = "–" if r["k_static_best"] is None else f"{_fmt(r['f1_static_best'])} ({r['k_static_best']})"
        lines.append(
            f"| {n} | {lab} | {r['rows']} | {r['positive_rate']:.3f} | {_fmt(r['auroc'])} | {_fmt(r['ap'])} | "
            f"{r['threshold']:.3f} | {_fmt(r['f1'])} | {_fmt(r['precision'])} | {_fmt(r['recall'])} | "
            f"{r['best_f1_threshold']:.3f} | {_fmt(r['best_f1'])} | {_fmt(r['ece'])} | {static} |"
        )
    buckets = list(dict.fromkeys(b for r in reports for b in r["per_position_auroc"]))
    axes = " / ".join(dict.fromkeys(r.get("position_axis", "position in the draft round") for r in reports))
    lines += ["", f"AUROC by {axes}:", "", "| checkpoint | " + " | ".join(buckets) + " |",
              "|---|" + "---|" * len(buckets)]
    for n, r in zip(names, reports):
        lines.append(f"| {n} | " + " | ".join(_fmt(r["per_position_auroc"].get(b)) for b in buckets) + " |")
    base = list(dict.fromkeys(k for r in reports for k in (r.get("baseline_auroc") or {})))
    if base:  # the kinds' own training-free scores (eval.metrics.BASELINES): max q / −H_q for chain heads, joint / q_token for nodes
        lines += ["", "Training-free scores on the same rows (AUROC; max q = max-confidence, −H_q = SVIP / AdaEDL, "
                  "joint probability = EAGLE-2's node score):", "",
                  "| checkpoint | head | " + " | ".join(BASELINE_LABELS[k] for k in base) + " |", "|---|---|" + "---|" * len(base)]
        for n, r in zip(names, reports):
            b = r.get("baseline_auroc") or {}
            lines.append(f"| {n} | {_fmt(r['auroc'])} | " + " | ".join(_fmt(b.get(k)) for k in base) + " |")
    if any(r.get("node_views") for r in reports):  # node heads: both views, whatever the scheme (node_views)
        lines += ["", "Node heads in two views (AUROC; path: label on_path over every node, a conditional head's P "
                  "composed by product along the path; cond: the nodes whose parent is on the path, the head's own P):",
                  "", "| checkpoint | labels | path rows | path: head | joint | q(token) | cond rows | cond: head | "
                  "joint | q(token) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for n, r in zip(names, reports):
            v = r.get("node_views")
            if v:
                cells = [f"{v[w]['rows']} | " + " | ".join(_fmt(v[w].get(k)) for k in ("auroc", "auroc_joint",
                                                                                       "auroc_q_token"))
                         for w in ("path", "cond")]
                lines.append(f"| {n} | {r['labels'].get('name', '?')} | {cells[0]} | {cells[1]} |")
    for n, r in zip(names, reports):
        conf = r["confusion"]
        lines.append(f"\n{n}: confusion at thr {r['threshold']:.3f}: tp {conf['tp']} fp {conf['fp']} tn {conf['tn']} fn {conf['fn']}; traces {r['traces']}")
        t = r.get("sprinter_theory")
        if t:
            lines += [
                f"SPRINTER theory (acceptable = q ≤ p): TPR {_fmt(t['tpr'])}, FPR ε {_fmt(t['fpr'])}; mean TVD(p,q) "
                f"{_fmt(t['tvd_pq_mean'])} → predicted TVD(SPRINTER, p) = ε·TVD = {_fmt(t['tvd_sprinter_pred'])}"
                + (f" (exact per-step estimate from x~q rows: {_fmt(t['tvd_sprinter_from_samples'])}, weighted ε̄ {_fmt(t['eps_weighted'])})"
                   if "tvd_sprinter_from_samples" in t else ""),
                f"Theorem 2 run of verifier accepts: predicted {_fmt(t['run_length_pred_geometric'])} (geometric n, "
                f"a = {_fmt(t['acceptable_rate'])}; ideal verifier {_fmt(t['run_length_ideal_geometric'])})"
                + (f", {_fmt(t['run_length_pred_empirical_n'])} (measured acceptable runs, mean n {_fmt(t['acceptable_run_mean'])})"
                   if "run_length_pred_empirical_n" in t else "")
                + f"; on the traces: {_fmt(t['verifier_run_length_on_traces'])}",
            ]
    return "\n".join(lines) + "\n"


def write_plots(reports: list[dict], names: list[str], out: Path) -> list[Path]:
    from eval import plots

    roc = {n: (*r["curves"]["roc"], r["auroc"]) for n, r in zip(names, reports) if "roc" in r["curves"]}
    # the training-free scores on the first report's rows, drawn beside the heads (the same rows when one trace set)
    first = reports[0]
    for key, label in BASELINE_LABELS.items():
        curve = (first.get("baseline_curves") or {}).get(key) or {}
        if "roc" in curve:
            roc[f"{label} (training-free)"] = (*curve["roc"], first["baseline_auroc"][key])
    pr = {n: (*r["curves"]["pr"], r["ap"]) for n, r in zip(names, reports) if "pr" in r["curves"]}
    rel = {n: (r["reliability"]["predicted"], r["reliability"]["observed"], r["ece"]) for n, r in zip(names, reports)}
    pos = {n: r["per_position_auroc"] for n, r in zip(names, reports)}
    cont = {n: {b: v["auroc"] for b, v in r["per_continuation_position_auroc"].items()} for n, r in zip(names, reports)}
    base = reports[0]["positive_rate"] if len(reports) == 1 else None
    return [
        plots.roc(roc, out / "roc.png"),
        plots.pr(pr, out / "pr.png", base_rate=base),
        plots.reliability(rel, out / "reliability.png"),
        plots.per_position(pos, out / "per_position_auroc.png",
                           **({"xlabel": "depth − 1 (position on the drafted path)"} if all(
                               r.get("position_axis", "").startswith("depth") for r in reports) else {})),
        plots.per_position(cont, out / "per_continuation_position_auroc.png", xlabel="position in continuation"),
    ]


def _jsonable(obj):
    from eval.traces import _jsonable as clean

    return clean(obj)


def log_wandb(cfg: DictConfig, report: dict, reports: list[dict], names: list[str], pngs: list[Path], out: Path) -> None:
    """Metrics, the comparison table and the PNGs to one W&B run (offline by default); failures only warn."""
    wcfg = (cfg.get("logger") or {}).get("wandb")
    if not wcfg:
        return
    try:
        import os

        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        run = wandb.init(project=str(wcfg.get("project", "specstop")), entity=wcfg.get("entity"),
                         mode=str(wcfg.get("mode", "offline")), dir=str(out), job_type="eval",
                         tags=list(wcfg.get("tags") or []), config={"ckpts": [r["ckpt"] for r in reports]})
        try:
            keys = ["auroc", "ap", "f1", "threshold", "best_f1", "ece", "f1_static_best"]
            table = wandb.Table(columns=["checkpoint", *keys], data=[[n, *[r[k] for k in keys]] for n, r in zip(names, reports)])
            payload = {"eval/table": table, **{f"eval/{p.stem}": wandb.Image(str(p)) for p in pngs}}
            for n, r in zip(names, reports):
                payload.update({f"eval/{n}/{k}": r[k] for k in keys if isinstance(r[k], (int, float))})
            run.log(payload)
            print(f"W&B ({wcfg.get('mode', 'offline')}) run: {run.dir}")
        finally:
            run.finish()
    except Exception as err:  # noqa: BLE001 - W&B trouble never loses the report
        warnings.warn(f"W&B logging skipped ({type(err).__name__}: {err}); report.json is written", stacklevel=1)


def run(cfg: DictConfig) -> dict:
    """Evaluate every checkpoint, then write report.json / report.md / PNGs (nothing is written on a user error)."""
    from tqdm import tqdm

    from models.heads import load_head

    split = str(cfg.split)
    paths = ckpt_paths(cfg.get("ckpt"))
    reports = []
    for path in tqdm(paths, desc="eval", unit="ckpt", disable=len(paths) < 2):
        bundle = load_head(path)
        if cfg.get("threshold") is not None:  # the threshold decode runs with, when it is not the checkpoint's
            bundle.threshold = float(cfg.threshold)
        raw = torch.load(path, map_location="cpu", weights_only=False)
        folder = Path(str(cfg.traces)) if cfg.get("traces") else default_trace_folder(path, raw, split, cfg.get("trace_root"))
        ds, manifest = load_split(folder, split)
        reports.append(evaluate(bundle, ds, manifest, folder))
    names = unique_names(reports)
    out = output_dir(cfg.get("out_dir"))
    out.mkdir(parents=True, exist_ok=True)
    pngs = write_plots(reports, names, out)
    report: dict = {"split": split, "names": names, "checkpoints": reports}
    keys = ("auroc", "ap", "f1", "threshold", "ece", "per_position_auroc", "f1_static_best", "precision", "recall",
            "confusion", "best_f1_threshold", "best_f1", "best_f1_precision", "best_f1_recall", "best_f1_confusion",
            "k_static_best", "rows", "kind", "ckpt", "traces", "baseline_auroc")
    if len(reports) == 1:
        report.update({k: reports[0][k] for k in keys})
        if "node_views" in reports[0]:
            report["node_views"] = reports[0]["node_views"]
        if "sprinter_theory" in reports[0]:
            report["sprinter_theory"] = reports[0]["sprinter_theory"]
    else:
        report["comparison"] = {k: {n: r[k] for n, r in zip(names, reports)} for k in keys}
        if any("node_views" in r for r in reports):
            report["comparison"]["node_views"] = {n: r.get("node_views") for n, r in zip(names, reports)}
    report["plots"] = {p.stem: str(p) for p in pngs}
    md = markdown(reports, names)
    (out / "report.json").write_text(json_text(_jsonable(report), indent=2))
    (out / "report.md").write_text(md)
    log_wandb(cfg, report, reports, names, pngs, out)
    print(md)
    print(f"wrote {out / 'report.json'}, report.md and {len(pngs)} plots to {out}")
    return report
