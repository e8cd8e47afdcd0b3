"""results/README.md from the study's result folders: every table with its command, machine, date and settings, and
the issue's bar for the learned heads computed from results/disco_mbpp/summary.json (never typed in); the same
DISCO table and verdict fill the marked study block of the top-level README.

    python -m eval.study            (after the study's decode runs; see the commands in the written file)

What the study ran is data, not code: conf/study.yaml lists each section (its folder under results/, title,
commands, tables and plots), the rerun pairs of the reproducibility check and the bar's thresholds; the decoding runs
are the Hydra experiments in conf/experiment/study/. A section whose folder is missing is listed as "not run" with its
command, so the file says what is absent. argparse, not Hydra: this reads finished result folders and composes no
pair, dataset or model, so there is no config to compose beyond the manifest it is pointed at.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from utils.cli import UserError, fail

REPO = Path(__file__).resolve().parent.parent

MANIFEST = REPO / "conf" / "study.yaml"


@dataclass(frozen=True)
class Section:
    """One table of results/README.md: its folder under results/, the commands that wrote it, what it shows."""

    folder: str
    title: str
    commands: tuple[str, ...]
    tables: tuple[str, ...] = ()
    plots: tuple[str, ...] = ()

    @property
    def command(self) -> str:
        return " && ".join(self.commands)


@dataclass(frozen=True)
class Study:
    """conf/study.yaml: the sections, the (original, rerun) folder pairs and the bar (`{ratio: threshold text}`)."""

    sections: tuple[Section, ...]
    reruns: tuple[tuple[str, str], ...]
    bar: dict[str, str] = field(default_factory=dict)


def load_study(path: Path = MANIFEST) -> Study:
    from omegaconf import OmegaConf

    if not Path(path).is_file():
        raise UserError(f"study manifest {path} not found; pass --manifest conf/study.yaml")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    sections = tuple(Section(s["folder"], s["title"], tuple(s["commands"]), tuple(s.get("tables") or ()),
                             tuple(s.get("plots") or ())) for s in raw["sections"])
    return Study(sections, tuple((a, b) for a, b in raw.get("reruns") or []),
                 {k: str(v) for k, v in (raw.get("bar") or {}).items()})


def bar_check(summary: dict, thresholds: dict[str, str] | None = None) -> dict:
    """The issue's bar on MBPP test: best learned head vs static K-opt, SVIP, AdaEDL, and the static→oracle gap;
    `thresholds` ({ratio: "1.10"}) default to conf/study.yaml's `bar`."""
    from decode.metrics import oracle_gap_closed

    heads = {k: v for k, v in summary.items() if k.startswith("learned")}
    need = [k for k in ("static_opt", "svip", "adaedl", "oracle") if k not in summary]
    if not heads or need:
        raise UserError(f"results/disco_mbpp/summary.json lacks {need or 'a learned:* row'}; rerun study/disco_mbpp")
    best = max(heads, key=lambda k: heads[k]["speedup"])
    s = {k: summary[k]["speedup"] for k in ("static_opt", "svip", "adaedl", "oracle")}
    b = heads[best]["speedup"]
    gap = s["oracle"] - s["static_opt"]
    out = {
        "best_learned": best, "best_learned_speedup": b, **{f"{k}_speedup": v for k, v in s.items()},
        "vs_static_opt": b / s["static_opt"], "vs_svip": b / s["svip"], "vs_adaedl": b / s["adaedl"],
        "oracle_gap_closed": oracle_gap_closed(b, s["static_opt"], s["oracle"]) if gap > 0 else float("nan"),
    }
    thresholds = load_study().bar if thresholds is None else thresholds
    out["passes"] = {f"{k}>={v}": out[k] >= float(v) for k, v in thresholds.items()}
    return out


