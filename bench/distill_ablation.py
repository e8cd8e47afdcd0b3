"""DistillSpec's ablation on a small budget: which divergence and which data make the draft agree best.

    python -m bench.distill_ablation [responses=traces/distill/smollm2_135m-responses] [shards=40] [steps=300]
        [variants=[fkl,tv,jsd,on_policy]] [out_dir=results/bench]

Each variant is one `python -m train.distill` run (its own run folder logs/distill/ablation-<variant>, so a killed
ablation resumes run by run and a finished run is not repeated) with the same seed, data (the folder's first
`shards` shards, all finished: the data job may still be growing it), student and step budget;
only the variant's overrides differ (conf/bench/distill_ablation.yaml: forward KL, total variation, Jensen-Shannon,
and forward KL with half the steps on the student's own continuations scored by the teacher — DistillSpec's
"on-policy" data, Zhou et al. 2024, arXiv 2310.08461, §5). They are compared on what train.distill measures on its
held-out prompts after training: Σmin(p,q) (acceptance under exact sampling), greedy agreement, Σmin on raw
WikiText-2 text. The winner is the variant with the highest held-out Σmin. Writes distill_ablation.{json,md}.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml
from omegaconf import DictConfig

from bench import ablation_variants, command, repo_path, write_result
from utils.cli import UserError, hydra_entry

METRICS = (("heldout_sum_min", "held-out Σmin(p,q)"), ("heldout_greedy_agree", "held-out greedy agreement"),
           ("heldout_text_sum_min", "WikiText-2 Σmin(p,q)"))


def run_variant(cfg: DictConfig, name: str, overrides: list[str]) -> dict:
    """One training run (resumed if its folder holds a checkpoint); its metrics json."""
    run = f"ablation-{name}"
    run_dir = repo_path(cfg.log_dir) / "distill" / run
    out = run_dir / "student.json"
    recipe = [f"data.responses={cfg.responses}", f"data.max_shards={int(cfg.shards)}", f"train.max_steps={int(cfg.steps)}",
              f"seed={int(cfg.seed)}", *[str(o) for o in cfg.base], *overrides]
    if out.is_file():
        check_finished(run_dir, recipe)
    else:
        args = [sys.executable, "-m", "train.distill", f"name={run}", f"hydra.run.dir={run_dir}", "measure_cost=false",
                *recipe]
        print("$ " + " ".join(args[1:]), flush=True)
        if subprocess.run(args, cwd=repo_path(".")).returncode != 0 or not out.is_file():
            raise UserError(f"the {name} run did not finish (see {run_dir}); rerun this command to resume it")
    return json.loads(out.read_text())


def check_finished(run_dir: Path, recipe: list[str]) -> None:
    """A finished run is reused only if it was trained with this ablation's recipe (its train_signature.json holds
    every `key=value` of `recipe` that a signature records): a run left by another ablation (other shards, steps,
    data) is refused in one line, never silently reported as this one."""
    path = run_dir / "train_signature.json"
    sig = json.loads(path.read_text()) if path.is_file() else {}
    missing = object()
    differ = []
    for item in recipe:
        key, _, want = item.partition("=")
        got: object = sig
        for part in key.split("."):
            got = got.get(part, missing) if isinstance(got, dict) else missing
        if got is missing:  # not part of a run's recipe (pair=, train.val_every=, ...): train.distill checks those
            continue
        value = yaml.safe_load(want) if want else want  # the override's value as the run's config held it
        if got != value and str(got) != str(value):
            differ.append(f"{key} {got} (want {want})")
    if differ:
        raise UserError(f"{run_dir} holds a finished run with another recipe ({'; '.join(differ)}); delete it or pass "
                        "log_dir=<another folder> to run this ablation")


def table(rows: dict) -> str:
    head = "| variant | overrides | " + " | ".join(label for _, label in METRICS) + " | best step |"
    lines = [head, "|" + "---|" * (len(METRICS) + 3)]
    for name, r in rows.items():
        vals = " | ".join(f"{r['after'][k]:.3f}" for k, _ in METRICS)
        lines.append(f"| {name} | `{' '.join(r['overrides']) or '—'}` | {vals} | {r['best_step']} |")
    return "\n".join(lines)


def run(cfg: DictConfig) -> dict:
    if not Path(str(cfg.responses)).is_dir():
        raise UserError(f"responses={cfg.responses} is not a folder; make it with `python -m train.distill_data`")
    rows = {}
    for name, overrides in ablation_variants(cfg, "distill_ablation").items():
        m = run_variant(cfg, name, overrides)
        rows[name] = {"overrides": overrides, "after": m["after"], "before": m["before"],
                           "best_step": m["best_step"], "steps": m["steps"],
                           "train_minutes": round(m["train_minutes"], 1), "train_positions": m["train_positions"]}
    winner = max(rows, key=lambda n: rows[n]["after"]["heldout_sum_min"])
    result = {"command": command("distill_ablation"), "responses": str(cfg.responses), "shards": int(cfg.shards),
              "steps": int(cfg.steps),
              "winner": winner, "variants": rows, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    md = [f"`{result['command']}` ({result['date_utc']}; {cfg.steps} steps each on the first {cfg.shards} shards, "
          "same seed)", "", table(rows), "", f"Winner by held-out Σmin(p,q): **{winner}**."]
    write_result(cfg.out_dir, "distill_ablation", result, md)
    return result


if __name__ == "__main__":
    hydra_entry("bench/distill_ablation")(run)()
