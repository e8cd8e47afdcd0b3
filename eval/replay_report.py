"""What a replay writes: replay.json / replay.md / prompts.jsonl / tuned.json / replay_auroc.png, the markdown table,
the replayed-vs-decoded comparison and the share of the static → oracle gap each method closes (eval.replay)."""

from __future__ import annotations

import json
from pathlib import Path

from decode import wandb_log
from decode.metrics import oracle_gap_closed
from utils.cli import output_dir
from utils.files import write_jsonl


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"Cost-model replay on greedy traces (`python -m eval.replay`): tuned on `{s['tune']}` "
        f"({s['tune_rows']} rows), replayed on `{s['eval']}` ({s['eval_rows']} rows); c = {s['c']:.3f} "
        f"({s['c_from']}); pair {s['pair']}; {s['date']}.",
        "",
        "| method | chosen | score AUROC | cost-model speedup | accept | mean acc len | draft calls/tok | mean K | "
        "past rejection |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in result["eval"].items():
        chosen = result["chosen"].get(key) or ""
        if isinstance(chosen, dict):
            chosen = ", ".join(f"{k}={v}" for k, v in chosen.items())
        auroc = r.get("score_auroc", r.get("realised_auroc"))
        auroc = "–" if auroc is None else f"{auroc:.3f}"
        lines.append(f"| {key} | {chosen} | {auroc} | {r['cost_model_speedup']:.3f} | {r['acceptance_rate']:.3f} | "
                     f"{r['mean_accepted_length']:.2f} | {r['draft_calls_per_token']:.3f} | {r['mean_draft_length']:.2f} | "
                     f"{r['past_rejection']:.3f} |")
    lines += ["", "Past rejection: share of rounds that drafted beyond their first rejected token; there a policy that "
                  "reads features sees on-path rows the decoder would not have seen, so those rounds' lengths are "
                  "approximate (constant K and static K read none: exact)."]
    comp = result.get("compare")
    if comp:
        lines += ["", f"Replayed vs decoded (`{result['settings']['compare']}`, same prompts):", "",
                  "| method | mean acc len replay | decode | accept replay | decode | draft calls/tok replay | decode |",
                  "|---|---|---|---|---|---|---|"]
        for k, r in comp.items():
            lines.append(f"| {k} | {r['mean_accepted_length_replay']:.3f} | {r['mean_accepted_length_decode']:.3f} | "
                         f"{r['acceptance_rate_replay']:.3f} | {r['acceptance_rate_decode']:.3f} | "
                         f"{r['draft_calls_per_token_replay']:.3f} | {r['draft_calls_per_token_decode']:.3f} |")
    gap = result.get("gap")
    if gap:
        lines += ["", "Static K-opt → oracle gap closed (cost model): "
                      + ", ".join(f"{k} {v:.0%}" for k, v in gap.items()) + "."]
    if result.get("skipped"):
        lines += ["", "Not replayed: " + "; ".join(f"{k} ({v})" for k, v in result["skipped"].items()) + "."]
    return "\n".join(lines) + "\n"


def compare(table: dict, run_dir: Path) -> dict:
    """Replayed vs decoded call counts per method, from a decode run on the eval traces' prompts (its summary.json):
    the mean accepted length follows from accepted counts (exact for stateless policies); acceptance rate and draft
    calls per token also count tokens drafted past a rejection (approximate). Timing-free: any machine's run will do."""
    decoded = json.loads((Path(run_dir) / "summary.json").read_text())
    keys = ("mean_accepted_length", "acceptance_rate", "draft_calls_per_token")

    def twin(key):  # a head is keyed `learned` when decoded alone, `learned:<stem>` beside another head
        if key in decoded:
            return decoded[key]
        name, _, stem = key.partition(":")
        alone = decoded.get(name) or {}
        return alone if stem and Path(str((alone.get("params") or {}).get("ckpt"))).stem == stem else None

    return {k: {**{f"{q}_replay": r[q] for q in keys}, **{f"{q}_decode": d[q] for q in keys}}
            for k, r in table.items() if (d := twin(k)) is not None}