def bar_intervals(prompts: Path, bar: dict, confidence: float = 0.95, n_resamples: int = 4000) -> dict:
    """Bootstrap confidence intervals of the bar's ratios over the table's prompts (BCa, seeded).

    Resampling is paired: one draw of prompts serves every method, as all methods decoded the same prompts in one
    process. Each resample recomputes the speedups exactly as the table does (ratio of sums, decode.metrics), so an
    interval that straddles the bar says the prompt sample cannot tell the head from the baseline at that margin."""
    import numpy as np
    from scipy.stats import bootstrap

    from decode.metrics import oracle_gap_closed, tokens_per_s

    methods = ["target", bar["best_learned"], "static_opt", "svip", "adaedl", "oracle"]
    rows: dict[str, dict[str, dict]] = {m: {} for m in methods}
    for line in prompts.read_text().splitlines():
        r = json.loads(line)
        if r["method"] in rows:
            rows[r["method"]][r["prompt_id"]] = r
    ids = sorted(set.intersection(*(set(v) for v in rows.values())))
    if len(ids) < 3:
        raise UserError(f"{prompts} has {len(ids)} prompts decoded by all of {methods}; rerun study/disco_mbpp")
    tok = {m: np.array([rows[m][i]["new_tokens"] for i in ids], dtype=float) for m in methods}
    wall = {m: np.array([rows[m][i]["wall_s"] for i in ids], dtype=float) for m in methods}

    def stats(idx, axis=-1):
        t = tokens_per_s(tok["target"][idx], wall["target"][idx])
        s = {m: tokens_per_s(tok[m][idx], wall[m][idx]) / t for m in methods[1:]}
        b = s[bar["best_learned"]]
        return np.stack([b / s["static_opt"], b / s["svip"], b / s["adaedl"],
                         oracle_gap_closed(b, s["static_opt"], s["oracle"])])

    res = bootstrap((np.arange(len(ids)),), stats, vectorized=True, n_resamples=n_resamples,
                    confidence_level=confidence, method="BCa", random_state=0)
    keys = ["vs_static_opt", "vs_svip", "vs_adaedl", "oracle_gap_closed"]
    return {"confidence": confidence, "n_prompts": len(ids), "n_resamples": n_resamples,
            "method": "BCa bootstrap over prompts, paired across methods",
            **{k: [float(lo), float(hi)] for k, lo, hi in zip(keys, res.confidence_interval.low,
                                                             res.confidence_interval.high)}}


def _bar_line(bar: dict, thresholds: dict[str, str]) -> str:
    """The bar's numbers with their bootstrap intervals when the prompts were there to compute them."""
    ci, t = bar.get("ci"), thresholds

    def f(key: str, pct: bool = False) -> str:
        scale, unit = (100, "%") if pct else (1, "×")
        val = f"{scale * bar[key]:.{0 if pct else 2}f}{unit}"
        if not ci:
            return val
        lo, hi = (scale * x for x in ci[key])
        return f"{val} [{lo:.{0 if pct else 2}f}–{hi:.{0 if pct else 2}f}]"

    return (f"{f('vs_static_opt')} static K-opt ({bar['static_opt_speedup']:.2f}×; bar ≥ {t['vs_static_opt']}), "
            f"{f('vs_svip')} SVIP ({bar['svip_speedup']:.2f}×; bar ≥ {t['vs_svip']}), "
            f"{f('vs_adaedl')} AdaEDL ({bar['adaedl_speedup']:.2f}×; bar ≥ {t['vs_adaedl']}); it closes "
            f"{f('oracle_gap_closed', pct=True)} of the gap from static K-opt to the oracle "
            f"({bar['oracle_speedup']:.2f}×; bar ≥ {100 * float(t['oracle_gap_closed']):.0f}%)"
            + (f" — [low–high]: {100 * ci['confidence']:.0f}% {ci['method']} ({ci['n_prompts']} prompts)" if ci else ""))


def disco_bar(d: Path, thresholds: dict[str, str] | None = None) -> dict:
    """bar_check on the table's summary, with intervals when its per-prompt rows are there; written to bar.json."""
    bar = bar_check(json.loads((d / "summary.json").read_text()), thresholds)
    if (d / "prompts.jsonl").is_file():
        bar["ci"] = bar_intervals(d / "prompts.jsonl", bar)
    (d / "bar.json").write_text(json.dumps(bar, indent=2))
    return bar


