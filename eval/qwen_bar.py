"""`python -m eval.qwen_bar`: issue 54's numbers about the 1.5B pair (Qwen2.5-Coder-1.5B-Instruct with its own
EAGLE-3 draft) gathered from the runs that measure them, beside the same numbers on the 135M pair, as
results/qwen_eagle/bar.json (and bar.md). Nothing here times anything.

    python -m eval.qwen_bar [qwen_bar.large.mbpp=...] [qwen_bar.small.mbpp=...] ...

Each scale names its runs (conf/qwen_bar.yaml): `mbpp` and `humaneval` (python -m decode folders), `heads`
(python -m eval.bar's bar.json on the pair's chain traces: the learned head against the calibrated expected-value
rule in the replay) and `trees` (python -m eval.tree_replay's tree_replay.json: the best tree against the best
chain in the replay). The bar's fields are the large scale's:

    {"prompts", "c", "tau_best", "mbpp_best", "humaneval_best", "replay_prompts", "learned_vs_ev_replay",
     "learned_vs_ev_ci", "tree_vs_chain_replay"}

plus `scales`: both pairs' numbers with 95% intervals (the best method's speedup over target-only, BCa bootstrap
over prompts, tokens/s of the method and of target-only on the same prompts resampled together). "Best" is the
fastest method on the clock in that run. A field whose run is missing is null; `missing` names the command.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from eval.bar import per_prompt
from utils.cli import UserError, hydra_entry
from utils.files import read_json, write_report
from utils.stats import bootstrap_ci


def best_run(folder: Path | None, n_resamples: int = 4000) -> dict | None:
    """A decode folder's fastest method: its speedup with a 95% interval over prompts, c, mean accepted length,
    losslessness, and the run's machine, dtype and date; None when the folder holds no run."""
    summary = None if folder is None else read_json(folder / "summary.json")
    if summary is None:
        return None
    rows = {k: s for k, s in summary.items() if k != "target" and isinstance(s, dict) and "speedup" in s}
    if not rows or "target" not in summary:
        raise UserError(f"{folder}/summary.json has no target-only row and method rows; rerun its python -m decode")
    key = max(rows, key=lambda k: rows[k]["speedup"])
    ids, pp = per_prompt(folder / "prompts.jsonl", [key, "target"], ("new_tokens", "wall_s"))

    def stat(idx, axis=-1):
        tps = {m: pp[m]["new_tokens"][idx].sum(-1) / pp[m]["wall_s"][idx].sum(-1) for m in (key, "target")}
        return np.stack([tps[key] / tps["target"]])

    run = read_json(folder / "run.json") or {}
    s = rows[key]
    return {"method": key, "speedup": s["speedup"], "speedup_ci": bootstrap_ci(len(ids), stat, n_resamples)[0],
            "prompts": len(ids), "c": s.get("measured_c"), "tau": s.get("mean_accepted_length"),
            "lossless": s.get("lossless"), "lossless_up_to_ties": s.get("lossless_up_to_ties"),
            "machine": run.get("machine"), "dtype": run.get("dtype"), "date": run.get("date"),
            "draft": (s.get("draft_weights") or {}).get("fingerprint")}  # which weights file, by content


def scale(runs: DictConfig, n_resamples: int) -> dict:
    """One pair's row of the comparison: best MBPP and HumanEval runs, the heads' replay and the trees' replay."""
    def path(key):
        v = runs.get(key)
        return None if v in (None, "") else Path(str(v))

    heads, trees = (None if path(k) is None else read_json(path(k)) for k in ("heads", "trees"))
    replay = (heads or {}).get("replay") or {}
    tvc = (trees or {}).get("best_tree_vs_chain") or {}
    return {"pair": runs.get("pair"), "mbpp": best_run(path("mbpp"), n_resamples),
            "humaneval": best_run(path("humaneval"), n_resamples),
            "learned_vs_ev_replay": replay.get("ratio"), "learned_vs_ev_ci": replay.get("ratio_ci"),
            "replay_prompts": replay.get("prompts"), "replay_methods": [replay.get("best_learned"),
                                                                         replay.get("best_training_free")],
            "tree_vs_chain_replay": tvc.get("value"), "tree_vs_chain_ci": tvc.get("ci"),
            "tree_vs_chain_methods": [(trees or {}).get("best_tree"), (trees or {}).get("best_chain")]}


