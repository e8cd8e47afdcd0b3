"""A decode run's outputs: the Markdown tables, the plots and the files in `out_dir`.

`prompts.jsonl` (one row per method × prompt; see compact_rows), `summary.json` ({method: metrics}), `summary.md`
(the table), `run.json` (settings, device, measured cost ratio), `speedup.png` (with 95% bootstrap intervals over
prompts), `acceptance_by_position.png`, and for prompts with several tasks (Spec-Bench) `by_task.{json,md}`.
`plots` redraws the two PNGs from summary.json and prompts.jsonl alone (eval.study does, for every decode folder
under results/).
"""

from __future__ import annotations

import json
from pathlib import Path

from utils.files import write_jsonl, write_text_atomic


def _fmt(v, digits=3):
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if v == v else "nan"
    return str(v)


def markdown_table(summary: dict, title: str = "") -> str:
    """summary.md: one row per method, then the approximate methods' quality table."""
    cols = [("tok/s", "tokens_per_s", 1), ("speedup", "speedup", 2), ("±", "speedup_std", 2),
            ("cost-model", "cost_model_speedup", 2), ("accept", "acceptance_rate", 3),
            ("mean acc len", "mean_accepted_length", 2), ("target calls/tok", "target_calls_per_token", 3),
            ("draft calls/tok", "draft_calls_per_token", 3), ("mean K", "mean_draft_length", 2),
            ("policy overhead", "policy_overhead_frac", 4), ("lossless", "lossless", 0),
            ("lossless up to ties", "lossless_up_to_ties", 0)]
    drafters = {s.get("drafter") for k, s in summary.items() if k != "target"}
    if len(drafters) > 1:  # several drafters side by side: each row's c is its drafter's
        cols.insert(4, ("c", "measured_c", 3))
    lines = [f"### {title}" if title else "", "",
             "| method | " + " | ".join(col[0] for col in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for key, s in summary.items():
        name = key + (" (oracle)" if s.get("oracle") else "") + (" (approx.)" if s.get("approximate") else "") + (
            " (transformers)" if s.get("external") else "")
        lines.append(f"| {name} | " + " | ".join(_fmt(s.get(col[1]), col[2]) for col in cols) + " |")
    approx = {k: s for k, s in summary.items() if s.get("approximate")}
    if approx:
        lines += ["", "| approximate method | target calls saved | unchecked tokens | TVD est. | token agreement | "
                  "ROUGE-L vs ref | ROUGE-L vs target |", "|---|---|---|---|---|---|---|"]
        base = summary.get("target", {})
        lines.append("| target-only (= exact SD) | 0.000 | 0.000 | 0.000 | 1.000 | "
                     f"{_fmt(base.get('rouge_l_ref'))} | 1.000 |")
        for k, s in approx.items():
            lines.append(f"| {k} | " + " | ".join(_fmt(s.get(x)) for x in (
                "target_calls_saved_frac", "unchecked_frac", "tvd_est", "token_agreement", "rouge_l_ref",
                "rouge_l_target")) + " |")
    cost_ratio = next(iter(summary.values())).get("measured_c")
    measured = ("each row's drafter's c (draft step ÷ target step; prompt lookup: per drafted token)"
                if len(drafters) > 1 else f"Measured c (draft step ÷ target step) = {_fmt(cost_ratio)}")
    lines += ["", f"{measured}; batch size 1; oracle rows read the target-only output (an upper bound, not a "
              "method)."]
    return "\n".join(lines) + "\n"


def speedup_intervals(rows: list[dict], keys: list[str], n_resamples: int = 2000,
                      confidence: float = 0.95) -> dict[str, list[float]]:
    """{method: [low, high]}: percentile bootstrap over prompts of each method's speedup as the table computes it,
    (Σ new tokens ÷ Σ wall s) of the method ÷ the same of target-only, on the prompts every method and target-only
    decoded. One draw of prompts serves every method (they decoded the same prompts in one process). Empty with
    fewer than 3 such prompts."""
    import numpy as np

    from utils.stats import bootstrap_ci

    by: dict[str, dict] = {m: {} for m in ["target", *keys]}
    for r in rows:
        if r.get("method") in by:
            by[r["method"]][r["prompt_id"]] = r
    ids = sorted(set.intersection(*(set(v) for v in by.values())))
    if len(ids) < 3:
        return {}
    tok = {m: np.array([by[m][i]["new_tokens"] for i in ids], dtype=float) for m in by}
    wall = {m: np.array([by[m][i]["wall_s"] for i in ids], dtype=float) for m in by}

    def stat(idx, axis=-1):
        t = tok["target"][idx].sum(-1) / wall["target"][idx].sum(-1)
        return np.stack([tok[m][idx].sum(-1) / wall[m][idx].sum(-1) / t for m in keys])

    cis = bootstrap_ci(len(ids), stat, n_resamples, confidence, method="percentile")
    return dict(zip(keys, cis))


def plots(summary: dict, rows: list[dict], out_dir: Path) -> None:
    """speedup.png (each method's speedup with its 95% bootstrap interval over prompts) and
    acceptance_by_position.png."""
    from utils.plotting import pyplot, save_png

    plt = pyplot()

    keys = [k for k in summary if k != "target"]
    if not keys:
        return
    fig, ax = plt.subplots(figsize=(1.2 * len(keys) + 2, 3.5))
    means = [summary[k]["speedup"] for k in keys]
    ci = speedup_intervals(rows, keys)
    err = [[max(0.0, m - ci[k][0]) if k in ci else 0.0 for k, m in zip(keys, means)],
           [max(0.0, ci[k][1] - m) if k in ci else 0.0 for k, m in zip(keys, means)]]
    ax.bar(range(len(keys)), means, yerr=err, capsize=4, color=["#999" if summary[k].get("oracle") else "#4477aa"
                                                                  for k in keys])
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(keys)), keys, rotation=30, ha="right")
    ax.set_ylabel("speedup vs target-only\n(95% bootstrap CI over prompts)")
    fig.tight_layout()
    save_png(fig, out_dir / "speedup.png", dpi=120)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k in keys:
        acc = summary[k].get("per_position_acceptance") or []
        xs = [j for j, a in enumerate(acc) if a is not None]
        ax.plot(xs, [acc[j] for j in xs], marker="o", ms=3, label=k)
    ax.set_xlabel("position in draft round")
    ax.set_ylabel("P(accept | previous accepted)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, out_dir / "acceptance_by_position.png", dpi=120)


def task_table(by_task: dict, title: str = "") -> str:
    """SVIP Table 1 layout: one row per method, speedup per task (and the mean accepted length in brackets)."""
    tasks = list(by_task)
    methods = list(next(iter(by_task.values())))
    lines = [f"### {title}" if title else "", "", "| method | " + " | ".join(tasks) + " | overall (mean) |",
             "|---|" + "---|" * (len(tasks) + 1)]
    for k in methods:
        cells = [f"{by_task[t][k]['speedup']:.2f}× ({by_task[t][k]['mean_accepted_length']:.2f})" for t in tasks]
        mean = sum(by_task[t][k]["speedup"] for t in tasks) / len(tasks)
        lines.append(f"| {k} | " + " | ".join(cells) + f" | {mean:.2f}× |")
    lines += ["", "Speedup vs target-only on the same prompts (mean accepted length = new tokens per target call)."]
    return "\n".join(lines) + "\n"


def compact_rows(rows: list[dict]) -> list[dict]:
    """The rows as prompts.jsonl stores them: a method's output identical to target-only's on its prompt keeps
    `same_as_target: true` instead of a second copy of the tokens and text (the target row holds them), which
    shrinks a greedy run's file by a fifth (bf16, near-tie departures) to two fifths (float32); every output that
    differs is kept whole."""
    return [{k: v for k, v in r.items() if k not in ("tokens", "text")} | {"same_as_target": True}
            if r["method"] != "target" and r.get("matches_target") is True else r for r in rows]


def write_outputs(out_dir: Path, summary: dict, rows: list[dict], run_info: dict, title: str, make_plots: bool,
                  prefix: str = "", by_task: dict | None = None) -> None:
    """Every file of one split's run; summary.json last, so its presence means the run finished."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if by_task:
        write_text_atomic(out_dir / f"{prefix}by_task.json", json.dumps(by_task, indent=2))
        write_text_atomic(out_dir / f"{prefix}by_task.md", task_table(by_task, title))
    write_jsonl(out_dir / f"{prefix}prompts.jsonl", compact_rows(rows))
    write_text_atomic(out_dir / f"{prefix}run.json", json.dumps(run_info, indent=2))
    write_text_atomic(out_dir / f"{prefix}summary.md", markdown_table(summary, title))
    if make_plots:
        plots(summary, rows, out_dir)
    write_text_atomic(out_dir / f"{prefix}summary.json", json.dumps(summary, indent=2))  # last: its presence = done
