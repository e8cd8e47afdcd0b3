"""results/ holds the latest output of committed commands and nothing else (issue 28).

Every file under results/ belongs to a section of conf/study.yaml (eval.study's manifest) whose commands name modules
that exist, and is a file one of those modules writes: its name appears in the writer's source (WRITERS), or the
command names the file's path. Folders other commands fill (conf/study.yaml `elsewhere`: the bench scripts) pass when
a bench script writing into them names the file. No version-suffixed or rerun folders, no checkpoints, at most 6 MiB
(per-prompt rows are stored gzip-compressed, utils.files.write_jsonl: the wall runs' rows were ~0.9 MiB each).
results/README.md and README.md's results block are exactly what `python -m eval.study` writes from the files, and every shipped head carries the command that made it.
"""

from __future__ import annotations

import json
import re
from fnmatch import fnmatch
from pathlib import Path

import pytest

from tests.conftest import REPO
from utils.files import read_jsonl

RESULTS = REPO / "results"

# module named in a command -> (source files that write the names, the file names they write)
WRITERS = [
    ("decode", ("decode/report.py",), ("summary.json", "summary.md", "prompts.jsonl", "run.json", "speedup.png",
                                       "acceptance_by_position.png", "by_task.json", "by_task.md")),
    ("decode", ("decode/report.py", "decode/runner.py"), ("tune_summary.json", "tune_summary.md", "tune_run.json",
                                                          "tune_prompts.jsonl", "tuned.json")),
    ("eval.replay", ("eval/replay.py", "eval/replay_report.py"), ("replay.json", "replay.md", "prompts.jsonl", "tuned.json", "replay_auroc.png")),
    ("eval.eagle_bar", ("eval/eagle_bar.py",), ("bar.json", "bar.md")),
    ("eval.qwen_bar", ("eval/qwen_bar.py",), ("bar.json", "bar.md")),
    ("eval", ("eval/classifier.py",), ("report.json", "report.md", "roc.png", "pr.png", "reliability.png",
                                       "per_position_auroc.png", "per_continuation_position_auroc.png")),
    ("eval.collect", ("eval/collect.py",), ("collect.json", "collect.md", "collect.png")),
    ("eval.k_sweep", ("eval/k_sweep.py",), ("k_sweep.json", "k_sweep.md", "k_sweep.png")),
    ("eval.tree_ceiling", ("eval/tree_ceiling.py",), ("ceiling.json", "ceiling.md")),
    ("eval.tree_replay", ("eval/tree_replay.py",), ("tree_replay.json", "tree_replay.md", "speedup.png")),
    ("eval.tree_sweep", ("eval/tree_sweep.py",), ("tree_sweep.json", "tree_sweep.md", "tree_sweep.png")),
    ("eval.tree_bar", ("eval/tree_bar.py", "conf/tree_bar.yaml"), ("bar.json", "bar.md")),
    ("eval.bar", ("eval/bar.py", "conf/bar.yaml"), ("bar.json",)),
    ("eval.drafters_bar", ("eval/drafters_bar.py",), ("drafters.json", "drafters.md")),
    ("eval.wall_gap", ("eval/wall_gap.py",), ("wall_gap.json", "wall_gap.md")),
]


def study():
    from eval.study import load_study

    return load_study()


def modules(command: str) -> list[str]:
    """The modules a command line runs (`python -m X`), in order."""
    return re.findall(r"python -m ([\w.]+)", command)


def module_file(mod: str) -> Path | None:
    base = REPO / mod.replace(".", "/")
    return next((p for p in (base.with_suffix(".py"), base / "__main__.py") if p.is_file()), None)


def source_names(sources, name: str) -> bool:
    """Whether the writer's sources name the file (a `tune_` file: decode's prefix plus the base name; rows
    written by utils.files.write_jsonl by the name they are read by, without its '.gz')."""
    name = name.removesuffix(".gz")
    text = "\n".join((REPO / s).read_text() for s in sources)
    if name.startswith("tune_") and name != "tuned.json":
        return 'prefix="tune_"' in text and name.removeprefix("tune_") in text
    return name in text


def bench_names(name: str, script: str) -> bool:
    """A bench script names a result file in its source or config (`ablation` for ablation.json)."""
    stem = name.split(".")[0]
    text = "\n".join(p.read_text() for p in (REPO / "bench" / f"{script}.py", REPO / "conf" / "bench" / f"{script}.yaml")
                     if p.is_file())
    return name in text or re.search(rf"\b{re.escape(stem)}\b", text) is not None


def written_by_section(rel: str, sec) -> bool:
    name = Path(rel).name
    for command in sec.commands:
        if f"results/{rel}" in command and any(module_file(m) for m in modules(command)):
            return True  # the command names the file it writes (decode.profile out=...)
        if re.search(rf"\.name={re.escape(name.split('.')[0])}(\s|$)", command) and any(
                mod == m and Path(name).suffix in {Path(n).suffix for n in names}
                for mod in modules(command) for m, _, names in WRITERS):
            return True  # the command names the file's stem (eval.drafters_bar drafters_bar.name=vs_lookup)
        for mod in modules(command):
            if mod.startswith("bench.") and bench_names(name, mod.removeprefix("bench.")):
                return True
            if any(mod == m and name.removesuffix(".gz") in names and source_names(src, name) for m, src, names in WRITERS):
                return True
    return False


def bench_configs():
    """{script: out_dir} of every bench script's config."""
    from omegaconf import OmegaConf

    return {p.stem: str(OmegaConf.load(p).get("out_dir") or "") for p in sorted((REPO / "conf" / "bench").glob("*.yaml"))}


