"""`python -m eval.bar`: issue 16's bar — do learned stop heads beat the best training-free policy? — as one JSON.

    python -m eval.bar bar.replay=results/stop_heads/replay_mbpp bar.wall=results/stop_heads/wall_mbpp \
        bar.out=results/stop_heads/bar.json

Reads an `eval.replay` folder (replay.json + prompts.jsonl: cost-model speedups on greedy traces, tuned on
validation) and a `decode` folder (summary.json + prompts.jsonl: wall clock on test prompts), and writes

    {"replay": {"prompts", "best_learned", "best_training_free", "speedup": {method: x}, "ratio", "ratio_ci",
                "gap_closed", "gap_closed_ci"},
     "wall": {"prompts", "best_learned", "best_training_free", "speedup", "ratio", "ratio_ci"},
     "auroc": {"head", "max_q", "neg_entropy"}, "carry_over": {name: {"groups": {group: {...}}}}, "settings": {...}}

ratio = best learned ÷ best training-free speedup; gap_closed = the share of the static K-opt → oracle gap the best
learned method closes. "Best" is the highest speedup on these test prompts (every method's parameters were chosen
on validation); training-free = every replayed policy except the heads, the oracle and the synthetic heads. The
intervals are 95% BCa bootstraps over prompts, paired: one draw of prompts serves every method, and each draw
recomputes the speedups as the tables do (ratios of sums; decode.metrics). The wall run's best methods are the
replay's (decode them with the replay's tuned.json), so the wall clock checks the replay's verdict. `bar.carry_over`
lists replays on other prompt sets (HumanEval, Spec-Bench) tuned on MBPP validation: per Spec-Bench task, every
method's speedup and the ratio of the MBPP verdict's two methods.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from decode.metrics import oracle_gap_closed
from utils.cli import UserError, hydra_entry
from utils.files import jsonl_path, read_jsonl
from utils.stats import bootstrap_ci


def key_class(key: str):
    """The policy class of a method key (`learned:disco_mbpp`, `svip[h=0.3]`, `oracle`), found by the policy's name as
    decode finds it; None for a key that names no policy (the replay's synthetic heads)."""
    from decode.policies import policy_class

    return policy_class(key.rpartition("/")[2].split(":")[0].split("[")[0])  # without a `drafter/` prefix


def is_learned(key: str) -> bool:
    cls = key_class(key)
    return cls is not None and cls.learned


def is_training_free(key: str) -> bool:
    """Neither a head nor the oracle (nor a synthetic head): what a user can run without training anything."""
    cls = key_class(key)
    return cls is not None and not cls.learned and not cls.oracle


def per_prompt(path: Path, methods: list[str], fields: tuple[str, ...]) -> tuple[list[str], dict]:
    """{method: {field: array over prompts}} from a prompts.jsonl, on the prompts every listed method has."""
    if jsonl_path(path) is None:
        raise UserError(f"{path} is missing; rerun the replay / decode that made its folder")
    rows: dict[str, dict[str, dict]] = {m: {} for m in methods}
    for r in read_jsonl(path):
        if r["method"] in rows:
            rows[r["method"]][str(r["prompt_id"])] = r
    ids = sorted(set.intersection(*(set(v) for v in rows.values())))
    if len(ids) < 3:
        raise UserError(f"{path} has {len(ids)} prompts shared by {methods}; the bar needs the same prompts for all")
    return ids, {m: {f: np.array([rows[m][i][f] for i in ids], dtype=float) for f in fields} for m in methods}


def drafter_prefix(keys) -> str:
    """`<drafter>/` when every method key of a table carries that one drafter (a replay or decode with
    `drafters=[name]`), else ''."""
    heads = {k.partition("/")[0] for k in keys if "/" in k}
    return f"{heads.pop()}/" if len(heads) == 1 and all("/" in k for k in keys) else ""


def best(speedups: dict, pick) -> str:
    keys = [k for k in speedups if pick(k)]
    if not keys:
        raise UserError(f"no {'learned' if pick is is_learned else 'training-free'} method among {sorted(speedups)}")
    return max(keys, key=speedups.get)


def replay_bar(folder: Path, n_resamples: int) -> dict:
    """The replay half: speedups under the cost model, ratio and gap closed with paired intervals."""
    try:
        result = json.loads((folder / "replay.json").read_text())
    except FileNotFoundError:
        raise UserError(f"{folder} has no replay.json; run python -m eval.replay replay.out_dir={folder}") from None
    table = result["eval"]
    speed = {k: r["cost_model_speedup"] for k, r in table.items() if not k.startswith("synthetic")}
    learned, free = best(speed, is_learned), best(speed, is_training_free)
    pre = drafter_prefix(speed)
    lo, hi = f"{pre}static_opt", f"{pre}oracle"
    need = [learned, free] + [k for k in (lo, hi) if k in speed]
    ids, pp = per_prompt(folder / "prompts.jsonl", need, ("cost_ms", "target_cost_ms"))

    def stat(idx, axis=-1):  # every method generates the same tokens per prompt: speedup = Σ target cost ÷ Σ cost
        s = {m: pp[m]["target_cost_ms"][idx].sum(-1) / pp[m]["cost_ms"][idx].sum(-1) for m in need}
        out = [s[learned] / s[free]]
        if hi in s and lo in s:
            out.append(oracle_gap_closed(s[learned], s[lo], s[hi]))
        return np.stack(out)

    cis = bootstrap_ci(len(ids), stat, n_resamples)
    full = stat(np.arange(len(ids)))
    out = {"prompts": len(ids), "best_learned": learned, "best_training_free": free,
           "speedup": {k: round(v, 4) for k, v in sorted(speed.items(), key=lambda kv: -kv[1])},
           "ratio": float(full[0]), "ratio_ci": cis[0]}
    if len(full) > 1:
        out.update(gap_closed=float(full[1]), gap_closed_ci=cis[1])
    aurocs = {"head": table[learned].get("score_auroc"),
              "max_q": (table.get(f"{pre}max_confidence") or {}).get("score_auroc"),
              "neg_entropy": (table.get(f"{pre}svip") or table.get(f"{pre}adaedl") or {}).get("score_auroc")}
    settings = {k: result["settings"].get(k) for k in ("tune", "eval", "c", "c_from", "pair", "date")}
    return {"replay": out, "auroc": aurocs, "replay_settings": settings}


def decoded_key(summary: dict, key: str) -> str | None:
    """The decode run's key for a replay method key: the same, or `learned` for `learned:<stem>` when that head ran
    alone (decode keys a head by its file stem only beside another head)."""
    if key in summary:
        return key
    name, _, stem = key.partition(":")
    ckpt = ((summary.get(name) or {}).get("params") or {}).get("ckpt")
    return name if stem and ckpt and Path(str(ckpt)).stem == stem else None


def wall_bar(folder: Path, learned: str, free: str, n_resamples: int) -> dict:
    """The wall-clock half: the replay's best learned and training-free methods, decoded on test prompts."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except FileNotFoundError:
        raise UserError(f"{folder} has no summary.json; decode with python -m decode out_dir={folder}") from None
    missing = [m for m in (learned, free) if decoded_key(summary, m) is None]
    learned, free = decoded_key(summary, learned) or learned, decoded_key(summary, free) or free
    if missing:
        raise UserError(f"{folder} did not decode {missing}: decode the replay's best methods "
                        f"(policies=[...] tuned=<replay>/tuned.json), keyed as in the replay")
    methods = ["target", learned, free]
    ids, pp = per_prompt(folder / "prompts.jsonl", methods, ("new_tokens", "wall_s"))

    def stat(idx, axis=-1):
        tps = {m: pp[m]["new_tokens"][idx].sum(-1) / pp[m]["wall_s"][idx].sum(-1) for m in methods}
        return np.stack([tps[learned] / tps[free]])

    run = json.loads((folder / "run.json").read_text()) if (folder / "run.json").is_file() else {}
    return {"prompts": len(ids), "best_learned": learned, "best_training_free": free,
            "speedup": {m: summary[m]["speedup"] for m in (learned, free)},
            "cost_model_speedup": {m: summary[m].get("cost_model_speedup") for m in (learned, free)},
            "ratio": float(stat(np.arange(len(ids)))[0]), "ratio_ci": bootstrap_ci(len(ids), stat, n_resamples)[0],
            "machine": run.get("machine"), "dtype": run.get("dtype")}


def prompt_groups(trace_folder: Path) -> dict[str, str]:
    """prompt_id → group of a trace folder's prompts: the Spec-Bench task (SVIP's columns) or the dataset's name."""
    from omegaconf import OmegaConf

    from data_gen.prompts import load_prompts
    from data_gen.store import read_manifest

    dataset = OmegaConf.create(read_manifest(trace_folder)["config"]["dataset"])
    return {p.prompt_id: p.meta.get("task", str(dataset.name)) for p in load_prompts(dataset, "all")}


