"""`python -m train.summarize DIR`: one table of test metrics over the runs under DIR (a multirun folder).

Reads every `results.json` below DIR with the job's Hydra overrides (`.hydra/overrides.yaml`), prints a Markdown
table (e.g. test AUROC per τ after `python -m train -m +experiment=sprinter_wikitext2 labels.tau=1,1.2,1.5`) and
writes it to DIR/summary.md and DIR/summary.json. A plain argument, not Hydra: its one input is a finished multirun
folder (the same code runs as a Hydra callback at the end of a multirun), so there is no config to compose.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

COLUMNS = ("test/auroc", "test/ap", "test/f1", "test/f1_static_best", "threshold", "val/auroc")


def collect(root: Path) -> list[dict]:
    rows = []
    for res in sorted(root.rglob("results.json")):
        job = res.parent
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = []
        if overrides_file.is_file():
            import yaml

            overrides = [o for o in (yaml.safe_load(overrides_file.read_text()) or []) if not o.startswith("+experiment")]
        data = json.loads(res.read_text())
        rows.append({"run": str(job.relative_to(root)) or ".", "overrides": " ".join(overrides), **data})
    return rows


def table(rows: list[dict]) -> str:
    head = ["run", "overrides", *COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["run"], r["overrides"] or "-"]
        cells += [f"{r[c]:.4f}" if isinstance(r.get(c), (int, float)) else "-" for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


class SummaryCallback(Callback):
    """Hydra callback (conf/train.yaml `hydra.callbacks`): after a multirun, print and write the sweep's table."""

    def on_multirun_end(self, config, **kwargs) -> None:
        root = Path(str(config.hydra.sweep.dir))
        rows = collect(root) if root.is_dir() else []
        if rows:
            md = table(rows)
            (root / "summary.md").write_text(md + "\n")
            (root / "summary.json").write_text(json.dumps(rows, indent=2, default=str))
            print(f"\nsweep summary ({root / 'summary.md'}):\n{md}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("error: usage: python -m train.summarize DIR (a run or multirun folder holding results.json files)",
              file=sys.stderr)
        return 2
    root = Path(argv[0])
    rows = collect(root)
    if not rows:
        print(f"error: no results.json under {root}; did the runs finish?", file=sys.stderr)
        return 2
    md = table(rows)
    (root / "summary.md").write_text(md + "\n")
    (root / "summary.json").write_text(json.dumps(rows, indent=2, default=str))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
