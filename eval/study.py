"""`python -m eval.study`: results/README.md and README.md's headline table, generated from the folders under
results/ (never typed in).

    python -m eval.study               # after any command of conf/study.yaml rewrote its folder
    python -m eval.study --no-plots    # the two Markdown files only
    python -m eval.study --commands qwen_eagle [--stale]   # print what remakes those folders (the stale ones)

conf/study.yaml lists every results/ folder as a section: the commands that write it, the tables and plots shown,
a short note. For each section results/README.md gets the commands, the settings its files record (machine, date,
dtype, prompts), a **stale** line when its pair, draft or code settings differ from today's defaults of its pair
(`conf/pair/<pair>.yaml`; a setting the section's own command sets, e.g. `pair.dtype=float32`, is not stale), then
its tables, plots and note. Compared: the pair, the draft's weights by content (`draft_files`, where the record has
them; a section whose files record none is stale when git last committed them before today's draft weights),
`draft.vocab_subset`, `draft.quantize`, `dtype` (only where the pair
pins one: `auto` resolves per machine), `linear` and `forward` (code paths a file records since those options
exist; a decode run.json records no git commit, so these are the code settings there are to compare).

Every decode folder's speedup.png and acceptance_by_position.png are redrawn from its summary.json and prompts.jsonl
(decode.report.plots: bars with 95% bootstrap intervals over prompts). README.md's block between the study markers
gets the headline: the default pair's wall-clock speedups (conf/study.yaml `headline.wall`) next to every policy's
cost-model speedup tuned on validation and the bar of the best learned head (`headline.bar`, eval.bar's bar.json);
tests/test_results_tree.py checks that the block is what this writes from the files. argparse, not Hydra: it reads
finished result folders and composes no pair, dataset or model.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from eval.staleness import records, stale_line
from utils.cli import UserError, fail
from utils.files import jsonl_path, read_jsonl

REPO = Path(__file__).resolve().parent.parent

MANIFEST = REPO / "conf" / "study.yaml"

BEGIN, END = "<!-- study:begin (python -m eval.study) -->", "<!-- study:end -->"


@dataclass(frozen=True)
class Section:
    """One folder under results/ (or, with `only`, some of its files): the commands that write it and what to show."""

    folder: str
    title: str
    commands: tuple[str, ...]
    tables: tuple[str, ...] = ()
    plots: tuple[str, ...] = ()
    notes: str = ""
    only: tuple[str, ...] = ()
    render: str = ""


@dataclass(frozen=True)
class Study:
    """conf/study.yaml: the sections, the headline's sources, issue 16's bar (`{name: threshold text}`) and the
    folders other commands fill."""

    sections: tuple[Section, ...]
    headline: dict = field(default_factory=dict)
    bar: dict = field(default_factory=dict)
    elsewhere: dict = field(default_factory=dict)  # {folder: command} of folders other commands fill


def load_study(path: Path = MANIFEST) -> Study:
    from omegaconf import OmegaConf

    if not Path(path).is_file():
        raise UserError(f"study manifest {path} not found; pass --manifest conf/study.yaml")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    sections = tuple(Section(s["folder"], s["title"], tuple(s["commands"]), tuple(s.get("tables") or ()),
                             tuple(s.get("plots") or ()), str(s.get("notes") or "").strip(),
                             tuple(s.get("only") or ()), str(s.get("render") or "")) for s in raw["sections"])
    return Study(sections, dict(raw.get("headline") or {}), {k: str(v) for k, v in (raw.get("bar") or {}).items()},
                 {k: str(v) for k, v in (raw.get("elsewhere") or {}).items()})


def owner(study: Study, rel: str) -> Section | None:
    """The section covering the file results/<rel>: the deepest section folder above it; on one folder a section
    whose `only` lists the file's name before one without `only`."""
    parts = rel.split("/")
    for depth in range(len(parts) - 1, 0, -1):
        folder = "/".join(parts[:depth])
        here = [s for s in study.sections if s.folder == folder]
        for s in here:
            if s.only and depth == len(parts) - 1 and parts[-1] in s.only:
                return s
        for s in here:
            if not s.only:
                return s
    return None


def _settings(run: dict) -> str:
    keys = [("dataset", "dataset"), ("split", "split"), ("limit", "prompts"), ("max_new_tokens", "new tokens"),
            ("temperature", "T"), ("dtype", "dtype"), ("torch_threads", "threads"), ("threads", "threads"),
            ("measured_c", "measured c")]
    parts = []
    for k, label in keys:
        if run.get(k) is not None:
            v = run[k]
            parts.append(f"{label} {v:.3f}" if isinstance(v, float) and k == "measured_c" else f"{label} {v}")
    if run.get("drafters"):  # a side-by-side run (decode drafters=[...]); rows are keyed drafter/policy
        parts.append("drafters " + ", ".join(run["drafters"]))
    if (run.get("draft_files") or {}).get("weights"):
        parts.append(f"draft {run['draft_files']['weights'][:8]}")
    where = ", ".join(x for x in (run.get("machine"), run.get("date")) if x)
    return "; ".join(parts) + (f" — {where}" if where else "")