def missing(name: str, runs: DictConfig, row: dict) -> list[str]:
    """What fills each empty part of a scale's row (the study's commands for it)."""
    out = []
    for key, what in (("mbpp", "python -m decode +experiment=study/qwen_eagle"),
                      ("humaneval", "python -m decode +experiment=study/qwen_eagle dataset=humaneval ..."),
                      ("heads", "python -m eval.bar on the pair's chain traces and wall run"),
                      ("trees", "python -m eval.tree_replay on the pair's tree traces")):
        empty = row[key] is None if key in ("mbpp", "humaneval") else not Path(str(runs.get(key) or "")).is_file()
        if empty:
            out.append(f"{name} {key}: {runs.get(key)} ({what})")
    return out


def gather(cfg: DictConfig) -> dict:
    n = int(cfg.n_resamples)
    large, small = scale(cfg.large, n), scale(cfg.small, n)
    m, h = large["mbpp"] or {}, large["humaneval"] or {}
    return {"prompts": m.get("prompts"), "c": m.get("c"), "tau_best": m.get("tau"), "mbpp_best": m.get("speedup"),
            "humaneval_best": h.get("speedup"), "replay_prompts": large["replay_prompts"],
            "learned_vs_ev_replay": large["learned_vs_ev_replay"], "learned_vs_ev_ci": large["learned_vs_ev_ci"],
            "tree_vs_chain_replay": large["tree_vs_chain_replay"],
            "scales": {"large": large, "small": small},
            "missing": missing("large", cfg.large, large) + missing("small", cfg.small, small)}


def _fmt(x, ci=None, fmt="{:.2f}") -> str:
    if x is None:
        return "—"
    return fmt.format(x) + ("" if not ci else " [" + ", ".join(fmt.format(v) for v in ci) + "]")


def markdown(res: dict) -> str:
    rows = [("MBPP best speedup", lambda s: _fmt((s["mbpp"] or {}).get("speedup"), (s["mbpp"] or {}).get("speedup_ci"))),
            ("its method", lambda s: f"`{(s['mbpp'] or {}).get('method', '—')}`"),
            ("its c", lambda s: _fmt((s["mbpp"] or {}).get("c"), fmt="{:.3f}")),
            ("its mean accepted length", lambda s: _fmt((s["mbpp"] or {}).get("tau"))),
            ("HumanEval best speedup",
             lambda s: _fmt((s["humaneval"] or {}).get("speedup"), (s["humaneval"] or {}).get("speedup_ci"))),
            ("learned head ÷ expected value (replay)",
             lambda s: _fmt(s["learned_vs_ev_replay"], s["learned_vs_ev_ci"], "{:.3f}")),
            ("best tree ÷ best chain (replay)",
             lambda s: _fmt(s["tree_vs_chain_replay"], s["tree_vs_chain_ci"], "{:.3f}"))]
    large, small = res["scales"]["large"], res["scales"]["small"]
    runs = [r for r in (small["mbpp"], large["mbpp"]) if r]
    lines = ["The two scales side by side (95% BCa intervals over prompts; each run's machine, dtype and date below).",
             "", f"| | {small['pair']} | {large['pair']} |", "|---|---|---|"]
    lines += [f"| {label} | {cell(small)} | {cell(large)} |" for label, cell in rows]
    lines += ["", "MBPP runs: " + "; ".join(f"{r['prompts']} prompts, {r['machine']}, {r['dtype']}, {r['date']}"
                                             + (f", draft {r['draft']}" if r.get("draft") else "") for r in runs)]
    if res["missing"]:
        lines += ["", "Missing: " + "; ".join(res["missing"])]
    return "\n".join(lines) + "\n"


@hydra_entry("qwen_bar")
def main(cfg: DictConfig) -> None:
    c = cfg.qwen_bar
    res = gather(c)
    if res["scales"]["large"]["mbpp"] is None:
        raise UserError(f"no decode run at {c.large.mbpp}; run python -m decode +experiment=study/qwen_eagle first")
    print(write_report(Path(str(c.out)), "bar", res, markdown(res)))


if __name__ == "__main__":
    main()
