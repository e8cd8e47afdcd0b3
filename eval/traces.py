"""`python -m eval.traces`: the statistics behind the papers, measured on one trace folder.

    python -m eval.traces traces=DIR [out_dir=DIR] [labels=greedy_match] [svip_c=0.15]
    python -m eval.traces pair=smollm2_135m dataset=mbpp trace=target_ar split=test     # folder from the config

Writes `trace_stats.json`, `trace_stats.md` and PNGs into out_dir (default: the Hydra run dir):
- SVIP Fig. 2: draft entropy H_q vs acceptance — Pearson/Spearman correlation and a binned plot. Three acceptance
  notions, all from stored columns: min(1, p(x)/q(x)) for the drafted token x (the exact sampling verifier's accept
  probability; meaningful when x was sampled from q), 1 − TVD(p, q) (the expected acceptance of a fresh draw, SVIP
  eq. 3) and the greedy match 1[x = argmax p]. Bottom panel: accepted length of each oracle round vs the round's
  mean entropy.
- SVIP Fig. 3: histogram and quantiles of H_{q,p}/H_q, H_{q,p} = −Σ q log p the cross-entropy.
- SVIP Fig. 4: actual acceptance 1 − TVD vs the Pinsker bound 1 − √(½ KL(q‖p)), KL = H_{q,p} − H_q, vs the entropy
  estimate 1 − √(c·H_q) (c = `svip_c`; with H_{q,p} available also c fitted as median((H_{q,p}/H_q − 1)/2), since
  ½KL ≈ ½(r − 1)H_q for a constant ratio r).
- Item 4: the speedup per constant γ predicted from α measured here and a cost ratio c (`cost_ratio`), by Leviathan's
  improvement factor and by the eq. 12–13 latency model of "How speculative can SD be?" (eval.theory).
- DISCO App. A: oracle speculation length = accepted tokens per round, rounds cut at each mismatch under `labels`
  (greedy_match = DISCO's zero-temperature oracle): mean, std, histogram. The last round of a continuation ends with
  the continuation, not with a mismatch (censored); it is counted, and the number of such rounds is reported.

Figures 3 and 4's Pinsker curve need the per-row cross-entropy H_{q,p}, stored as column `cross_entropy` (nats).
Traces without it get every other statistic, and the report names the missing column.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf
from scipy import stats

from eval import plots
from utils.cli import UserError, hydra_entry, output_dir

XENT = "cross_entropy"
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def _col(ds, name) -> np.ndarray:
    return np.asarray(ds[name])


def _names(ds) -> list[str]:
    return list(ds.column_names) if hasattr(ds, "column_names") else list(ds)


def _starts(ds) -> np.ndarray:
    """First row of each continuation (a new prompt_id or kind, or the position not increasing)."""
    from models.features.trace import continuation_starts

    return continuation_starts({k: _col(ds, k) for k in ("position", "prompt_id", "kind") if k in _names(ds)})


def _corr(x, y) -> dict:
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return {"pearson": math.nan, "spearman": math.nan, "n": int(len(x))}
    return {"pearson": float(stats.pearsonr(x, y)[0]), "spearman": float(stats.spearmanr(x, y)[0]), "n": int(len(x))}


def _binned_means(x, ys: dict, bins: int) -> dict:
    """Equal-count bins of x (quantile edges, so sparse high-entropy tails do not make noisy bins)."""
    edges = np.unique(np.quantile(x, np.linspace(0, 1, bins + 1)))
    if len(edges) < 2:
        edges = np.array([x.min(), x.max() + 1e-9])
    idx = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, len(edges) - 2)
    count = np.bincount(idx, minlength=len(edges) - 1)
    keep = count > 0
    centers = np.array([x[idx == b].mean() if count[b] else math.nan for b in range(len(edges) - 1)])
    out = {"centers": centers[keep].tolist(), "count": count[keep].tolist()}
    for name, y in ys.items():
        out[name] = (np.bincount(idx, weights=y, minlength=len(edges) - 1)[keep] / count[keep]).tolist()
    return out


def oracle_rounds(accepted: np.ndarray, starts: np.ndarray, entropy: np.ndarray | None = None) -> dict:
    """Rounds cut after each rejected row and at each continuation start: per round the accepted count (oracle SL),
    whether it ended in a rejection (else censored by the end of the continuation), and its mean entropy."""
    n = len(accepted)
    if n == 0:
        return {"length": np.zeros(0, int), "complete": np.zeros(0, bool), "entropy": np.zeros(0)}
    new = np.zeros(n, dtype=bool)
    new[0] = True
    new[1:] = starts[1:] | ~accepted[:-1]
    rid = np.cumsum(new) - 1
    nr = int(rid[-1]) + 1
    length = np.bincount(rid, weights=accepted.astype(float), minlength=nr).astype(int)
    last = np.r_[np.nonzero(new)[0][1:] - 1, n - 1]
    complete = ~accepted[last]
    ent = np.bincount(rid, weights=entropy, minlength=nr) / np.bincount(rid, minlength=nr) if entropy is not None else None
    return {"length": length, "complete": complete, "entropy": ent}


def _oracle_sl(ds, labels_cfg, h):
    """DISCO App. A's oracle speculation length (each round drafts up to its first rejection under `labels_cfg`) and
    SVIP Fig. 2 (bottom)'s round entropy vs accepted length: (summary, correlation, lengths, round entropies)."""
    from data_gen.labels import make_labels

    accepted = make_labels(ds, labels_cfg) >= 0.5
    rounds = oracle_rounds(accepted, _starts(ds), h)
    lengths = rounds["length"]
    summary = {
        "labels": labels_cfg.name,
        "rounds": int(len(lengths)),
        "censored_rounds": int((~rounds["complete"]).sum()),
        "mean": float(lengths.mean()) if len(lengths) else math.nan,
        "std": float(lengths.std()) if len(lengths) else math.nan,
        "mean_complete_only": float(lengths[rounds["complete"]].mean()) if rounds["complete"].any() else math.nan,
        "quantiles": {str(k): float(np.quantile(lengths, k)) for k in QUANTILES} if len(lengths) else {},
        "histogram": {int(k): int(v) for k, v in zip(*np.unique(lengths, return_counts=True))},
    }
    corr = _corr(rounds["entropy"], lengths.astype(float)) if len(lengths) else {}
    return summary, corr, lengths, rounds["entropy"]