def repro_check(original: dict, rerun: dict) -> dict:
    """Per method of the rerun: does its speedup land within the original table's spread (± std of per-prompt
    speedups) of the original row? Methods the original lacks are skipped."""
    from decode.methods import method_entry

    out = {}
    for method, r in rerun.items():
        o = method_entry(original, method, method.split(":")[0], (r.get("params") or {}).get("ckpt"))
        if method == "target" or o is None:
            continue
        spread = float(o.get("speedup_std") or 0.0)
        # mean accepted length does not depend on the machine's speed: the cross-machine check that remains
        out[method] = {"original": o["speedup"], "rerun": r["speedup"], "spread": spread,
                       "within": abs(r["speedup"] - o["speedup"]) <= spread,
                       "mean_accepted_length": [o.get("mean_accepted_length"), r.get("mean_accepted_length")]}
    return out


def repro_section(results: Path, reruns) -> list[str]:
    """The reproducibility table of the (original, rerun) folder pairs; writes results/reproducibility.json."""
    rows, report = [], {}
    for orig, again in reruns:
        a, b = results / orig / "summary.json", results / again / "summary.json"
        if not (a.is_file() and b.is_file()):
            continue
        machines = [json.loads((results / f / "run.json").read_text()).get("machine") for f in (orig, again)]
        same = machines[0] == machines[1]
        check = repro_check(json.loads(a.read_text()), json.loads(b.read_text()))
        report[f"{orig} <- {again}"] = {"same_machine": same, "methods": check}
        for m, row in check.items():
            mal = " → ".join("–" if x is None else f"{x:.2f}" for x in row["mean_accepted_length"])
            rows.append(f"| {orig} | {again} | {'yes' if same else 'no'} | {m} | "
                        f"{row['original']:.2f} ± {row['spread']:.2f} | {row['rerun']:.2f} | "
                        f"{'yes' if row['within'] else 'no'} | {mal} |")
    if not rows:
        return []
    (results / "reproducibility.json").write_text(json.dumps(report, indent=2))
    return ["## Reproducibility — rows rerun in a fresh process", "",
            "Each rerun's command is its section's; `within` = the rerun's speedup lies within the original table's "
            "± (std of per-prompt speedups) of the original row (results/reproducibility.json). Wall-clock speedups "
            "only reproduce on the same machine; the mean accepted length (tokens per target call) does not depend on "
            "the machine's speed and should match across machines up to the dtype's numerics.", "",
            "| table | rerun | same machine | method | original | rerun | within | mean acc len (original → rerun) |",
            "|---|---|---|---|---|---|---|---|",
            *rows, ""]


def _settings(run: dict) -> str:
    keys = [("dataset", "dataset"), ("split", "split"), ("limit", "prompts"), ("max_new_tokens", "new tokens"),
            ("temperature", "T"), ("dtype", "dtype"), ("torch_threads", "threads"), ("measured_c", "measured c")]
    parts = []
    for k, label in keys:
        if run.get(k) is not None:
            v = run[k]
            parts.append(f"{label} {v:.3f}" if isinstance(v, float) and k == "measured_c" else f"{label} {v}")
    where = ", ".join(x for x in (run.get("machine"), run.get("date")) if x)
    return "; ".join(parts) + (f" — {where}" if where else "")


def build(results: Path, bar: dict | None, study: Study | None = None) -> str:
    """results/README.md's text; `bar` is disco_bar's result (None when table 1 has not been run)."""
    study = study or load_study()
    lines = ["# Study results", "",
             "Written by `python -m eval.study` from the folders below; every table is the output of the command above "
             "it (decode writes summary.json/summary.md, the analysis commands the rest). Speedup = tokens/s ÷ target-"
             "only tokens/s measured in the same process on the same prompts (prefill included); ± = std of per-prompt "
             "speedups. Oracle rows read the target-only output: an upper bound, not a method. Heads: "
             "`results/heads/` (see `results/heads/*.results.json` for their test metrics and training data).", ""]
    if bar is not None:
        verdict = "meets" if all(bar["passes"].values()) else "does NOT meet"
        lines += ["## The bar (MBPP test, default pair, CPU)", "",
                  f"Best learned head `{bar['best_learned']}`: {bar['best_learned_speedup']:.2f}× — "
                  f"{_bar_line(bar, study.bar)}. The head **{verdict}** the bar (results/disco_mbpp/bar.json).", ""]
    for sec in study.sections:
        lines += _section(results, sec)
    lines += repro_section(results, study.reruns)
    return "\n".join(lines) + "\n"


