"""EAGLE-3's ablation on a small budget (issue 53): training-time test on or off, one target feature layer or three.

    python -m bench.eagle_ablation [steps=300] [variants=[ttt3_layers3,ttt1_layers3,ttt3_layer27]] [out_dir=results/bench]

Each variant is one `python -m train.eagle` run (its own run folder logs/eagle/ablation-<variant>, so a killed
ablation resumes run by run and a finished one is not repeated) with the same seed, data, step budget and schedule;
only its overrides differ (conf/bench/eagle_ablation.yaml): `train.ttt_steps=1` trains every position on the
target's own features only (no drafting-time inputs), `model.layers=[27,27,27]` fuses the high layer alone (three
copies, so the draft's size is unchanged). They are compared on what train.eagle measures on its held-out prompts:
top-1 agreement with the target by drafting step 1..5 — the chain's acceptance of its j-th token given the ones
before it were accepted. Writes eagle_ablation.{json,md}.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from omegaconf import DictConfig

from bench import ablation_variants, command, repo_path, write_result
from utils.cli import UserError, hydra_entry


def run_variant(cfg: DictConfig, name: str, overrides: list[str]) -> dict:
    """One training run (resumed if its folder holds a checkpoint); its .train.json."""
    run_dir = repo_path(cfg.log_dir) / "eagle" / f"ablation-{name}"
    out = run_dir / "draft.safetensors"
    recipe = [f"train.max_steps={int(cfg.steps)}", f"seed={int(cfg.seed)}", *[str(o) for o in cfg.base], *overrides]
    info = out.with_suffix(".train.json")
    if info.is_file():
        done = json.loads(info.read_text())
        if done.get("command") != " ".join(["python -m train.eagle", *_args(name, run_dir, out, recipe)]):
            raise UserError(f"{run_dir} holds a finished run of another recipe ({done.get('command')}); delete it or "
                            "pass log_dir=<another folder>")
        return done
    args = [sys.executable, "-m", "train.eagle", *_args(name, run_dir, out, recipe)]
    print("$ " + " ".join(args[1:]), flush=True)
    if subprocess.run(args, cwd=repo_path(".")).returncode != 0 or not info.is_file():
        raise UserError(f"the {name} run did not finish (see {run_dir}); rerun this command to resume it")
    return json.loads(info.read_text())


def _args(name, run_dir, out, recipe) -> list[str]:
    return [f"name=ablation-{name}", f"run_dir={run_dir}", f"out={out}", *recipe]


def table(rows: dict, steps: int) -> list[str]:
    head = "| variant | overrides | " + " | ".join(f"step {j}" for j in range(1, steps + 1)) + " | code, step 1 | " \
           "chat, step 1 |"
    lines = [head, "|" + "---|" * (steps + 4)]
    for name, r in rows.items():
        a = r["agreement"]
        vals = " | ".join(f"{x:.3f}" for x in a["all"][:steps])
        lines.append(f"| {name} | `{' '.join(r['overrides']) or '—'}` | {vals} | {a.get('code', [0])[0]:.3f} | "
                     f"{a.get('chat', [0])[0]:.3f} |")
    return lines


def run(cfg: DictConfig) -> dict:
    rows = {}
    for name, overrides in ablation_variants(cfg, "eagle_ablation").items():
        info = run_variant(cfg, name, overrides)
        rows[name] = {"overrides": overrides, "agreement": info["heldout_top1_agreement_by_step"],
                           "steps": info["steps"], "ttt_steps": info["ttt_steps"], "layers": info["layers"],
                           "train_minutes": info["train_minutes"], "positions": info["data"]["positions"]}
    result = {"command": command("eagle_ablation"), "steps": int(cfg.steps), "variants": rows,
              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    md = [f"`{result['command']}` ({result['date_utc']}; {cfg.steps} steps of 4,096 padded tokens each, same seed, "
          "data and schedule). Held-out top-1 agreement with the target by drafting step, all domains, then step 1 "
          "on code and chat (no wall time: a resumed run times only its last invocation, and the runs shared the "
          "machine unevenly):", "", *table(rows, 5)]
    write_result(cfg.out_dir, "eagle_ablation", result, md)
    return result


if __name__ == "__main__":
    hydra_entry("bench/eagle_ablation")(run)()