def _xent_bounds(ds, names, h, beta, out: dict, raw: dict, bounds: dict, curves: dict) -> None:
    """SVIP Fig. 4: the cross-entropy ratio H_(q,p)/H_q and Pinsker's bound 1 − √(KL/2) on 1 − TVD, with the SVIP
    constant c fitted from the ratio — from the trace column XENT where the traces have it (filled into the dicts)."""
    if XENT in names:
        hqp = _col(ds, XENT).astype(np.float64)
        ok = h > 1e-6
        ratio = hqp[ok] / h[ok]
        out["xent_ratio"] = {
            "rows": int(ok.sum()),
            "quantiles": {str(k): float(np.quantile(ratio, k)) for k in QUANTILES} if ok.any() else {},
            "mean": float(ratio.mean()) if ok.any() else math.nan,
            "fraction_in_1.0_1.3": float(((ratio >= 1.0) & (ratio <= 1.3)).mean()) if ok.any() else math.nan,
        }
        raw["xent_ratio"] = ratio
        kl = np.clip(hqp - h, 0.0, None)
        pinsker = 1.0 - np.sqrt(0.5 * kl)
        curves["Pinsker 1-sqrt(KL/2)"] = pinsker
        c_fit = float(np.median((ratio - 1.0) / 2.0)) if ok.any() else math.nan
        bounds.update({
            "pinsker_mean": float(pinsker.mean()),
            "pinsker_violations": float((pinsker > beta + 1e-4).mean()),  # must be ~0: Pinsker is a theorem
            "pinsker_mae": float(np.abs(pinsker - beta).mean()),
            "c_fitted": c_fit,
        })
        if math.isfinite(c_fit) and c_fit > 0:
            fitted = 1.0 - np.sqrt(c_fit * h)
            curves[f"entropy estimate, fitted c={c_fit:.3f}"] = fitted
            bounds["entropy_estimate_fitted_mae"] = float(np.abs(fitted - beta).mean())
    else:
        out["missing_columns"].append(XENT)
        out["xent_ratio"] = {"note": f"needs trace column '{XENT}' = H_(q,p) = -sum q log p (nats)"}


