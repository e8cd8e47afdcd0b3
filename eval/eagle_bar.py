"""`python -m eval.eagle_bar`: issue 53's numbers about the EAGLE-3 draft, gathered from the runs that measure them,
as results/eagle/bar.json (and bar.md). "Best" is the fastest method on the clock in that run.

    python -m eval.eagle_bar [eagle_bar.mbpp=results/eagle/mbpp] [eagle_bar.specbench=results/eagle/specbench]
                             [eagle_bar.heads=PATH] [eagle_bar.avx2=results/eagle/avx2]

- `mbpp`: one `python -m decode 'drafters=[student,eagle3,lookup]'` run with chain policies, tree builders and
  `eagle2_svip` (the study's command): each drafter's best chain method and EAGLE-3's best tree, their measured c and
  mean accepted length, and EAGLE-2's tree on EAGLE-3 with and without SVIP deciding its depth.
- `specbench`: the same run on Spec-Bench (tasks in prompts.jsonl): best student and EAGLE-3 methods pooled, and
  the EAGLE-3 best method's speedup on its worst task.
- `avx2`: the MBPP run with torch's kernels capped at AVX2 (an AVX2-only CPU emulated, float32): the best student and
  EAGLE-3 methods, their ratio (the issue's bar there: 1.25) and c; absent: the field is null.
- `heads`: `python -m eval.bar`'s bar.json on EAGLE-3's traces and wall run (results/eagle/heads/bar.json): the
  best head against the best training-free policy, replayed and on the clock, and AUROCs; absent: those stay null.

A field whose run is missing is null, and `missing` says which command fills it. Nothing here times anything.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from utils.cli import UserError, hydra_entry
from utils.files import read_json, write_report

HEAD_KEYS = ("auroc_head", "auroc_max_q", "replay_learned_vs_ev", "replay_ci", "wall_learned_vs_ev")


def is_tree(key: str) -> bool:
    """Whether a `drafter/policy` row ran a tree builder (the policy's class says)."""
    from decode.policies import _class_of, policy_target

    name = key.partition("/")[2].partition(":")[0]
    return bool(getattr(_class_of(policy_target(name), name), "tree", False))


def _best(summary: dict, drafter: str, tree: bool | None) -> str | None:
    """The drafter's fastest method: among its chains (tree False), its trees (True) or all (None)."""
    keys = [k for k, s in summary.items() if isinstance(s, dict) and s.get("drafter") == drafter
            and (tree is None or is_tree(k) == tree)]
    return max(keys, key=lambda k: summary[k]["speedup"]) if keys else None


def _summary(folder: Path | None) -> dict | None:
    return None if folder is None else read_json(folder / "summary.json")


def mbpp_part(summary: dict) -> dict:
    keys = {"student": _best(summary, "student", None), "eagle3": _best(summary, "eagle3", False),
            "lookup": _best(summary, "lookup", None)}
    tree = _best(summary, "eagle3", True)

    def field(key, name):
        return None if key is None else summary[key].get(name)

    return {"student_best": field(keys["student"], "speedup"), "eagle_best": field(keys["eagle3"], "speedup"),
            "eagle_tree_best": field(tree, "speedup"), "lookup_best": field(keys["lookup"], "speedup"),
            "c_student": field(keys["student"], "measured_c"), "c_eagle": field(keys["eagle3"], "measured_c"),
            "tau_student": field(keys["student"], "mean_accepted_length"),
            "tau_eagle": field(keys["eagle3"], "mean_accepted_length"),
            "methods": {"student": keys["student"], "eagle": keys["eagle3"], "eagle_tree": tree,
                        "lookup": keys["lookup"]}}


def task_speedups(folder: Path, method: str) -> dict[str, float]:
    """{task: method's speedup over target-only}, from the decode run's own per-task table (by_task.json)."""
    path = folder / "by_task.json"
    if not path.is_file():
        raise UserError(f"{folder} has no by_task.json; decode a prompt set with tasks (dataset=specbench) there")
    return {t: rows[method]["speedup"] for t, rows in json.loads(path.read_text()).items() if method in rows}


def specbench_part(folder: Path, summary: dict) -> dict:
    student, eagle = _best(summary, "student", None), _best(summary, "eagle3", None)
    tasks = task_speedups(folder, eagle) if eagle else {}
    worst = min(tasks, key=tasks.get) if tasks else None
    return {"student_best": summary[student]["speedup"] if student else None,
            "eagle_best": summary[eagle]["speedup"] if eagle else None,
            "worst_task": None if worst is None else {"task": worst, "speedup": tasks[worst]},
            "by_task": tasks, "methods": {"student": student, "eagle": eagle}}


def heads_part(bar: dict) -> dict:
    """The learned-head fields from an `eval.bar` bar.json on EAGLE-3's traces and wall run: the best head against
    the best training-free policy (the replay's choice; expected value there, as with the student), with the
    replay's paired interval, and the heads' and max q's AUROC on the same rows."""
    replay, wall, auroc = bar.get("replay") or {}, bar.get("wall") or {}, bar.get("auroc") or {}
    return {"auroc_head": auroc.get("head"), "auroc_max_q": auroc.get("max_q"),
            "replay_learned_vs_ev": replay.get("ratio"), "replay_ci": replay.get("ratio_ci"),
            "wall_learned_vs_ev": wall.get("ratio"), "wall_ci": wall.get("ratio_ci"),
            "methods": {"replay": [replay.get("best_learned"), replay.get("best_training_free")],
                        "wall": [wall.get("best_learned"), wall.get("best_training_free")]}}


def avx2_part(folder: Path | None) -> dict | None:
    """The best student and EAGLE-3 methods of the run with the kernels capped at AVX2, their ratio, c and the
    machine string that names the cap; None without the run."""
    s = _summary(folder)
    if s is None:
        return None
    student, eagle = _best(s, "student", None), _best(s, "eagle3", None)
    if student is None or eagle is None:
        raise UserError(f"{folder} has no student and eagle3 rows; rerun it with 'drafters=[student,eagle3]'")
    run = read_json(folder / "run.json") or {}
    return {"student_best": s[student]["speedup"], "eagle_best": s[eagle]["speedup"],
            "ratio": s[eagle]["speedup"] / s[student]["speedup"], "c_student": s[student].get("measured_c"),
            "c_eagle": s[eagle].get("measured_c"), "methods": {"student": student, "eagle": eagle},
            "machine": run.get("machine"), "dtype": run.get("dtype"), "date": run.get("date")}


def gather(mbpp: Path | None, specbench: Path | None, heads: Path | None, avx2: Path | None = None) -> dict:
    out, missing = {"prompts": None}, []
    s = _summary(mbpp)
    if s is None:
        missing.append(f"mbpp: python -m decode 'drafters=[student,eagle3,lookup]' ... out_dir={mbpp}")
        out["mbpp"] = dict.fromkeys(("student_best", "eagle_best", "eagle_tree_best", "lookup_best", "c_student",
                                     "c_eagle", "tau_student", "tau_eagle"))
        out["svip_eagle2"] = {"eagle2": None, "svip_eagle2": None}
    else:
        out["mbpp"] = mbpp_part(s)
        out["prompts"] = next((v["n_prompts"] for v in s.values() if isinstance(v, dict) and "n_prompts" in v), None)
        speed = {k: (s.get(f"eagle3/{k}") or {}).get("speedup") for k in ("eagle2", "eagle2_svip")}
        out["svip_eagle2"] = {"eagle2": speed["eagle2"], "svip_eagle2": speed["eagle2_svip"]}
        run = read_json(mbpp / "run.json") or {}
        out["machine"], out["dtype"], out["date"] = run.get("machine"), run.get("dtype"), run.get("date")
    s = _summary(specbench)
    if s is None:
        missing.append(f"specbench: the same decode on dataset=specbench ... out_dir={specbench}")
        out["specbench"] = {"student_best": None, "eagle_best": None, "worst_task": None}
    else:
        out["specbench"] = specbench_part(specbench, s)
    if heads is not None and heads.is_file():
        out["heads"] = heads_part(json.loads(heads.read_text()))
    else:
        missing.append(f"heads: python -m eval.bar bar.replay=results/eagle/replay_mbpp bar.wall=results/eagle/wall_mbpp "
                       f"bar.out={heads}")
        out["heads"] = dict.fromkeys(HEAD_KEYS)
    out["avx2"] = avx2_part(avx2)
    out["missing"] = missing
    return out


def markdown(res: dict) -> str:
    m, sb = res["mbpp"], res["specbench"]

    def f(x, fmt="{:.2f}"):
        return "—" if x is None else fmt.format(x)

    lines = [f"EAGLE-3 against the student ({res.get('machine')}, {res.get('dtype')}, {res.get('date')}; "
             f"{res['prompts']} MBPP prompts)", "",
             "| | student | EAGLE-3 chain | EAGLE-3 tree | lookup |", "|---|---|---|---|---|",
             f"| MBPP best speedup | {f(m['student_best'])} | {f(m['eagle_best'])} | {f(m['eagle_tree_best'])} | "
             f"{f(m['lookup_best'])} |",
             f"| measured c | {f(m['c_student'], '{:.3f}')} | {f(m['c_eagle'], '{:.3f}')} | | |",
             f"| mean accepted length | {f(m['tau_student'])} | {f(m['tau_eagle'])} | | |",
             f"| Spec-Bench best (pooled) | {f(sb['student_best'])} | {f(sb['eagle_best'])} | | |", "",
             "Best methods: " + ", ".join(f"{k} `{v}`" for k, v in m.get("methods", {}).items() if v) + ". "
             + ("" if not sb.get("worst_task") else f"Spec-Bench's worst task for EAGLE-3's best method: "
                f"{sb['worst_task']['task']} {sb['worst_task']['speedup']:.2f}×."), "",
             f"EAGLE-2's tree on EAGLE-3: {f(res['svip_eagle2']['eagle2'])}×, with SVIP deciding its depth "
             f"{f(res['svip_eagle2']['svip_eagle2'])}×."]
    h = res["heads"]
    if h.get("replay_learned_vs_ev") is not None:
        lo, hi = h["replay_ci"]
        lines += ["", f"Stop heads on EAGLE-3's traces: the best head ÷ the best training-free policy {h['replay_learned_vs_ev']:.3f} "
                  f"[{lo:.3f}, {hi:.3f}] in the replay, {h['wall_learned_vs_ev']:.3f} on the clock; AUROC "
                  f"{h['auroc_head']:.3f} (max q {h['auroc_max_q']:.3f})."]
    a = res.get("avx2")
    if a:
        lines += ["", f"Kernels capped at AVX2 ({a['dtype']}; {a['machine']}): EAGLE-3 {a['eagle_best']:.2f}× against "
                  f"the student's {a['student_best']:.2f}×, ratio {a['ratio']:.3f}; c {a['c_eagle']:.3f} against "
                  f"{a['c_student']:.3f}."]
    if res["missing"]:
        lines += ["", "Missing: " + "; ".join(res["missing"])]
    return "\n".join(lines) + "\n"


@hydra_entry("eagle_bar")
def main(cfg: DictConfig) -> None:
    c = cfg.eagle_bar

    def path(v):
        return None if v in (None, "") else Path(str(v))

    res = gather(path(c.mbpp), path(c.specbench), path(c.get("heads")), path(c.get("avx2")))
    if res["mbpp"]["student_best"] is None and res["specbench"]["student_best"] is None:
        raise UserError(f"no decode run at {c.mbpp} or {c.specbench}; run the commands in conf/study.yaml's "
                        "eagle section first")
    print(write_report(Path(str(c.out)), "bar", res, markdown(res)))


if __name__ == "__main__":
    main()