# ------------------------------------------------------------------------------------------------ the bar, the headline


BAR_NAMES = {"replay_ratio": "replay ratio", "gap_closed": "gap closed", "wall_ratio": "wall-clock ratio",
             "auroc_gain": "AUROC gain"}


def _ci(x: float, ci, digits: int = 3) -> str:
    return f"{x:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def bar_verdict(bar: dict, t: dict) -> dict[str, bool]:
    """Each of issue 16's bars (conf/study.yaml `bar`) against bar.json."""
    r, w, a = bar["replay"], bar.get("wall") or {}, bar["auroc"]
    return {"replay_ratio": r["ratio"] >= float(t["replay_ratio"]) and r["ratio_ci"][0] > 1.0,
            "gap_closed": r.get("gap_closed", float("nan")) >= float(t["gap_closed"]),
            "wall_ratio": bool(w) and w["ratio"] >= float(t["wall_ratio"]),
            "auroc_gain": a["head"] - a["max_q"] >= float(t["auroc_gain"])}


def bar_table(bar: dict, t: dict) -> list[str]:
    """bar.json as a table: the bar's four rows, then the carry-over to other prompt sets."""
    r, w, a = bar["replay"], bar.get("wall"), bar["auroc"]
    ok = bar_verdict(bar, t)
    yes = {True: "yes", False: "no"}
    lines = [f"Best learned `{r['best_learned']}` ÷ best training-free `{r['best_training_free']}` "
             f"({bar['settings']['interval']}):", "",
             "| bar | measured [95% CI] | target | met |", "|---|---|---|---|",
             f"| replay: speedup ratio ({r['prompts']} prompts) | {_ci(r['ratio'], r['ratio_ci'])} | "
             f"≥ {t['replay_ratio']}, interval above 1.0 | {yes[ok['replay_ratio']]} |"]
    if "gap_closed" in r:
        lines.append(f"| replay: share of the static K-opt → oracle gap closed | "
                     f"{_ci(r['gap_closed'], r['gap_closed_ci'], 2)} | ≥ {t['gap_closed']} | {yes[ok['gap_closed']]} |")
    if w:
        lines.append(f"| wall clock: the same two methods ({w['prompts']} prompts) | {_ci(w['ratio'], w['ratio_ci'])} "
                     f"| ≥ {t['wall_ratio']} | {yes[ok['wall_ratio']]} |")
    lines += [f"| test AUROC: head − max q | {a['head'] - a['max_q']:+.3f} ({a['head']:.3f} vs {a['max_q']:.3f}; "
              f"−H_q {a['neg_entropy']:.3f}) | ≥ +{t['auroc_gain']} | {yes[ok['auroc_gain']]} |", ""]
    carry = bar.get("carry_over") or {}
    if carry:
        lines += ["Carried over with the MBPP-validation choices (cost model):", "",
                  f"| replay | group | prompts | best training-free there | `{r['best_learned']}` ÷ "
                  f"`{r['best_training_free']}` |", "|---|---|---|---|---|"]
        for name, c in carry.items():
            for g, v in c["groups"].items():
                lines.append(f"| {name} | {g} | {v['prompts']} | {v['best_training_free_here']} | {v['ratio']:.3f} |")
        lines.append("")
    return lines


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def headline(results: Path, study: Study | None = None) -> str:
    """README.md's results block: wall-clock and cost-model speedups per method, then the bar's verdict."""
    from decode.report import speedup_intervals

    study = study or load_study()
    h = study.headline
    wall, bar_path = results / h["wall"], results / h["bar"]
    if not ((wall / "summary.json").is_file() and bar_path.is_file()):
        return "No results yet: run the commands of results/README.md, then `python -m eval.study`.\n"
    summary, run, bar = _load(wall / "summary.json"), _load(wall / "run.json"), _load(bar_path)
    rows = read_jsonl(wall / "prompts.jsonl") if jsonl_path(wall / "prompts.jsonl") else []
    cost = bar["replay"]["speedup"]
    keys = [k for k in summary if k != "target"]
    ci = speedup_intervals(rows, keys)
    order = ["target", *sorted(cost, key=lambda k: -cost[k]), *(k for k in keys if k not in cost)]
    rs = bar.get("replay_settings") or {}
    replay_at = "".join([f", c = {rs['c']:.3f}" if rs.get("c") is not None else "",
                         f", {rs['date']}" if rs.get("date") else ""])
    lines = [f"Default pair `{run.get('pair')}`, MBPP test prompts, greedy, batch 1. Speedup over target-only decoding "
             "of the same prompts; [95% bootstrap interval over prompts]. The two columns are separate runs: the wall "
             f"clock on {run.get('machine')}, {str(run.get('dtype')).removeprefix('torch.')}, {run.get('date')}; the "
             "replay under the cost profile its traces' machine measured (its c and date in the header).", "",
             f"| method | wall clock, default parameters (`results/{h['wall']}`, {run.get('limit')} prompts × "
             f"{run.get('max_new_tokens')} tokens) | cost model, tuned on validation (`results/{h['replay']}`, "
             f"{bar['replay']['prompts']} prompts{replay_at}) |", "|---|---|---|"]
    for k in order:
        # an upper bound in exact arithmetic only: in bf16 target-only output departs from the run's at near-ties
        name = k + (" (reads target-only output)" if k == "oracle" else "")
        if k == "target":
            tps = summary.get("target", {}).get("tokens_per_s")
            lines.append(f"| target-only | 1.00 ({tps:.1f} tok/s) | 1.000 |")
            continue
        w = summary.get(k, {}).get("speedup")
        wcell = "–" if w is None else (f"{w:.2f} [{ci[k][0]:.2f}, {ci[k][1]:.2f}]" if k in ci else f"{w:.2f}")
        lines.append(f"| {name} | {wcell} | {'–' if k not in cost else f'{cost[k]:.3f}'} |")
    ok = bar_verdict(bar, study.bar)
    r, w, a = bar["replay"], bar.get("wall") or {}, bar["auroc"]
    lines += ["", f"Best learned ÷ best training-free (`{r['best_learned']}` ÷ `{r['best_training_free']}`, "
              f"`results/{h['bar']}`): replay {_ci(r['ratio'], r['ratio_ci'])} (bar ≥ {study.bar['replay_ratio']}), "
              f"gap to the oracle closed {_ci(r['gap_closed'], r['gap_closed_ci'], 2)} (bar ≥ {study.bar['gap_closed']})"
              + (f", wall clock {_ci(w['ratio'], w['ratio_ci'])} on {w['prompts']} prompts "
                 f"(bar ≥ {study.bar['wall_ratio']})" if w else "")
              + f"; test AUROC {a['head']:.3f} vs max q {a['max_q']:.3f}. "
              + ("Meets the bar." if all(ok.values()) else
                 f"Does **not** meet the bar (short: {', '.join(BAR_NAMES[k] for k, v in ok.items() if not v)}).")]
    stale = [s for s in (stale_line(results, sec) for sec in study.sections
                         if sec.folder in (h["wall"], h["replay"])) if s]
    stale = stale[:1] + bar_behind(results, h, bar)
    lines += [""] + stale + ([""] if stale else [])
    lines += ["Every table with its command, machine and date: [results/README.md](results/README.md); what they "
              "show: [docs/findings.md](docs/findings.md).", ""]
    return "\n".join(lines)