def trace_statistics(ds, labels_cfg: DictConfig | None = None, svip_c: float = 0.15, bins: int = 20) -> dict:
    """All of item 2's numbers from trace columns (a `datasets.Dataset` or a dict of arrays); plots use `raw`."""

    labels_cfg = labels_cfg if labels_cfg is not None else OmegaConf.create({"name": "greedy_match"})
    names = _names(ds)
    need = ["position", "draft_token", "target_token", "q_draft", "p_draft", "tvd", "draft_entropy"]
    missing = [c for c in need if c not in names]
    if missing:
        raise UserError(f"traces lack column(s) {missing}; regenerate them with this code's data_gen")
    h = _col(ds, "draft_entropy").astype(np.float64)
    q = _col(ds, "q_draft").astype(np.float64)
    p = _col(ds, "p_draft").astype(np.float64)
    tv = _col(ds, "tvd").astype(np.float64)
    greedy = (_col(ds, "draft_token") == _col(ds, "target_token")).astype(np.float64)
    accept_prob = np.minimum(1.0, p / np.maximum(q, 1e-30))
    beta = 1.0 - tv
    out: dict = {"rows": int(len(h)), "missing_columns": []}
    raw: dict = {}

    # SVIP Fig. 2 (top): entropy vs acceptance
    acc = {"min(1,p/q)": accept_prob, "1-TVD": beta, "greedy match": greedy}
    out["entropy_vs_acceptance"] = {name: _corr(h, y) for name, y in acc.items()}
    out["entropy_binned"] = _binned_means(h, acc, bins) if len(h) else {}

    # DISCO App. A oracle SL, and SVIP Fig. 2 (bottom): accepted length vs entropy per round
    out["oracle_sl"], out["round_entropy_vs_length"], lengths, round_entropy = _oracle_sl(ds, labels_cfg, h)
    raw["round_length"], raw["round_entropy"] = lengths, round_entropy

    # SVIP Fig. 3 and Fig. 4
    est = 1.0 - np.sqrt(svip_c * h)
    curves = {"actual 1-TVD": beta, f"entropy estimate 1-sqrt({svip_c:g}·H_q)": est}
    bounds = {"c": svip_c, "actual_mean": float(beta.mean()) if len(beta) else math.nan,
              "entropy_estimate_mean": float(est.mean()) if len(est) else math.nan,
              "entropy_estimate_below_actual": float((est <= beta).mean()) if len(est) else math.nan,
              "entropy_estimate_mae": float(np.abs(est - beta).mean()) if len(est) else math.nan}
    _xent_bounds(ds, names, h, beta, out, raw, bounds, curves)
    out["acceptance_bounds"] = bounds
    raw["bound_curves"] = curves
    return {"stats": out, "raw": raw}


def speedup_prediction(stats: dict, sampled: bool, cost_ratio: float, max_gamma: int = 10) -> dict:
    """Item 4 on these traces: α measured here, cost_ratio given (decode measures it), predicted speedup per
    constant γ from both models in eval.theory, and Leviathan's best γ. α = the greedy match rate for greedy
    target_ar traces (greedy verification), else mean 1 − TVD (exact sampling's acceptance; interleaved traces draw
    x ~ q)."""
    from eval import theory

    b = stats["entropy_binned"]
    if not b.get("count"):
        return {}
    w = np.asarray(b["count"], dtype=float)
    key = "1-TVD" if sampled else "greedy match"
    alpha = float(np.dot(w, b[key]) / w.sum())
    g, f = theory.best_gamma(alpha, cost_ratio)
    return {"alpha": alpha, "alpha_from": key, "c": cost_ratio, "best_gamma": g, "best_speedup": f,
            "per_gamma": theory.speedup_curve(alpha, cost_ratio, range(1, max_gamma + 1))}


def write_plots(result: dict, out_dir: Path, max_points: int = 3000) -> list[Path]:
    """PNG files for `trace_statistics` output."""
    s, raw = result["stats"], result["raw"]
    written = []
    b = s.get("entropy_binned") or {}
    if b.get("centers"):
        series = {k: v for k, v in b.items() if k not in ("centers", "count")}
        written.append(plots.binned(b["centers"], series, out_dir / "entropy_vs_acceptance.png", "draft entropy H_q (nats)",
                                    "mean acceptance", "SVIP Fig. 2: entropy vs acceptance", counts=b["count"]))
    if len(raw["round_length"]):
        lengths, ent = raw["round_length"], raw["round_entropy"]
        rb = _binned_means(ent, {"accepted length": lengths.astype(float)}, 15)
        written.append(plots.binned(rb["centers"], {"accepted length": rb["accepted length"]},
                                    out_dir / "entropy_vs_round_length.png", "mean draft entropy of the round (nats)",
                                    "accepted tokens in round", "SVIP Fig. 2 (bottom)", counts=rb["count"]))
        q = s["oracle_sl"]["quantiles"]
        written.append(plots.histogram(lengths, out_dir / "oracle_sl_hist.png", "oracle speculation length",
                                       f"DISCO App. A: mean {s['oracle_sl']['mean']:.2f}, std {s['oracle_sl']['std']:.2f}",
                                       quantiles={"median": q.get("0.5", 0)}, discrete=True))
    if "xent_ratio" in raw and len(raw["xent_ratio"]):
        r = raw["xent_ratio"]
        qs = s["xent_ratio"]["quantiles"]
        hi = np.quantile(r, 0.99)
        written.append(plots.histogram(r[r <= hi], out_dir / "xent_ratio_hist.png", "H_(q,p) / H_q",
                                       "SVIP Fig. 3 (≤ 99th percentile)", quantiles={f"q{k}": v for k, v in qs.items()}))
    curves = raw["bound_curves"]
    n = len(next(iter(curves.values())))
    if n:
        pick = np.random.default_rng(0).choice(n, size=min(n, max_points), replace=False)
        written.append(plots.sorted_curves({k: np.asarray(v)[pick] for k, v in curves.items()},
                                           out_dir / "acceptance_bounds.png", "SVIP Fig. 4: acceptance vs bounds"))
    return written


