"""Labels and loss weights for the disco_plus head (issue 16, item 3): do SpecDec++'s choices buy speed here?

    python -m bench.label_variants [out_dir=results/stop_heads] [cost_profile=results/stop_heads/profile.json]
        [work=DIR]

Trains the disco_plus head of results/stop_heads (`+experiment=disco_plus_mbpp split_limits.test=500`, MBPP
511-570, calibrated on 571-600) once per variant — greedy-match labels (the shipped head), SpecDec++'s soft
min(1, p/q) labels, soft Σmin(p, q), rejected rows weighted 6×, soft labels with that weight, and the full SpecDec++
recipe (soft labels, weight 6, rows weighted by their soft reachability Π min(1, p/q) of the round's earlier rows) —
then replays them all beside the expected-value rule on max q in one `python -m eval.replay` run (study grid, tuned on
validation, 500 test prompts, the study's cost profile). Every score AUROC there is against greedy acceptance, so the
soft-label heads are compared on the decoder's own event. Writes label_variants.json / .md under out_dir.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time

from omegaconf import DictConfig

from bench import command, repo_path, write_result
from utils.cli import UserError, hydra_entry, run_stage

TRACES = "traces/smollm2_135m--mbpp--target_ar-t0-p1-n128-s0--"
VARIANTS = {
    "greedy_match": [],
    "accept_prob": ["labels=accept_prob"],
    "sum_min": ["labels=sum_min"],
    "greedy_match_rw6": ["data.reject_weight=6"],
    "accept_prob_rw6": ["labels=accept_prob", "data.reject_weight=6"],
    "specdecpp_recipe": ["labels=accept_prob", "data.reject_weight=6", "labels.reach=soft", "labels.reach_weight=0"],
}


def run(cfg: DictConfig) -> None:
    profile = str(cfg.cost_profile)
    if not repo_path(profile).is_file():
        raise UserError(f"no cost profile at {profile}; make one with python -m decode.profile out={profile}")
    work = repo_path(cfg.work or tempfile.mkdtemp(prefix="label_variants-")).resolve()
    heads = {}
    for name, overrides in VARIANTS.items():
        run_dir = work / name
        run_stage(["-m", "train", "+experiment=disco_plus_mbpp", "split_limits.test=500", "logger=csv",
                   f"experiment_name=disco_plus_{name}", f"hydra.run.dir={run_dir}", *overrides], f"training {name}")
        heads[name] = work / f"disco_plus_{name}.ckpt"  # the replay names a head by its file's stem
        shutil.copyfile(run_dir / "checkpoints" / "best.ckpt", heads[name])
    policies = ",".join(["static_opt", "expected_value", "oracle", *(f"learned:{p}" for p in heads.values())])
    run_stage(["-m", "eval.replay", "+experiment=study/stop_heads", f"replay.tune={TRACES}validation",
               f"replay.eval={TRACES}test-lim500", f"replay.c_from={profile}", "replay.synthetic_auroc=[]",
               f"replay.out_dir={work / 'replay'}", f"policies=[{policies}]"], "the replay")
    table = json.loads((work / "replay" / "replay.json").read_text())["eval"]
    free = table["expected_value"]["cost_model_speedup"]
    rows = {}
    for name in VARIANTS:
        r = table[f"learned:disco_plus_{name}"]
        rows[name] = {"overrides": VARIANTS[name], "auroc_greedy": r.get("score_auroc"),
                      "speedup": r["cost_model_speedup"], "ratio": r["cost_model_speedup"] / free}
    result = {"command": command("label_variants"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "profile": profile, "expected_value": free, "static_opt": table["static_opt"]["cost_model_speedup"],
              "oracle": table["oracle"]["cost_model_speedup"], "variants": rows}
    lines = [f"Labels and loss weights for the disco_plus head (`{result['command']}`, {result['date']}): each variant "
             "trained as results/stop_heads' head, then all replayed in one run (study grid, tuned on MBPP validation, "
             f"500 test prompts, `{profile}`). Expected value on max q {free:.3f}, static K-opt "
             f"{result['static_opt']:.3f}, oracle {result['oracle']:.3f}.", "",
             "| variant | overrides | test AUROC (greedy acceptance) | cost-model speedup | ÷ expected value on max q |",
             "|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {' '.join(r['overrides']) or '(the shipped head)'} | {r['auroc_greedy']:.3f} | "
                     f"{r['speedup']:.3f} | {r['ratio']:.3f} |")
    write_result(repo_path(cfg.out_dir), "label_variants", result, lines)


if __name__ == "__main__":
    hydra_entry("bench/label_variants")(run)()