def carry_over(folder: Path, learned: str, free: str) -> dict:
    """An eval.replay run on another prompt set with the MBPP-validation choices (replay.tune = MBPP validation):
    per group (Spec-Bench task; else the whole set), every method's cost-model speedup and the MBPP verdict's two
    methods' ratio."""
    try:
        result = json.loads((folder / "replay.json").read_text())
    except FileNotFoundError:
        raise UserError(f"{folder} has no replay.json; run python -m eval.replay replay.out_dir={folder}") from None
    methods = [k for k in result["eval"] if not k.startswith("synthetic") and k != "target"]
    missing = [m for m in (learned, free) if m not in methods]
    if missing:
        raise UserError(f"{folder} did not replay {missing}; replay the same policies as the MBPP run")
    ids, pp = per_prompt(folder / "prompts.jsonl", methods, ("cost_ms", "target_cost_ms"))
    groups = prompt_groups(Path(result["settings"]["eval"]))
    out = {"tune": result["settings"].get("tune"), "eval": result["settings"].get("eval"), "groups": {}}
    for g in ["all", *sorted({groups.get(i, "?") for i in ids})]:
        idx = np.array([g == "all" or groups.get(i, "?") == g for i in ids])
        sp = {m: float(pp[m]["target_cost_ms"][idx].sum() / pp[m]["cost_ms"][idx].sum()) for m in methods}
        out["groups"][g] = {"prompts": int(idx.sum()), "ratio": sp[learned] / sp[free],
                            "best_training_free_here": best(sp, is_training_free), "speedup": sp}
    return out