def markdown(stats: dict, source: str) -> str:
    """A short Markdown summary of `trace_statistics`."""
    lines = [f"# Trace statistics: {source}", "", f"rows: {stats['rows']}", "",
             "| acceptance | Pearson(H_q, ·) | Spearman(H_q, ·) |", "|---|---|---|"]
    for name, c in stats["entropy_vs_acceptance"].items():
        lines.append(f"| {name} | {c['pearson']:.3f} | {c['spearman']:.3f} |")
    o = stats["oracle_sl"]
    lines += ["", f"oracle SL ({o['labels']}): mean {o['mean']:.2f}, std {o['std']:.2f} over {o['rounds']} rounds "
              f"({o['censored_rounds']} censored by the continuation end); quantiles {o['quantiles']}"]
    xr = stats["xent_ratio"]
    lines.append("H_(q,p)/H_q: " + (json.dumps(xr["quantiles"]) if "quantiles" in xr else xr["note"]))
    lines.append("acceptance bounds: " + json.dumps({k: round(v, 4) for k, v in stats["acceptance_bounds"].items()}))
    sp = stats.get("speedup_prediction")
    if sp:
        lines += ["", f"predicted speedup, α = {sp['alpha']:.3f} ({sp['alpha_from']}), c = {sp['c']:g}: best γ = "
                  f"{sp['best_gamma']} ({sp['best_speedup']:.2f}x, Leviathan)", "",
                  "| γ | E[tokens/round] | Leviathan | latency model eq. 12-13 |", "|---|---|---|---|"]
        lines += [f"| {r['gamma']} | {r['tokens_per_round']:.2f} | {r['leviathan']:.3f} | {r['latency_model']:.3f} |"
                  for r in sp["per_gamma"]]
    if stats["missing_columns"]:
        lines.append(f"missing columns (add to data_gen for the full report): {stats['missing_columns']}")
    return "\n".join(lines) + "\n"


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return None if not math.isfinite(float(obj)) else float(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def resolve_folder(cfg: DictConfig, split: str) -> Path:
    """`traces=DIR` when given, else the folder data_gen writes for cfg.pair × dataset × trace × split."""
    if cfg.get("traces"):
        folder = Path(str(cfg.traces))
        if not folder.exists():
            raise UserError(f"trace folder {folder} does not exist; make it with `python -m data_gen` or fix traces=")
        return folder
    from data_gen.store import trace_folder

    return trace_folder(cfg, split)


def run(cfg: DictConfig) -> dict:
    from data_gen.store import load_traces

    folder = resolve_folder(cfg, str(cfg.split))
    ds, manifest = load_traces(folder)
    result = trace_statistics(ds, cfg.labels, float(cfg.svip_c), int(cfg.bins))
    stats = result["stats"]
    stats["traces"] = str(folder)
    stats["pair_id"] = manifest.get("pair_id")
    stats["temperature"] = manifest.get("temperature")
    sampled = manifest.get("trace_kind") == "interleaved" or float(manifest.get("temperature") or 0.0) > 0
    stats["speedup_prediction"] = speedup_prediction(stats, sampled, float(cfg.cost_ratio))
    out = output_dir(cfg.get("out_dir"))
    out.mkdir(parents=True, exist_ok=True)
    written = write_plots(result, out)
    if stats["speedup_prediction"]:
        written.append(plots.speedup_prediction(stats["speedup_prediction"]["per_gamma"], out / "speedup_prediction.png",
                                                title=f"α={stats['speedup_prediction']['alpha']:.2f}, c={cfg.cost_ratio}"))
    (out / "trace_stats.json").write_text(json.dumps(_jsonable(stats), indent=2))
    (out / "trace_stats.md").write_text(markdown(stats, str(folder)))
    print(markdown(stats, str(folder)))
    print(f"wrote {out / 'trace_stats.json'} and {len(written)} plots to {out}")
    return stats


@hydra_entry("eval_traces")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