def _section(results: Path, sec: Section) -> list[str]:
    """A section's title, command, settings, chosen parameters, tables, plots and notes ("Not run yet." without
    its folder)."""
    folder, d = sec.folder, results / sec.folder
    lines = [f"## {sec.title}", "", f"`{sec.command}`", ""]
    if not d.is_dir():
        return lines + ["Not run yet.", ""]
    run_json = d / "run.json"
    if not run_json.is_file():
        sub = sorted(d.glob("*/run.json"))
        run_json = sub[0] if sub else run_json
    if run_json.is_file():
        lines += [f"Settings: {_settings(json.loads(run_json.read_text()))}", ""]
    tuned = d / "tuned.json"
    if tuned.is_file():
        chosen = json.loads(tuned.read_text())["chosen"]
        lines += ["Chosen on validation: " + "; ".join(f"{k} {v}" for k, v in chosen.items() if v), ""]
    for t in sec.tables:
        if (d / t).is_file():
            lines += [(d / t).read_text().strip().replace("### ", "#### "), ""]
    for p in sec.plots:
        if (d / p).is_file():
            lines += [f"![{folder} {p}]({folder}/{p})", ""]
    notes = d / "NOTES.md"
    if notes.is_file():
        lines += [notes.read_text().strip(), ""]
    return lines


BEGIN, END = "<!-- study:begin (python -m eval.study) -->", "<!-- study:end -->"


def headline(results: Path, bar: dict | None, study: Study | None = None) -> str:
    """The block eval.study keeps in the top-level README: the DISCO table and the bar, linking the rest."""
    study = study or load_study()
    d = results / "disco_mbpp"
    if bar is None or not (d / "summary.md").is_file():
        return "The study has not been run yet: see results/README.md for the commands.\n"
    run = json.loads((d / "run.json").read_text()) if (d / "run.json").is_file() else {}
    verdict = "meets" if all(bar["passes"].values()) else "does **not** meet"
    command = next(s.command for s in study.sections if s.folder == "disco_mbpp")
    return "\n".join([
        f"**DISCO table, MBPP test** (`{command}`; {_settings(run)}). Parameters "
        "and head thresholds chosen for speed on MBPP validation (`results/disco_mbpp/tuned.json`).", "",
        (d / "summary.md").read_text().strip().replace("### ", "#### "), "",
        f"Best learned head `{bar['best_learned']}` {bar['best_learned_speedup']:.2f}×: {_bar_line(bar, study.bar)}. It "
        f"{verdict} the issue's bar.", "",
        "Every other study table (HumanEval transfer, table 1 on an AMD CPU and on an H100, the heads against the "
        "training-free scores as classifiers, the cost-model replay with heads of known AUROC, Spec-Bench per task "
        "greedy and T=1, temperature sweep, K sweep vs prediction, draft scale, SPRINTER τ with its TVD prediction, "
        "Qwen expensive draft, and the reproducibility check of rerun rows) with its command, machine and date: [results/README.md](results/README.md).", ""])


def update_readme(readme: Path, block: str) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise UserError(f"{readme} has no {BEGIN} … {END} block to fill")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + BEGIN + "\n" + block + END + tail)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=REPO / "results")
    ap.add_argument("--readme", type=Path, default=REPO / "README.md", help="top-level README with the study block")
    ap.add_argument("--manifest", type=Path, default=MANIFEST, help="the study's sections, reruns and bar")
    args = ap.parse_args()
    study = load_study(args.manifest)
    disco = args.results / "disco_mbpp"
    # the bootstrap takes seconds: once
    bar = disco_bar(disco, study.bar) if (disco / "summary.json").is_file() else None
    text = build(args.results, bar, study)
    (args.results / "README.md").write_text(text)
    update_readme(args.readme, headline(args.results, bar, study))
    print(f"wrote {args.results / 'README.md'} and the study block of {args.readme}")


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        fail(str(err))
