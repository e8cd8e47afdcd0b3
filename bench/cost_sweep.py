"""What a stop head's lead over the best training-free rule depends on: the cost of a draft step (issue 16).

    python -m bench.cost_sweep [scales=[0.5,1,1.5,2,3,4]] [cost_profile=results/stop_heads/profile.json]
                               [out_dir=results/stop_heads] [work=DIR] [n_resamples=2000]

Replays results/stop_heads' study (conf/experiment/study/stop_heads.yaml: every policy and head tuned on MBPP
validation, replayed on the 500 test prompts) under the measured cost profile with every draft time multiplied by
each scale (`replay.draft_scale`: the target's verification curve stays as measured). Same traces, heads and grids
each time, so what changes is only what a drafted token costs, i.e. what a wrong stop decision costs. Per scale:
c, the best learned and best training-free speedups, their ratio and the share of the static-K-opt → oracle gap the
best learned method closes, with eval.bar's paired bootstrap intervals. Writes cost_sweep.json / .md / .png under
out_dir; each replay's own folder goes under `work` (default: a temporary directory).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from omegaconf import DictConfig

from bench import command, repo_path, write_result
from eval.bar import replay_bar
from utils.cli import UserError, hydra_entry, run_stage

TRACES = "traces/smollm2_135m--mbpp--target_ar-t0-p1-n128-s0--"


def replay(scale: float, profile: str, out: Path) -> None:
    run_stage(["-m", "eval.replay", "+experiment=study/stop_heads", f"replay.tune={TRACES}validation",
               f"replay.eval={TRACES}test-lim500", f"replay.c_from={profile}", f"replay.draft_scale={scale}",
               "replay.synthetic_auroc=[]", f"replay.out_dir={out}"], f"the replay at draft_scale={scale:g}")


def plot(rows: list[dict], path: Path) -> None:
    from utils.plotting import pyplot

    plt = pyplot()
    c = [r["c"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    a1.plot(c, [r["ratio"] for r in rows], "o-", label="best learned ÷ best training-free")
    a1.fill_between(c, [r["ratio_ci"][0] for r in rows], [r["ratio_ci"][1] for r in rows], alpha=0.2)
    a1.axhline(1.05, ls="--", c="gray", lw=0.8, label="bar 1.05")
    a1.set_xlabel("c = draft step ÷ target step")
    a1.set_ylabel("replayed speedup ratio")
    a1.legend(fontsize=7)
    a2.plot(c, [r["gap_closed"] for r in rows], "o-", c="C1", label="gap closed (static K-opt → oracle)")
    a2.fill_between(c, [r["gap_closed_ci"][0] for r in rows], [r["gap_closed_ci"][1] for r in rows], alpha=0.2,
                    color="C1")
    a2.axhline(0.5, ls="--", c="gray", lw=0.8, label="bar 0.5")
    a2.set_xlabel("c = draft step ÷ target step")
    a2.legend(fontsize=7)
    fig.suptitle("Stop head's lead vs the cost of a draft step (500 MBPP test prompts, cost-model replay)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: DictConfig) -> None:
    profile, scales = str(cfg.cost_profile), [float(s) for s in cfg.scales]
    if not repo_path(profile).is_file():
        raise UserError(f"no cost profile at {profile}; make one with python -m decode.profile out={profile}")
    if any(s <= 0 for s in scales):
        raise UserError(f"scales must all be > 0, got {scales}")
    work = repo_path(cfg.work) if cfg.work else Path(tempfile.mkdtemp(prefix="cost_sweep-"))
    rows = []
    for scale in sorted(scales):
        folder = work / f"scale{scale:g}"
        replay(scale, profile, folder)
        bar = replay_bar(folder, int(cfg.n_resamples))
        r, sp = bar["replay"], bar["replay"]["speedup"]
        rows.append({"draft_scale": scale, "c": bar["replay_settings"]["c"], "best_learned": r["best_learned"],
                     "best_training_free": r["best_training_free"], "learned": sp[r["best_learned"]],
                     "training_free": sp[r["best_training_free"]], "static_opt": sp.get("static_opt"),
                     "oracle": sp.get("oracle"), "ratio": r["ratio"], "ratio_ci": r["ratio_ci"],
                     "gap_closed": r["gap_closed"], "gap_closed_ci": r["gap_closed_ci"]})
    out = repo_path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot(rows, out / "cost_sweep.png")
    lines = [f"The stop head's lead vs the cost of a draft step (`{command('cost_sweep')}`, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}): results/stop_heads' replay (tuned on MBPP "
             f"validation, 500 test prompts) under `{profile}` with its draft times scaled "
             "(`replay.draft_scale`; scale 1 is the study itself). 95% paired bootstrap intervals over prompts.", "",
             "| draft scale | c | best learned | best training-free | static K-opt | oracle | ratio [95% CI] "
             "| gap closed [95% CI] |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['draft_scale']:g} | {r['c']:.3f} | {r['learned']:.3f} ({r['best_learned']}) | "
                     f"{r['training_free']:.3f} ({r['best_training_free']}) | {r['static_opt']:.3f} | "
                     f"{r['oracle']:.3f} | {r['ratio']:.3f} [{r['ratio_ci'][0]:.3f}, {r['ratio_ci'][1]:.3f}] | "
                     f"{r['gap_closed']:.2f} [{r['gap_closed_ci'][0]:.2f}, {r['gap_closed_ci'][1]:.2f}] |")
    write_result(out, "cost_sweep", {"profile": profile, "rows": rows}, lines)


if __name__ == "__main__":
    hydra_entry("bench/cost_sweep")(run)()
