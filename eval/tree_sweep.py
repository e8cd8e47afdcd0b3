"""Accepted length against verified tree size per builder family, and C2T's node saving at equal τ (issue 30).

    python -m eval.tree_sweep traces=FOLDER learned=CKPT [c2t=CKPT] [prompts=500] out_dir=results/trees/sweep

On the same prompts of a `tree` trace, each family is replayed (eval.tree_replay: noise-free greedy rounds on the
recorded trees) at every point of its grid, built as decode builds it (conf/policy + `policy.<name>.*`, the trace's
top-k, max_depth capped at the trace depth):
- `eagle2` with `nodes=N` (EAGLE-2 as published: every level grown, the N most likely nodes by joint verified);
- `learned_tree:CKPT` with the same `nodes=N` (the same growth; the head's P(on path) ranks the nodes instead);
- `c2t:CKPT` over thresholds = quantiles of its head's scores on the trace rows, every level grown (`nodes` = the
  largest N: the threshold alone prunes, as C2T publishes);
- `eagle2_threshold` and `learned_tree_threshold`: C2T's pruning rule on the joint probability (training-free) and
  on the learned head's P (a conditional head's, labels=on_path_given_parent: its product along the path, and the
  thresholds quantiles of that, `path_scores`) — the ablation that separates what a classifier adds from what
  threshold pruning (a tree size that follows the draft's confidence round by round, where a fixed N does not) adds.
A point is (τ = tokens per round, verified nodes per round) as ratios of per-prompt sums (and its cost-model speedup).

Node saving (C2T's measure): at the reference point (eagle2 at N = `reference_nodes`) τ_ref and nodes_ref; a family's
nodes at τ_ref by linear interpolation along its curve (`nodes_at`); saving = 1 − nodes ÷ nodes_ref; null where
τ_ref is outside the curve's range (never extrapolated). Its interval: 95% percentile bootstrap over prompts, paired
(each resample recomputes every point's ratios of sums, the reference and the interpolation). Writes
tree_sweep.json, tree_sweep.md and tree_sweep.png (the curves, the reference marked).
"""

from __future__ import annotations

import json
import time

import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict

from eval.tree_replay import builders, head_scores, open_traces, prompt_sums, replay
from utils.cli import UserError, command, hydra_entry, output_dir
from utils.files import write_text_atomic

FAMILIES = ("eagle2", "eagle2_threshold", "learned_tree", "learned_tree_threshold", "c2t")


def build_one(cfg: DictConfig, spec: str, params: dict, tree: dict, profile):
    """One builder from `spec` with `policy.<name>.*` = params (+ the trace's top-k), through eval.tree_replay's
    `builders` (decode's construction and its depth cap); returns (builder, note or None)."""
    import copy

    name = spec.split(":")[0]
    c = copy.deepcopy(cfg)
    with open_dict(c):
        c.policies = [spec]
        c.policy = OmegaConf.merge(c.get("policy") or {}, {name: {"topk": int(tree.get("topk", 4)), **params}})
    built, notes = builders(c, tree, profile)
    (key, b), = built.items()
    return b, notes.get(key)


