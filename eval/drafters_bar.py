"""`python -m eval.drafters_bar`: drafters side by side from one decode run, with paired intervals, as one JSON.

    python -m eval.drafters_bar drafters_bar.run=results/drafters_mbpp [drafters_bar.reference=student]
    python -m eval.drafters_bar drafters_bar.run=DIR drafters_bar.reference=student+lookup drafters_bar.name=vs_lookup

Reads a `python -m decode 'drafters=[...]'` folder (summary.json, prompts.jsonl, run.json) and writes
`drafters.json` and `drafters.md` there (`<name>.json` and `.md` with `drafters_bar.name`):

    {"prompts", "machine", "dtype", "reference",
     "drafters": {name: {"best", "speedup", "cost_model_speedup", "mean_accepted_length", "c", "lossless",
                         "lossless_up_to_ties", "vs_reference", "vs_reference_ci"}}}

`best` is the drafter's method (`drafter/policy`) with the highest wall speedup in the run; `vs_reference` the
ratio of its tokens/s to the reference drafter's best, over the prompts every method decoded, with a 95% BCa
bootstrap interval over prompts (paired: one draw of prompts serves both; utils.stats, as eval.bar). The numbers
are the decode run's own: nothing here times anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from eval.bar import per_prompt
from utils.cli import UserError, hydra_entry
from utils.files import write_report
from utils.stats import bootstrap_ci


def drafter_rows(summary: dict) -> dict[str, list[str]]:
    """{drafter: its method keys} of a summary (rows the run keyed `drafter/policy`)."""
    out: dict[str, list[str]] = {}
    for key, s in summary.items():
        if key != "target" and isinstance(s, dict):
            out.setdefault(str(s.get("drafter") or key.partition("/")[0]), []).append(key)
    return out


def compare(folder: Path, reference: str = "student", n_resamples: int = 4000) -> dict:
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except FileNotFoundError:
        raise UserError(f"{folder} has no summary.json; decode with python -m decode 'drafters=[...]' "
                        f"out_dir={folder}") from None
    groups = drafter_rows(summary)
    if reference not in groups:
        raise UserError(f"{folder} decoded no '{reference}' rows (drafters: {sorted(groups)}); pass "
                        "drafters_bar.reference=NAME")
    best = {d: max(keys, key=lambda k: summary[k]["speedup"]) for d, keys in groups.items()}
    methods = sorted(set(best.values()))
    ids, pp = per_prompt(folder / "prompts.jsonl", methods, ("new_tokens", "wall_s"))
    ref, others = best[reference], [d for d in best if d != reference]

    def stat(idx, axis=-1):
        tps = {m: pp[m]["new_tokens"][idx].sum(-1) / pp[m]["wall_s"][idx].sum(-1) for m in methods}
        return np.stack([tps[best[d]] / tps[ref] for d in others])

    ratio = dict(zip(others, stat(np.arange(len(ids))))) if others else {}
    ci = dict(zip(others, bootstrap_ci(len(ids), stat, n_resamples))) if others else {}
    run = json.loads((folder / "run.json").read_text()) if (folder / "run.json").is_file() else {}
    out = {"prompts": len(ids), "machine": run.get("machine"), "dtype": run.get("dtype"), "date": run.get("date"),
           "reference": reference, "drafters": {}}
    for d, key in best.items():
        s = summary[key]
        out["drafters"][d] = {"best": key, "speedup": s["speedup"], "cost_model_speedup": s["cost_model_speedup"],
                              "mean_accepted_length": s["mean_accepted_length"], "c": s.get("measured_c"),
                              "lossless": s.get("lossless"), "lossless_up_to_ties": s.get("lossless_up_to_ties"),
                              "vs_reference": float(ratio.get(d, 1.0)), "vs_reference_ci": ci.get(d, [1.0, 1.0])}
    return out


def markdown(res: dict) -> str:
    lines = [f"Best method per drafter; ratio to the best `{res['reference']}` method's tokens/s with a 95% paired BCa "
             f"interval over {res['prompts']} prompts ({res['machine']}, {res['dtype']}, {res['date']}).", "",
             "| drafter | best method | speedup | cost-model | mean acc len | c | ratio | 95% interval |",
             "|---|---|---|---|---|---|---|---|"]
    for d, r in res["drafters"].items():
        lo, hi = r["vs_reference_ci"]
        lines.append(f"| {d} | {r['best']} | {r['speedup']:.2f} | {r['cost_model_speedup']:.2f} | "
                     f"{r['mean_accepted_length']:.2f} | {r['c']:.3f} | {r['vs_reference']:.3f} | "
                     f"[{lo:.3f}, {hi:.3f}] |")
    return "\n".join(lines) + "\n"


@hydra_entry("drafters_bar")
def main(cfg: DictConfig) -> None:
    c = cfg.drafters_bar
    if not c.get("run"):
        raise UserError("pass the decode folder: drafters_bar.run=DIR (python -m decode 'drafters=[...]' out_dir=DIR)")
    folder = Path(str(c.run))
    res = compare(folder, str(c.reference), int(c.n_resamples))
    print(write_report(folder, str(c.name), res, markdown(res)))


if __name__ == "__main__":
    main()
