"""PNG plots for eval reports (matplotlib, headless Agg backend). Each function draws one figure and writes one file.

Curves come as {name: data} so one call overlays several checkpoints (the comparison plots of `python -m eval`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from utils.plotting import pyplot, save_png

plt = pyplot()


def _save(fig, path) -> Path:
    fig.tight_layout()
    return save_png(fig, path, dpi=110)


def roc(curves: dict, path, title: str = "ROC") -> Path:
    """curves: name → (fpr list, tpr list, auroc); `python -m eval` and train's roc.png beside a checkpoint."""
    fig, ax = plt.subplots(figsize=(4.8, 4.4))
    for name, (fpr, tpr, auc) in curves.items():
        ax.plot(fpr, tpr, label=f"{name} (AUROC {auc:.3f})")
    ax.plot([0, 1], [0, 1], "k:", lw=0.8)
    ax.set(xlabel="false positive rate", ylabel="true positive rate (accepted = positive)", title=title)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def pr(curves: dict, path, base_rate: float | None = None, title: str = "Precision-recall") -> Path:
    """curves: name → (recall list, precision list, ap)."""
    fig, ax = plt.subplots(figsize=(4.8, 4.4))
    for name, (recall, precision, ap) in curves.items():
        ax.plot(recall, precision, label=f"{name} (AP {ap:.3f})")
    if base_rate is not None:
        ax.axhline(base_rate, color="k", ls=":", lw=0.8, label=f"base rate {base_rate:.2f}")
    ax.set(xlabel="recall", ylabel="precision", title=title, xlim=(0, 1), ylim=(0, 1.02))
    ax.legend(fontsize=7, loc="lower left")
    return _save(fig, path)


def reliability(curves: dict, path) -> Path:
    """curves: name → (mean predicted prob per bin, observed fraction accepted per bin, ece)."""
    fig, ax = plt.subplots(figsize=(4.8, 4.4))
    ax.plot([0, 1], [0, 1], "k:", lw=0.8, label="perfect calibration")
    for name, (pred, true, ece) in curves.items():
        ax.plot(pred, true, "o-", ms=3, label=f"{name} (ECE {ece:.3f})")
    ax.set(xlabel="predicted acceptance probability", ylabel="observed acceptance rate", title="Reliability diagram",
           xlim=(0, 1), ylim=(0, 1))
    ax.legend(fontsize=7, loc="upper left")
    return _save(fig, path)


def per_position(curves: dict, path, xlabel: str = "position in draft round") -> Path:
    """curves: name → {bucket label: auroc (nan = one class only)}; one line per checkpoint over the buckets."""
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    for name, buckets in curves.items():
        labels = list(buckets)
        ax.plot(range(len(labels)), [buckets[b] for b in labels], "o-", ms=3, label=name)
        ax.set_xticks(range(len(labels)), labels, rotation=45, fontsize=7)
    ax.set(xlabel=xlabel, ylabel="AUROC", title=f"AUROC by {xlabel}")
    ax.legend(fontsize=7)
    return _save(fig, path)


def binned(centers, series: dict, path, xlabel: str, ylabel: str, title: str, counts=None) -> Path:
    """series: name → mean y per bin at `centers`; optional counts drawn as bars on a second axis."""
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    if counts is not None:
        ax2 = ax.twinx()
        width = float(np.diff(centers).min()) * 0.9 if len(centers) > 1 else 0.1
        ax2.bar(centers, counts, width=width, color="0.85", zorder=0)
        ax2.set_ylabel("rows per bin", color="0.5")
        ax.set_zorder(ax2.get_zorder() + 1)
        ax.patch.set_visible(False)
    for name, ys in series.items():
        ax.plot(centers, ys, "o-", ms=3, label=name)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend(fontsize=7)
    return _save(fig, path)