def bar_behind(results: Path, h: dict, bar: dict) -> list[str]:
    """A stale line when bar.json (whose numbers the cost-model column shows) was computed from an earlier replay
    than the one in the replay folder now: a rerun replay does not rewrite the bar."""
    replay = results / h["replay"] / "replay.json"
    now = (_load(replay).get("settings") or {}).get("date") if replay.is_file() else None
    used = (bar.get("replay_settings") or {}).get("date")
    if now and used and now != used:
        return [f"**Stale:** the cost-model column and the bar come from `results/{h['bar']}`, computed from the "
                f"replay of {used}; `results/{h['replay']}` is from {now}. Rerun `python -m eval.bar` to refresh it."]
    return []


# ------------------------------------------------------------------------------------------------ results/README.md


def _section(results: Path, sec: Section, study: Study) -> list[str]:
    """A section's title, commands, settings, stale line, chosen parameters, tables, plots and note."""
    d = results / sec.folder
    lines = [f"## {sec.title}", "", "```bash", *sec.commands, "```", ""]
    if not d.is_dir():
        return lines + ["Not run yet.", ""]
    recs = sorted(records(results, sec), key=lambda r: not r.get("machine"))
    lines += [f"Settings: {_settings(recs[0]) if recs else 'not recorded in these files'}", ""]
    stale = stale_line(results, sec, study.sections)
    if stale:
        lines += [stale, ""]
    if not sec.only and (d / "tuned.json").is_file() and (d / "run.json").is_file():
        chosen = json.loads((d / "tuned.json").read_text())["chosen"]
        lines += ["Chosen on validation: " + "; ".join(f"{k} {v}" for k, v in chosen.items() if v), ""]
    if sec.render == "bar" and (d / "bar.json").is_file():
        lines += bar_table(json.loads((d / "bar.json").read_text()), study.bar)
    for t in sec.tables:
        if (d / t).is_file():
            lines += [(d / t).read_text().strip().replace("### ", "#### "), ""]
    for p in sec.plots:
        if (d / p).is_file():
            lines += [f"![{sec.folder} {p}]({sec.folder}/{p})", ""]
    if sec.notes:
        lines += [sec.notes, ""]
    return lines