def run(cfg: DictConfig) -> dict:
    bc = cfg.bar
    if not bc.get("replay"):
        raise UserError("pass bar.replay=DIR (an eval.replay out_dir on test traces) and optionally bar.wall=DIR")
    n = int(bc.n_resamples)
    out = replay_bar(Path(str(bc.replay)), n)
    if bc.get("wall"):
        out["wall"] = wall_bar(Path(str(bc.wall)), out["replay"]["best_learned"], out["replay"]["best_training_free"], n)
    carry = [Path(str(d)) for d in (bc.get("carry_over") or [])]
    if carry:
        r = out["replay"]
        out["carry_over"] = {d.name: carry_over(d, r["best_learned"], r["best_training_free"]) for d in carry}
    out["settings"] = {"replay": str(bc.replay), "wall": bc.get("wall") and str(bc.wall), "n_resamples": n,
                       "interval": "95% BCa bootstrap over prompts, paired across methods",
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    path = Path(str(bc.out))
    path.parent.mkdir(parents=True, exist_ok=True)
    from data_gen.store import write_json_atomic

    write_json_atomic(path, out)
    r = out["replay"]
    print(f"replay ({r['prompts']} prompts): {r['best_learned']} / {r['best_training_free']} = {r['ratio']:.3f} "
          f"[{r['ratio_ci'][0]:.3f}, {r['ratio_ci'][1]:.3f}]"
          + (f", gap closed {r['gap_closed']:.2f}" if "gap_closed" in r else ""))
    if "wall" in out:
        w = out["wall"]
        print(f"wall ({w['prompts']} prompts): {w['ratio']:.3f} [{w['ratio_ci'][0]:.3f}, {w['ratio_ci'][1]:.3f}]")
    for name, c in (out.get("carry_over") or {}).items():
        print(f"{name}: " + ", ".join(f"{g} {v['ratio']:.3f} ({v['prompts']})" for g, v in c["groups"].items()))
    print(f"AUROC: {out['auroc']}")
    print(f"wrote {path}")
    return out


@hydra_entry("bar")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