def sweep(cfg: DictConfig, cands, tree: dict, profile, scores_of) -> tuple[dict, dict]:
    """{family: [{"param": {...}, "sums": prompt_sums}]} over the grids (points in order of growing nodes; `N` is
    the builder's `nodes` parameter, c2t's `quantile` its threshold's quantile among the head's scores), and notes.
    `scores_of(builder)`: a learned builder's head scores per trace row (eval.tree_replay.head_scores), read once per
    checkpoint."""
    grid = sorted({int(n) for n in cfg.grid.nodes} | {int(cfg.reference_nodes)})
    # family -> (builder spec, knob): a fixed N (every level grown, the N most likely verified) or a threshold on
    # the builder's acceptance estimate (C2T's pruning; on eagle2's joint it is the training-free ablation that tells
    # the classifier's gain from the pruning rule's)
    specs = {"eagle2": ("eagle2", "N"), "eagle2_threshold": ("eagle2", "threshold")}
    if cfg.get("learned"):
        specs["learned_tree"] = (f"learned_tree:{cfg.learned}", "N")
        specs["learned_tree_threshold"] = (f"learned_tree:{cfg.learned}", "threshold")
    if cfg.get("c2t"):
        specs["c2t"] = (f"c2t:{cfg.c2t}", "threshold")
    joints = np.concatenate([np.asarray(t.joint, dtype=float) for c in cands for t in c.trees])
    out, notes = {}, {}
    for fam, (spec, knob) in specs.items():
        b, note = build_one(cfg, spec, {}, tree, profile)
        scores = scores_of(b)
        if knob == "threshold":  # descending thresholds: growing trees
            qs = sorted((float(q) for q in cfg.grid.threshold_quantiles), reverse=True)
            ranked = joints if scores is None else path_scores(b, cands, scores)
            params = [{"threshold": float(np.quantile(ranked, q)), "N": max(grid), "_quantile": q} for q in qs]
        else:
            params = [{"N": n} for n in grid]
        out[fam] = []
        for p in params:
            b, note = build_one(cfg, spec, {"nodes" if k == "N" else k: v for k, v in p.items() if k[0] != "_"},
                                tree, profile)
            desc = f"{fam} " + " ".join(f"{k.lstrip('_')}={v:.4g}" for k, v in p.items())
            out[fam].append({"param": {k.lstrip("_"): v for k, v in p.items()},
                             "sums": prompt_sums(replay(b, cands, profile, scores, desc))})
        if note:
            notes[fam] = note
    return out, notes


def path_scores(builder, cands, scores: np.ndarray) -> np.ndarray:
    """The scores a learned builder's threshold is read against: its head's P per trace row composed along each
    recorded tree's root path as the builder prunes by it (models.features.nodes.compose_path) — the product for a
    conditional head (labels=on_path_given_parent), the P capped by its parent's for an on_path head — over the
    replayed prompts' nodes, so the quantiles are of the quantity the threshold meets."""
    from models.features.nodes import compose_path

    how = "product" if getattr(builder, "conditional", False) else "min"
    return np.concatenate([compose_path(scores[rows], t.parents, how) for c in cands
                           for t, rows in zip(c.trees, c.rows)])


def counts(idx: np.ndarray, n: int) -> np.ndarray:
    """Resampled prompt indices (..., n) as how often each prompt was drawn (..., n): sums over a resample become one
    matrix product, not an (points × resamples × prompts) gather."""
    idx = np.asarray(idx)
    flat = idx.reshape(-1, idx.shape[-1])
    rows = np.arange(len(flat))[:, None] * n
    c = np.bincount((flat + rows).ravel(), minlength=len(flat) * n).reshape(len(flat), n)
    return c.reshape(idx.shape[:-1] + (n,)).astype(float)


