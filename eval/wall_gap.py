"""`python -m eval.wall_gap DIR`: where a decode run's wall clock departs from its cost model, per method.

The cost model (models.cost.modeled_ms) prices a generation's target calls on the run's profile and its draft calls
on its drafter's; the loop measures the time in each (decode.loop: `target_s` the verification passes with their
bookkeeping, `draft_s` the draft's calls, `policy_s` the stop policy's or builder's own work). Set side by side, the
split says which part the model misses: the target and draft parts are compared call for call (every drafter's
profile shares the pair's target curves; a drafter's own draft curves are in its summary's `own_profile`), the
policy part, which the model does not price, as a share of the wall clock. Target-only rows book no
prefill in `target_s`, so their target part is compared without it. Writes DIR/wall_gap.json and DIR/wall_gap.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from models.cost import CostProfile, modeled_parts
from utils.cli import UserError, fail
from utils.files import read_jsonl, write_text_atomic


def gap(run: Path) -> dict:
    """Per method: wall-clock vs cost-model speedup and the measured target time vs the modeled one."""
    for name in ("run.json", "summary.json", "prompts.jsonl.gz"):
        if not (run / name).is_file():
            raise UserError(f"{run} has no {name}; pass a folder written by python -m decode")
    meta = json.loads((run / "run.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    if not meta.get("cost_profile"):
        raise UserError(f"{run}/run.json records no cost profile; rerun the decode with a profile")
    prof = CostProfile.from_dict(meta["cost_profile"])
    by: dict[str, list[dict]] = {}
    for row in read_jsonl(run / "prompts.jsonl.gz"):
        by.setdefault(row["method"], []).append(row)
    out = {}
    for method, rows in by.items():
        s = summary.get(method) or {}
        own = prof.with_drafter(s.get("own_profile"))  # the drafter's own curves, where its summary recorded them
        wall = sum(r["wall_s"] for r in rows)
        target, draft = (sum(r[k] for r in rows) for k in ("target_s", "draft_s"))
        model, draft_model = (sum(x) / 1000 for x in zip(*(modeled_parts(r, own) for r in rows)))
        if method == "target":  # autoregressive books the decode steps after its prefill call
            model -= sum(float(prof.prefill_target(int(r["prompt_tokens"]))) for r in rows) / 1000
        out[method] = {"speedup": s.get("speedup"), "cost_model_speedup": s.get("cost_model_speedup"),
                       "wall_vs_model": s["speedup"] / s["cost_model_speedup"] - 1 if s.get("cost_model_speedup")
                       else None,
                       "target_s": target, "target_model_s": model, "target_vs_model": target / model - 1,
                       "draft_s": draft, "draft_model_s": draft_model,
                       "draft_vs_model": draft / draft_model - 1 if draft_model > 0 and _priced(s) else None,
                       "draft_share": draft / wall, "policy_share": sum(r["policy_s"] for r in rows) / wall}
    return {"run": str(run), "machine": meta.get("machine"), "dtype": meta.get("dtype"), "date": meta.get("date"),
            "profile_date": prof.date, "methods": out}


def _priced(s: dict) -> bool:
    """Whether a method's draft model is known: its own curves recorded, or the student's (the pair's own draft);
    runs before `own_profile` priced EAGLE-3 on curves they did not keep."""
    return "own_profile" in s or s.get("drafter", "student") == "student"


def markdown(res: dict) -> str:
    lines = [f"Wall clock against the cost model, by part ({res['machine']}, {res['dtype']}, run {res['date']}, "
             f"profile {res['profile_date']}; `python -m eval.wall_gap`)", "",
             "| method | speedup | cost model | wall ÷ model − 1 | target time ÷ modeled − 1 | draft time ÷ modeled − 1 "
             "| draft share | policy share |", "|---|---|---|---|---|---|---|---|"]
    def pct(x):
        return "–" if x is None else f"{100 * x:+.1f}%"

    for m, v in res["methods"].items():
        lines.append(f"| {m} | {v['speedup']:.2f} | {v['cost_model_speedup']:.2f} | {pct(v['wall_vs_model'])} | "
                     f"{pct(v['target_vs_model'])} | {pct(v.get('draft_vs_model'))} | {100 * v['draft_share']:.1f}% | "
                     f"{100 * v['policy_share']:.1f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m eval.wall_gap", description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a folder written by python -m decode")
    try:
        res = gap(ap.parse_args(argv).run)
    except UserError as err:
        fail(str(err))
    run = Path(res["run"])
    write_text_atomic(run / "wall_gap.json", json.dumps(res, indent=1))
    write_text_atomic(run / "wall_gap.md", markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
