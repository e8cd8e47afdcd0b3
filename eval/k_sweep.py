"""Speedup vs constant draft length, measured next to the prediction ("How speculative can SD be?", Leviathan et al.).

    python -m eval.k_sweep results/k_sweep      (the out_dir of `python -m decode +experiment=study/k_sweep`)

Reads the sweep's summary.json / prompts.jsonl / run.json and writes k_sweep.json, k_sweep.md and k_sweep.png there.
α is measured once for the whole sweep: every verified drafted position of every K is one Bernoulli trial (position j
of a round is verified when positions < j were accepted; `decode.metrics.per_position`), α̂ = accepted ÷ verified —
the i.i.d.-acceptance model the predictions assume. c is the sweep's measured draft step ÷ target step. Predictions
come from `eval.theory.speedup_curve` (Leviathan E[N+1]/(Kc+1) and the paper's per-round latency model); the gap
between them and the measured speedup is the part the models leave out: on a CPU a verification pass over K+1 tokens
costs more than one target step, and acceptance is not i.i.d. (per-position acceptance is in summary.json).
argparse, not Hydra: its one input is a finished sweep folder; there is no model or config to compose.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from decode.metrics import per_position
from eval.theory import speedup_curve
from utils.cli import UserError, fail
from utils.files import read_jsonl

KEY = re.compile(r"^(?P<name>[^\[]+)\[k=(?P<k>\d+)\]$")


def analyse(run_dir: Path) -> dict:
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise UserError(f"{summary_path} not found; run `python -m decode +experiment=study/k_sweep out_dir={run_dir}`")
    summary = json.loads(summary_path.read_text())
    sweep = {int(m["k"]): key for key in summary if (m := KEY.match(key))}
    if not sweep:
        raise UserError(f"{summary_path} has no `<policy>[k=K]` rows; it must come from decode mode=sweep over k")
    rounds = []
    for row in read_jsonl(run_dir / "prompts.jsonl"):
        if row["method"] in sweep.values():
            rounds += [tuple(r) for r in row["rounds"]]
    verified, accepted = per_position(rounds)
    alpha = sum(accepted) / sum(verified)
    cost_ratio = float(summary["target"]["measured_c"])
    ks = sorted(sweep)
    pred = {r["gamma"]: r for r in speedup_curve(alpha, cost_ratio, ks)}
    rows = []
    for k in ks:
        s = summary[sweep[k]]
        rows.append({"k": k, "speedup": s["speedup"], "speedup_std": s["speedup_std"],
                     "cost_model_speedup": s["cost_model_speedup"], "mean_accepted_length": s["mean_accepted_length"],
                     "predicted_tokens_per_round": pred[k]["tokens_per_round"],
                     "predicted_leviathan": pred[k]["leviathan"], "predicted_latency_model": pred[k]["latency_model"]})
    best_measured = max(rows, key=lambda r: r["speedup"])["k"]
    best_predicted = max(rows, key=lambda r: r["predicted_leviathan"])["k"]
    return {"alpha": alpha, "c": cost_ratio, "verified_positions": sum(verified), "rows": rows,
            "best_k_measured": best_measured, "best_k_predicted": best_predicted,
            "run": json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}}


def write(result: dict, run_dir: Path) -> None:
    from utils.plotting import pyplot

    plt = pyplot()

    (run_dir / "k_sweep.json").write_text(json.dumps(result, indent=2))
    lines = [f"α̂ = {result['alpha']:.3f} (pooled over {result['verified_positions']} verified positions), "
             f"c = {result['c']:.3f}; best K measured {result['best_k_measured']}, predicted {result['best_k_predicted']}.",
             "", "| K | speedup | ± | cost-model | tokens/round | predicted tokens/round | predicted (Leviathan) | "
             "predicted (latency model) |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['k']} | {r['speedup']:.2f} | {r['speedup_std']:.2f} | {r['cost_model_speedup']:.2f} | "
                     f"{r['mean_accepted_length']:.2f} | {r['predicted_tokens_per_round']:.2f} | "
                     f"{r['predicted_leviathan']:.2f} | {r['predicted_latency_model']:.2f} |")
    (run_dir / "k_sweep.md").write_text("\n".join(lines) + "\n")
    ks = [r["k"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.errorbar(ks, [r["speedup"] for r in result["rows"]], yerr=[r["speedup_std"] for r in result["rows"]],
                marker="o", capsize=3, label="measured (wall)")
    ax.plot(ks, [r["cost_model_speedup"] for r in result["rows"]], marker="s", label="cost model (measured calls)")
    ax.plot(ks, [r["predicted_leviathan"] for r in result["rows"]], ls="--", label="predicted, Leviathan")
    ax.plot(ks, [r["predicted_latency_model"] for r in result["rows"]], ls=":", label="predicted, latency model")
    ax.axhline(1.0, color="k", lw=0.7)
    ax.set_xlabel("constant draft length K")
    ax.set_ylabel("speedup vs target-only")
    ax.set_title(f"α̂={result['alpha']:.2f}, c={result['c']:.2f}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(run_dir / "k_sweep.png", dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    args = ap.parse_args(argv)
    result = analyse(args.run_dir)
    write(result, args.run_dir)
    print((args.run_dir / "k_sweep.md").read_text())


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        fail(str(err))