def histogram(values, path, xlabel: str, title: str, quantiles: dict | None = None, bins=50, discrete=False) -> Path:
    """A histogram (density) with optional quantile lines {label: value}."""
    values = np.asarray(values)
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    if discrete and len(values):
        edges = np.arange(values.min(), values.max() + 2) - 0.5
        ax.hist(values, bins=edges, density=True, color="C0")
    else:
        ax.hist(values, bins=bins, density=True, color="C0")
    for label, v in (quantiles or {}).items():
        ax.axvline(v, color="C3", ls="--", lw=0.8)
        ax.text(v, ax.get_ylim()[1] * 0.95, label, rotation=90, fontsize=7, va="top", ha="right")
    ax.set(xlabel=xlabel, ylabel="density", title=title)
    return _save(fig, path)


def sorted_curves(series: dict, path, title: str, ylabel: str = "acceptance probability") -> Path:
    """SVIP Fig. 4: each series drawn over tokens sorted by the first series (the actual acceptance)."""
    names = list(series)
    order = np.argsort(np.asarray(series[names[0]]))
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    x = np.arange(len(order))
    for name in names:
        ax.plot(x, np.asarray(series[name])[order], lw=0.8, label=name)
    ax.set(xlabel="token (sorted by actual acceptance)", ylabel=ylabel, title=title, ylim=(-0.05, 1.05))
    ax.legend(fontsize=7)
    return _save(fig, path)


def speedup_prediction(rows: list[dict], path, measured: dict | None = None, title: str = "Predicted speedup") -> Path:
    """eval.theory.speedup_curve rows (Leviathan and eq. 12–13 models) per γ, with measured {γ: speedup} points."""
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    g = [r["gamma"] for r in rows]
    ax.plot(g, [r["leviathan"] for r in rows], "o-", ms=3, label="Leviathan (1−α^{γ+1})/((1−α)(γc+1))")
    ax.plot(g, [r["latency_model"] for r in rows], "s--", ms=3, label="latency model eq. 12–13")
    if measured:
        ax.plot(list(measured), list(measured.values()), "k*", ms=8, label="measured")
    ax.axhline(1.0, color="k", ls=":", lw=0.8)
    ax.set(xlabel="draft length γ", ylabel="speedup over target-only", title=title)
    ax.legend(fontsize=7)
    return _save(fig, path)


def accepted_vs_nodes(curves: dict, path, reference: tuple | None = None,
                      title: str = "Accepted length vs verified tree size") -> Path:
    """C2T's and EAGLE-2's figure: curves name → (verified nodes per round list, τ list), one line per builder family
    (eval.tree_sweep); `reference` = (nodes, τ, label), the operating point the node saving is read at."""
    fig, ax = plt.subplots(figsize=(5.6, 4.2))
    for name, (nodes, tau) in curves.items():
        ax.plot(nodes, tau, "o-", ms=3, label=name)
    if reference is not None:
        n, t, label = reference
        ax.plot([n], [t], "k*", ms=10, label=label)
        ax.axhline(t, color="k", ls=":", lw=0.8)
    ax.set(xlabel="verified nodes per round", ylabel="τ (tokens per round)", title=title)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def speedup_bars(rows: dict, path, ylabel: str = "speedup vs target-only\n(95% bootstrap CI over prompts)",
                 title: str | None = None) -> Path:
    """rows: name → (speedup, [low, high] or None); one bar per method with its interval, 1.0 dashed."""
    names = list(rows)
    fig, ax = plt.subplots(figsize=(0.9 * len(names) + 2, 3.6))
    vals = [rows[k][0] for k in names]
    err = [[max(0.0, v - rows[k][1][0]) if rows[k][1] else 0.0 for k, v in zip(names, vals)],
           [max(0.0, rows[k][1][1] - v) if rows[k][1] else 0.0 for k, v in zip(names, vals)]]
    ax.bar(range(len(names)), vals, yerr=err, capsize=4,
           color=["#999" if k.startswith("chain_") else "#4477aa" for k in names])
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set(ylabel=ylabel, title=title)
    return _save(fig, path)