def gap_closed(table: dict) -> dict:
    """Share of the static_opt → oracle cost-model gap each other method closes (negative: below static_opt)."""
    from eval.bar import drafter_prefix

    pre = drafter_prefix([k for k in table if not k.startswith("synthetic")])
    ends = (f"{pre}static_opt", f"{pre}oracle")
    if any(k not in table for k in ends):
        return {}
    lo, hi = (table[k]["cost_model_speedup"] for k in ends)
    if hi <= lo:
        return {}
    return {k: oracle_gap_closed(r["cost_model_speedup"], lo, hi) for k, r in table.items() if k not in ends}


def plot(result: dict, path: Path) -> Path | None:
    syn = {k: v for k, v in result["eval"].items() if k.startswith("synthetic[")}
    if not syn:
        return None
    from utils.plotting import pyplot

    plt = pyplot()

    from eval.plots import _save

    fig, ax = plt.subplots(figsize=(6, 4.2))
    xs = [v["realised_auroc"] for v in syn.values()]
    ax.plot(xs, [v["cost_model_speedup"] for v in syn.values()], "o-", color="k", label="synthetic head")
    scored = [(k, r) for k, r in result["eval"].items() if r.get("score_auroc") is not None]
    for i, (k, r) in enumerate(scored):
        ax.plot(r["score_auroc"], r["cost_model_speedup"], "s", color=f"C{i % 10}", label=k)
    for k, style in (("oracle", ":"), ("static_opt", "--")):
        if k in result["eval"]:
            ax.axhline(result["eval"][k]["cost_model_speedup"], ls=style, color="grey", lw=1)
            ax.annotate(k, (ax.get_xlim()[0], result["eval"][k]["cost_model_speedup"]), fontsize=7, color="grey",
                        xytext=(2, 2), textcoords="offset points")
    ax.set_xlabel("AUROC of the score the policy thresholds (eval traces)")
    ax.set_ylabel("cost-model speedup")
    ax.set_title("What a stop rule of a given AUROC gains")
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def write_outputs(result: dict, table: dict, chosen: list, rc, synthetic: bool) -> None:
    """Write a replay's files under replay.out_dir and print its table (`table`'s per-prompt rows go to
    prompts.jsonl, not replay.json)."""
    out = output_dir(rc.get("out_dir"))
    out.mkdir(parents=True, exist_ok=True)
    per_prompt = {k: r.pop("per_prompt") for k, r in table.items() if "per_prompt" in r}
    (out / "replay.json").write_text(json.dumps(result, indent=1) + "\n")
    # one row per (method, eval continuation): what eval.bar's paired bootstrap resamples
    write_jsonl(out / "prompts.jsonl", (
        {"method": key, "prompt_id": pid, "new_tokens": pp["new_tokens"][i], "cost_ms": pp["cost_ms"][i],
         "target_cost_ms": pp["target_cost_ms"][i]}
        for key, pp in per_prompt.items() for i, pid in enumerate(pp["prompt_id"])))
    (out / "replay.md").write_text(markdown(result))
    # decode's tuned.json format: `python -m decode ... tuned=OUT/tuned.json` decodes with the replay's choices
    tuned_file = {"metric": "cost_model_speedup (eval.replay)", "split": str(rc.tune),
                  "chosen": {m.key: dict(m.params) for m in chosen}}
    (out / "tuned.json").write_text(json.dumps(tuned_file, indent=1) + "\n")
    plot(result, out / "replay_auroc.png")
    wandb_log.log_replay(result, out)  # no-op unless logger=wandb
    print(markdown(result))
    print(f"wrote {out / 'replay.json'}, replay.md, prompts.jsonl, tuned.json{', replay_auroc.png' if synthetic else ''}")