def curve(points: list[dict], w: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """τ, nodes, levels per round and cost-model speedup of each point; with prompt weights w (..., n) per resample."""
    def total(key):
        m = np.stack([p["sums"][key] for p in points])  # (points, n)
        return m.sum(-1) if w is None else w @ m.T  # (points,) or (..., points)

    tok, rounds = total("tokens"), total("rounds")
    return {"tau": tok / rounds, "nodes": total("nodes") / rounds, "levels": total("levels") / rounds,
            "speedup": tok / total("cost")}


def nodes_at(tau_ref: float, taus, nodes) -> float | None:
    """The nodes per round a curve needs to reach τ_ref: linear between adjacent points (in order of growing nodes)
    at the first segment that spans τ_ref; None where no segment does (τ_ref outside the curve's range)."""
    for i in range(len(taus) - 1):
        t0, t1 = taus[i], taus[i + 1]
        if min(t0, t1) <= tau_ref <= max(t0, t1):
            if t1 == t0:
                return float(nodes[i])
            return float(nodes[i] + (tau_ref - t0) / (t1 - t0) * (nodes[i + 1] - nodes[i]))
    if len(taus) == 1 and taus[0] == tau_ref:
        return float(nodes[0])
    return None


def tau_at(nodes_ref: float, taus, nodes) -> float | None:
    """The reverse reading (τ at equal verified nodes): the same interpolation with the axes swapped."""
    return nodes_at(nodes_ref, nodes, taus)


def saving(ref: tuple[float, float], c: dict) -> float:
    """1 − (the curve's nodes at τ_ref) ÷ nodes_ref; NaN outside the curve's range."""
    n = nodes_at(ref[0], c["tau"], c["nodes"])
    return float("nan") if n is None else 1.0 - n / ref[1]


def node_saving(curves: dict, ref_idx: int, resamples: int) -> dict:
    """Per family other than eagle2: nodes at the reference τ, the saving and its paired bootstrap interval."""
    from utils.stats import bootstrap_ci

    fams = [f for f in curves if f != "eagle2"]
    point = {f: curve(curves[f]) for f in curves}
    ref = (float(point["eagle2"]["tau"][ref_idx]), float(point["eagle2"]["nodes"][ref_idx]))
    n = len(curves["eagle2"][0]["sums"]["tokens"])

    def stat(idx, axis=-1):
        w = counts(idx, n)
        cs = {f: curve(curves[f], w.reshape(-1, n)) for f in curves}
        out = np.full((len(fams), len(w.reshape(-1, n))), np.nan)
        for b in range(out.shape[1]):
            r = (cs["eagle2"]["tau"][b, ref_idx], cs["eagle2"]["nodes"][b, ref_idx])
            for j, f in enumerate(fams):
                out[j, b] = saving(r, {k: v[b] for k, v in cs[f].items()})
        return out.reshape((len(fams),) + w.shape[:-1])

    cis = None
    if n > 1 and fams:
        import warnings

        from scipy.stats import DegenerateDataWarning

        with warnings.catch_warnings():  # NaN resamples (τ_ref outside a curve): reported below as no interval
            warnings.simplefilter("ignore", DegenerateDataWarning)
            cis = bootstrap_ci(n, stat, n_resamples=resamples, method="percentile")
    res = {}
    for j, f in enumerate(fams):
        nodes = nodes_at(ref[0], point[f]["tau"], point[f]["nodes"])
        ci = cis[j] if cis and all(np.isfinite(cis[j])) else None
        note = None
        if nodes is None:
            note = (f"τ_ref {ref[0]:.3f} is outside {f}'s curve (τ {point[f]['tau'].min():.3f} .. "
                    f"{point[f]['tau'].max():.3f}): widen its grid; no extrapolation")
        elif ci is None and cis:
            note = "τ_ref fell outside the curve in some resamples: no interval (widen the grid)"
        res[f] = {"tau": ref[0], "nodes": nodes, "saving": None if nodes is None else 1.0 - nodes / ref[1],
                  "saving_ci": ci, "tau_at_equal_nodes": tau_at(ref[1], point[f]["tau"], point[f]["nodes"]),
                  "note": note}
    return {"reference": {"tau": ref[0], "nodes": ref[1]}, "families": res}


def table(curves: dict) -> dict:
    """The JSON curves: each point's parameters and its τ, nodes, levels and speedup."""
    out = {}
    for f, pts in curves.items():
        c = curve(pts)
        out[f] = [{**p["param"], **{k: float(c[k][i]) for k in c}, "rounds": int(p["sums"]["rounds"].sum()),
                   "tokens": int(p["sums"]["tokens"].sum())} for i, p in enumerate(pts)]
    return out


def markdown(res: dict) -> str:
    s, ref = res["settings"], res["node_saving"]["reference"]
    lines = [f"# Accepted length vs verified nodes: {s['pair']}, {s['prompts']} prompts of {s['traces']}", "",
             f"`{s['command']}`; greedy, noise-free replay (eval/tree_sweep.py); trees of top-{s['tree']['topk']} "
             f"to depth {s['tree']['depth']}. Reference: eagle2 at N={s['reference_nodes']}: τ {ref['tau']:.3f}, "
             f"{ref['nodes']:.2f} verified nodes per round.", "",
             "| family | nodes at τ_ref | node saving | 95% CI | τ at equal nodes | note |",
             "|---|---|---|---|---|---|"]
    f3 = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    for f, r in res["node_saving"]["families"].items():
        ci = "–" if r["saving_ci"] is None else f"[{r['saving_ci'][0]:.3f}, {r['saving_ci'][1]:.3f}]"
        lines.append(f"| {f} | {f3(r['nodes'])} | {f3(r['saving'])} | {ci} | {f3(r['tau_at_equal_nodes'])} | "
                     f"{r['note'] or ''} |")
    lines += ["", "| family | setting | τ | verified nodes/round | draft levels/round | cost-model speedup |",
              "|---|---|---|---|---|---|"]
    for f, pts in res["curves"].items():
        for p in pts:
            setting = (f"threshold {p['threshold']:.4g} (q{p['quantile']:g})" if "threshold" in p
                       else f"N={p['N']}")
            lines.append(f"| {f} | {setting} | {p['tau']:.3f} | {p['nodes']:.2f} | {p['levels']:.2f} | "
                         f"{p['speedup']:.3f} |")
    return "\n".join(lines) + "\n"


def run(cfg: DictConfig) -> dict:
    if int(cfg.reference_nodes) < 1:
        raise UserError(f"reference_nodes must be ≥ 1, got {cfg.reference_nodes}")
    t = open_traces(cfg)
    folder, ds, manifest, tree, profile, cands = t.folder, t.ds, t.manifest, t.tree, t.profile, t.cands
    curves, notes = sweep(cfg, cands, tree, profile, lambda b: head_scores(b, ds, manifest, folder))
    grid = sorted({int(n) for n in cfg.grid.nodes} | {int(cfg.reference_nodes)})
    res = {"settings": {"command": command("eval.tree_sweep"), "traces": str(folder), "pair": manifest.get("pair_id"),
                        "prompts": len(cands), "tree": tree, "learned": cfg.get("learned"), "c2t": cfg.get("c2t"),
                        "reference_nodes": int(cfg.reference_nodes), "grid": grid,
                        "threshold_quantiles": list(cfg.grid.threshold_quantiles), "resamples": int(cfg.resamples),
                        "interval": "95% percentile bootstrap over prompts, paired across families",
                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
           "curves": table(curves), "node_saving": node_saving(curves, grid.index(int(cfg.reference_nodes)),
                                                               int(cfg.resamples)), "notes": notes}
    out = output_dir(cfg.get("out_dir"))
    write_text_atomic(out / "tree_sweep.json", json.dumps(res, indent=1) + "\n")
    write_text_atomic(out / "tree_sweep.md", markdown(res))
    from eval.plots import accepted_vs_nodes

    ref = res["node_saving"]["reference"]
    accepted_vs_nodes({f: ([p["nodes"] for p in pts], [p["tau"] for p in pts]) for f, pts in res["curves"].items()},
                      out / "tree_sweep.png", (ref["nodes"], ref["tau"], f"eagle2 N={cfg.reference_nodes} (reference)"),
                      title=f"τ vs verified nodes, {len(cands)} prompts")
    print(markdown(res))
    print(f"wrote {out / 'tree_sweep.json'}, tree_sweep.md and tree_sweep.png")
    return res


@hydra_entry("tree_sweep", open_dicts=("policy",))
def main(cfg: DictConfig) -> dict:
    return run(cfg)


if __name__ == "__main__":
    main()
