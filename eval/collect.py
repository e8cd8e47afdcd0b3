"""One table and one plot from several decode runs that differ in one setting (temperature, draft, dataset).

    python -m eval.collect results/specbench_greedy results/specbench_t1 --by temperature --metric cost_model_speedup \
        --out DIR
    python -m eval.collect results/draft_scale/2layer results/draft_scale/4layer results/draft_scale/6layer --by dir \
        --out results/draft_scale

Each run folder holds decode's summary.json and run.json; `--by` names a run.json field (dotted for nested ones), or
`dir` for the run folder's own name (when the setting that differs is a path, e.g. the draft's weights file).
Writes <out>/collect.json ({method: {value: metrics}}), collect.md (method × value, metric ± spread over prompts)
and collect.png (metric vs value, one line per method). Methods absent from a run are left blank.
argparse, not Hydra: it reads finished run folders (a shell glob of them), loads no model and composes no config.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from utils.cli import UserError, fail


def _field(info: dict, dotted: str):
    cur = info
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(dotted)
        cur = cur[part]
    return cur


def collect(run_dirs: list[Path], by: str, metric: str = "speedup") -> dict:
    table: dict[str, dict] = {}
    values = []
    for d in run_dirs:
        summary_path, info_path = d / "summary.json", d / "run.json"
        if not summary_path.is_file() or not info_path.is_file():
            raise UserError(f"{d} is not a finished decode run (summary.json and run.json missing)")
        try:
            value = d.resolve().name if by == "dir" else _field(json.loads(info_path.read_text()), by)
        except KeyError:
            raise UserError(f"{info_path} has no field '{by}'; pick one of its keys with --by, or --by dir") from None
        values.append(value)
        for method, s in json.loads(summary_path.read_text()).items():
            if method == "target":
                continue
            table.setdefault(method, {})[str(value)] = {
                metric: s.get(metric), "speedup_std": s.get("speedup_std"), "acceptance_rate": s.get("acceptance_rate"),
                "mean_accepted_length": s.get("mean_accepted_length"), "measured_c": s.get("measured_c"),
                "run": str(d)}
    if len({str(v) for v in values}) != len(values):
        raise UserError(f"two runs share {by}={values}; collect runs that differ in --by")
    order = sorted(values, key=lambda v: (isinstance(v, str), v))
    return {"by": by, "metric": metric, "values": [str(v) for v in order], "methods": table}


def write(result: dict, out: Path) -> None:
    from utils.plotting import pyplot

    plt = pyplot()

    out.mkdir(parents=True, exist_ok=True)
    (out / "collect.json").write_text(json.dumps(result, indent=2))
    vals, metric = result["values"], result["metric"]
    lines = ["| method | " + " | ".join(f"{result['by']}={v}" for v in vals) + " |", "|---|" + "---|" * len(vals)]
    for method, cells in result["methods"].items():
        row = []
        for v in vals:
            cell = cells.get(v)
            if not cell or cell.get(metric) is None:
                row.append("")
            elif metric == "speedup" and cell.get("speedup_std") is not None:
                row.append(f"{cell[metric]:.2f} ± {cell['speedup_std']:.2f}")
            else:
                row.append(f"{cell[metric]:.2f}")
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    lines += ["", f"{metric} vs target-only in the same run (± = std of per-prompt speedups)."]
    (out / "collect.md").write_text("\n".join(lines) + "\n")
    numeric = all(_is_number(v) for v in vals)
    xs = [float(v) for v in vals] if numeric else list(range(len(vals)))
    fig, ax = plt.subplots(figsize=(5.8, 3.8))
    for method, cells in result["methods"].items():
        pts = [(x, cells[v][metric]) for x, v in zip(xs, vals) if v in cells and cells[v].get(metric) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    if not numeric:
        ax.set_xticks(xs, vals, rotation=20, ha="right")
    ax.axhline(1.0, color="k", lw=0.7)
    ax.set_xlabel(result["by"])
    ax.set_ylabel(metric)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "collect.png", dpi=120)
    plt.close(fig)


def _is_number(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--by", required=True, help="run.json field that differs between the runs (dotted if nested), or dir (the folder name)")
    ap.add_argument("--metric", default="speedup")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    result = collect(args.runs, args.by, args.metric)
    write(result, args.out)
    print((args.out / "collect.md").read_text())


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        fail(str(err))