def build(results: Path, study: Study | None = None) -> str:
    """results/README.md's text."""
    study = study or load_study()
    lines = ["# Results", "",
             "Written by `python -m eval.study` from the folders below, which conf/study.yaml lists: each section is "
             "the latest run of the command above it. Speedup = tokens/s ÷ target-only tokens/s measured in the same "
             "process on the same prompts (prefill included); ± in the tables = std of per-prompt speedups; the bars "
             "of speedup.png carry 95% bootstrap intervals over prompts. Oracle rows read the target-only output: an "
             "upper bound, not a method. **Stale** marks a table whose pair, draft or code settings differ from "
             "today's defaults of its pair (conf/pair/): rerun its command to refresh it. Heads: "
             "`models/weights/heads/` (each `<name>.json` holds the command that made it and its test metrics). "
             "What the tables show: [docs/findings.md](../docs/findings.md).", ""]
    for sec in study.sections:
        lines += _section(results, sec, study)
    other = [f"- [`{k}/`]({k}/): `{v}`" for k, v in study.elsewhere.items() if (results / k).is_dir()]
    if other:
        lines += ["## Other folders", "", "Written by the commands named here; their tables are linked from "
                  "[docs/performance.md](../docs/performance.md) and [docs/findings.md](../docs/findings.md).", "",
                  *other, ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def redraw(results: Path) -> list[Path]:
    """speedup.png and acceptance_by_position.png of every decode folder, from its summary.json and prompts.jsonl."""
    from decode.report import plots

    done = []
    for s in sorted(results.rglob("summary.json")):
        d = s.parent
        if jsonl_path(d / "prompts.jsonl") and (d / "run.json").is_file():
            rows = read_jsonl(d / "prompts.jsonl")
            plots(json.loads(s.read_text()), rows, d)
            done.append(d)
    return done


def update_readme(readme: Path, block: str) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise UserError(f"{readme} has no {BEGIN} … {END} block to fill")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + BEGIN + "\n" + block + END + tail)


def readme_block(readme: Path) -> str:
    """The text between the study markers of a README (what update_readme last wrote)."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise UserError(f"{readme} has no {BEGIN} … {END} block")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].removeprefix("\n")


def commands(study: Study, prefix: str = "", results: Path | None = None) -> list[str]:
    """The commands of the sections under folder `prefix` (all with ''), in the manifest's order, each command once;
    with `results`, only those of the sections stale there (what `--stale` lists). A section's commands are its
    recipe, so `python -m eval.study --commands qwen_eagle > rerun.sh` is how a folder is remade."""
    secs = [s for s in study.sections if not prefix or s.folder == prefix.rstrip("/")
            or s.folder.startswith(prefix.rstrip("/") + "/")]
    if not secs:
        raise UserError(f"no section of the study lies under {prefix!r}; its folders: "
                        + ", ".join(sorted({s.folder.split("/")[0] for s in study.sections})))
    if results is not None:
        secs = [s for s in secs if stale_line(results, s, study.sections)]
    return list(dict.fromkeys(c for s in secs for c in s.commands))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=REPO / "results")
    ap.add_argument("--readme", type=Path, default=REPO / "README.md", help="top-level README with the study block")
    ap.add_argument("--manifest", type=Path, default=MANIFEST, help="the study's sections, headline and bar")
    ap.add_argument("--no-plots", action="store_true", help="write the Markdown only, not the decode plots")
    ap.add_argument("--commands", metavar="FOLDER", nargs="?", const="",
                    help="print the commands that remake FOLDER's sections (every section without FOLDER); write nothing")
    ap.add_argument("--stale", action="store_true", help="with --commands: only the stale sections' commands")
    args = ap.parse_args()
    study = load_study(args.manifest)
    if args.commands is not None or args.stale:
        print("\n".join(commands(study, args.commands or "", args.results if args.stale else None)))
        return
    if not args.no_plots:
        print(f"redrew the plots of {len(redraw(args.results))} decode folders")
    (args.results / "README.md").write_text(build(args.results, study))
    update_readme(args.readme, headline(args.results, study))
    print(f"wrote {args.results / 'README.md'} and the results block of {args.readme}")


if __name__ == "__main__":
    try:
        main()
    except UserError as err:
        fail(str(err))