def recorded_script(path: Path) -> str | None:
    """The bench script a result's json (or the json beside a .md) records as its `command`."""
    js = path.with_suffix(".json")
    data = json.loads(js.read_text()) if js.is_file() else {}
    m = re.match(r"python (?:-m bench\.|bench/)(\w+)", str(data.get("command", ""))) if isinstance(data, dict) else None
    return m.group(1) if m else None


def written_elsewhere(rel: str) -> bool:
    """A file of a folder other commands fill: a bench script writing into its folder names it, or the file
    records the bench script that wrote it (`command`, e.g. distill_metrics with name=distill_int8)."""
    folder = "results/" + str(Path(rel).parent)
    writers = [s for s, out in bench_configs().items() if folder == out or folder.startswith(out + "/")]
    return any(bench_names(Path(rel).name, s) for s in writers) or recorded_script(RESULTS / rel) in writers


def result_files() -> list[str]:
    return sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file())


def test_every_result_file_is_written_by_a_named_command():
    from eval.study import owner

    s = study()
    orphans = []
    for rel in result_files():
        if rel == "README.md":
            assert source_names(("eval/study.py",), "README.md")
            continue
        top = rel.split("/")[0]
        if top in s.elsewhere:
            ok = written_elsewhere(rel)
        else:
            sec = owner(s, rel)
            ok = sec is not None and written_by_section(rel, sec)
        if not ok:
            orphans.append(rel)
    assert orphans == [], f"files under results/ that no command in conf/study.yaml writes: {orphans}"


def test_sections_name_existing_modules_and_folders():
    s = study()
    for sec in s.sections:
        assert (RESULTS / sec.folder).is_dir(), f"{sec.folder}: no such results folder"
        mods = [m for c in sec.commands for m in modules(c)]
        assert mods and all(module_file(m) for m in mods), f"{sec.folder}: {mods}"
        for f in (*sec.only, *sec.tables, *sec.plots):
            assert (RESULTS / sec.folder / f).is_file(), f"{sec.folder}/{f} is listed but missing"
    assert set(s.elsewhere) <= {"bench", "hf_generate"}


def test_no_superseded_runs_or_checkpoints_and_small():
    files = result_files()
    bad = [f for f in files if any(fnmatch(part, pat) for part in Path(f).parts
                                   for pat in ("*_v[0-9]*", "*_rerun*", "*.ckpt", "*.pt", "*.safetensors"))]
    assert bad == []
    size = sum((RESULTS / f).stat().st_size for f in files)
    assert size <= 6 * 2**20, f"results/ holds {size / 2**20:.1f} MiB; keep it under 6 MiB"


def test_json_text_puts_number_lists_on_one_line_and_round_trips():
    """eval's report.json writer: a curve is one line, not one line per number; strings and mixed lists untouched."""
    from utils.files import json_text

    obj = {"roc": [[0.0, 2.5e-05, 1.0], [-3, None, 0.5]], "s": "[1,\n 2]", "mixed": [1, "x"], "empty": []}
    text = json_text(obj, indent=2)
    assert json.loads(text) == obj
    assert '[0.0, 2.5e-05, 1.0]' in text and '[-3, null, 0.5]' in text
    assert len(text.splitlines()) == len(json_text({"roc": [[0], [0]], "s": "", "mixed": [1, "x"], "empty": []},
                                                   indent=2).splitlines())


def test_jsonl_text_is_compact_and_round_trips():
    """decode's and the replay's prompts.jsonl writer: one row a line, floats to 6 digits, no separator spaces."""
    from utils.files import jsonl_text

    rows = [{"tokens": [1604, 553], "wall_s": 4.349751234, "text": "a, b: c"}, {"rounds": [], "x": None}]
    text = jsonl_text(rows)
    assert text == '{"tokens":[1604,553],"wall_s":4.34975,"text":"a, b: c"}\n{"rounds":[],"x":null}\n'
    assert [json.loads(line) for line in text.splitlines()] == [{**rows[0], "wall_s": 4.34975}, rows[1]]


def test_results_readme_and_headline_are_generated():
    """results/README.md and README.md's block are what `python -m eval.study` writes from the files now."""
    from eval.study import build, headline, readme_block

    assert (RESULTS / "README.md").read_text() == build(RESULTS), "results/README.md is stale: python -m eval.study"
    assert readme_block(REPO / "README.md") == headline(RESULTS), "README.md's results block: python -m eval.study"


def test_shipped_heads_carry_their_recipe_and_configs_name_existing_heads():
    heads = sorted((REPO / "models" / "weights" / "heads").glob("*.ckpt"))
    assert heads
    for ckpt in heads:
        card = json.loads(ckpt.with_suffix(".json").read_text())
        assert card["command"].startswith("python -m train") and "test/auroc" in card, ckpt.name
    named = set()
    for path in [*(REPO / "conf").rglob("*.yaml"), REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        named |= set(re.findall(r"(?<![\w/])((?:models|results)/[a-z0-9_./-]+\.ckpt)", path.read_text()))  # not NAME
    assert named and [p for p in sorted(named) if not (REPO / p).is_file()] == []


@pytest.mark.parametrize("name", ["speed_auto", "stop_heads/wall_mbpp"])
def test_speedup_plot_intervals_contain_the_table_speedup(name):
    """The plotted 95% bootstrap interval of each method's speedup brackets the speedup the table reports."""
    from decode.report import speedup_intervals

    d = RESULTS / name
    summary = json.loads((d / "summary.json").read_text())
    rows = read_jsonl(d / "prompts.jsonl")
    keys = [k for k in summary if k != "target"]
    ci = speedup_intervals(rows, keys, n_resamples=500)
    assert set(ci) == set(keys)
    for k in keys:
        assert ci[k][0] <= summary[k]["speedup"] <= ci[k][1], (k, ci[k], summary[k]["speedup"])
