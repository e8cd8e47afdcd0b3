"""The decoding benchmark: target-only once + every listed policy on the same prompts, in one process.

Per prompt, target-only decoding runs first and then each policy (interleaved, so slow drift of a shared machine
hits every method alike); a warm-up generation of every method precedes all timing. Writes into `out_dir`:
`prompts.jsonl` (one row per method × prompt), `summary.json` ({method: metrics}), `summary.md` (the table),
`run.json` (settings, device, measured c), `speedup.png` and `acceptance_by_position.png`.

`mode=sweep` runs every point of `tune.grid` for the listed policies as its own row on `split` (a K sweep, an
h sweep) and chooses nothing. `mode=tune` chooses each policy's free parameter on `tune.split` (validation) by `tune.metric`, writes `tuned.json`,
and then evaluates the chosen settings on `tune.eval_split` (test) — thresholds are never tuned on test.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from decode import metrics, wandb_log
from decode.loop import autoregressive, speculative
from decode.policies import HEAD_POLICIES, build_policy, parse_spec
from models.cost import get_profile, machine
from utils.cli import UserError
from utils.files import write_text_atomic

log = logging.getLogger(__name__)


@dataclass
class Method:
    key: str  # the name in summary.json
    spec: str  # policy spec (`svip`, `learned:PATH`)
    params: dict  # constructor parameters


def check_settings(cfg: DictConfig) -> None:
    """Everything the user can get wrong that needs no model: fail before loading anything."""
    if int(cfg.max_new_tokens) <= 0:
        raise UserError(f"max_new_tokens must be > 0, got {cfg.max_new_tokens}")
    if float(cfg.temperature) < 0:
        raise UserError(f"temperature must be ≥ 0 (0 = greedy), got {cfg.temperature}")
    if not 0 < float(cfg.top_p) <= 1:
        raise UserError(f"top_p must be in (0, 1], got {cfg.top_p}")
    if float(cfg.temperature) == 0 and float(cfg.top_p) < 1:
        raise UserError("top_p < 1 only applies when sampling; set temperature > 0 or top_p=1")
    if not cfg.policies:
        raise UserError("policies is empty; list some, e.g. policies=[constant,svip]")


def methods_from_cfg(cfg: DictConfig) -> list[Method]:
    """`policies` entries → methods with their params (conf/policy/<name>.yaml merged with `policy.<name>.*`)."""
    specs = [str(s) for s in cfg.policies]
    names = [parse_spec(s)[0] for s in specs]
    out = []
    for spec, name in zip(specs, names):
        if name == "target":
            continue  # target-only always runs
        params = OmegaConf.to_container(cfg.policy[name], resolve=True) if name in cfg.get("policy", {}) else {}
        path = parse_spec(spec)[1]
        if name in HEAD_POLICIES:
            path = path or params.get("ckpt") or cfg.get("policy_ckpt")
            spec = f"{name}:{path}" if path else name
        key = name if names.count(name) == 1 else f"{name}:{Path(path).stem}" if path else spec
        out.append(Method(key, spec, params))
    keys = [m.key for m in out]
    if len(set(keys)) != len(keys):
        raise UserError(f"policies lists a method twice: {keys}")
    if cfg.get("tuned"):
        out = apply_tuned(out, Path(str(cfg.tuned)))
    if float(cfg.temperature) > 0:
        bad = [m.key for m in out if parse_spec(m.spec)[0] == "oracle"]
        if bad:
            raise UserError("the oracle policy is greedy-only (its lookahead is the target's greedy output); "
                            "use temperature=0 or drop oracle from policies")
    return out


def method_entry(table: dict, key: str, name: str, ckpt=None) -> dict | None:
    """A method's entry in a per-method table written by another run (tuned.json's `chosen`, a summary.json): by its
    key, else by `<name>:<ckpt file stem>` — a head is keyed `learned` when listed alone and `learned:<file stem>`
    beside another head, so the same head can carry either key."""
    for k in (key, f"{name}:{Path(str(ckpt)).stem}" if ckpt else None):
        if k in table:
            return table[k]
    return None


def apply_tuned(methods: list[Method], path: Path) -> list[Method]:
    """Parameters chosen by an earlier `mode=tune` run (its tuned.json), matched by method key: how a setting tuned
    on one dataset's validation split is carried to another test set (MBPP → HumanEval). Methods the file does not
    name keep their configured parameters; run.json records the parameters every method ran with."""
    if not path.is_file():
        raise UserError(f"tuned={path}: no such file; pass the tuned.json written by a `mode=tune` run")
    try:
        chosen = json.loads(path.read_text())["chosen"]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"tuned={path} is not a tuned.json from `python -m decode mode=tune`") from None
    found = {m.key: method_entry(chosen, m.key, *parse_spec(m.spec)) for m in methods}
    if not any(v is not None for v in found.values()):
        raise UserError(f"tuned={path} tunes {sorted(chosen)}, none of this run's methods {[m.key for m in methods]}")
    return [Method(m.key, m.spec, {**m.params, **(found[m.key] or {})}) for m in methods]


def tokenize_prompts(pair, prompts, max_new_tokens: int) -> list[list[int]]:
    """Rendered, tokenized prompts; refuses one that does not fit the models' context with its new tokens."""
    from data_gen.prompts import render

    ctx = min(
        int(getattr(m.config, "max_position_embeddings", 1 << 30) or (1 << 30)) for m in (pair.target, pair.draft)
    )
    out = []
    for p in prompts:
        ids = pair.tokenizer(render(p, pair.tokenizer, pair.chat_template),
                             add_special_tokens=not pair.chat_template)["input_ids"]
        if not ids:
            raise UserError(f"prompt {p.prompt_id} is empty after tokenization")
        if len(ids) + max_new_tokens > ctx:
            raise UserError(
                f"prompt {p.prompt_id} has {len(ids)} tokens + max_new_tokens={max_new_tokens} > context {ctx}; "
                "lower max_new_tokens or use shorter prompts"
            )
        out.append(ids)
    return out


def _gen(seed: int):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _run_method(pol, pair, prompt_ids, max_new, temp, top_p, eos, gen, lookahead):
    if getattr(pol, "external", False):  # transformers' assisted generation runs its own loop
        return pol.generate(prompt_ids, max_new, temp, top_p, eos, gen)
    return speculative(pair, prompt_ids, pol, max_new, temp, top_p, eos, gen, lookahead=lookahead)


def run_split(cfg: DictConfig, pair, split: str, methods: list[Method], profile, desc: str = "",
              limit: int | None | str = "cfg") -> tuple[dict, list[dict], dict]:
    """Run target-only + methods on one split; returns (summary, per-prompt rows, per-task summaries — {} unless
    the prompts carry a `task`, as Spec-Bench's do). `profile` (models.cost) costs the cost-model speedup.
    No files written here."""
    from data_gen.prompts import load_prompts

    limit = cfg.get("limit") if limit == "cfg" else limit
    dataset = cfg.dataset
    if split == str(cfg.tune.split) and cfg.get("mode") == "tune" and cfg.tune.get("dataset"):
        dataset = OmegaConf.merge(dataset, cfg.tune.dataset)  # e.g. one prompt per Spec-Bench task for tuning
    prompts = load_prompts(dataset, split, None if limit is None else int(limit))
    max_new, temp, top_p, seed = int(cfg.max_new_tokens), float(cfg.temperature), float(cfg.top_p), int(cfg.seed)
    greedy = temp == 0
    ids = tokenize_prompts(pair, prompts, max_new)
    eos = pair.eos_ids

    def fresh():  # adaptive state (heuristic K, AdaEDL λ) must not carry the warm-up into the run
        return {m.key: build_policy(m.spec, m.params, pair=pair, profile=profile) for m in methods}

    policies = fresh()
    if cfg.get("warmup", True):  # first calls allocate caches and pick kernels: keep them out of the timings
        warm_new = min(8, max_new)
        ref = autoregressive(pair, ids[0], warm_new, temp, top_p, eos, _gen(seed))
        for pol in policies.values():
            _run_method(pol, pair, ids[0], warm_new, temp, top_p, eos, _gen(seed), ref.tokens)
        policies = fresh()

    rows: list[dict] = []
    bar = tqdm(total=len(prompts) * (1 + len(methods)), desc=desc or f"decode {split}", unit="gen")
    for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids)):
        ref = autoregressive(pair, prompt_ids, max_new, temp, top_p, eos, _gen(seed * 100003 + i))
        bar.update()
        ref_text = pair.tokenizer.decode(ref.tokens, skip_special_tokens=True)
        rows.append({"method": "target", "prompt_id": prompt.prompt_id, "prompt_tokens": len(prompt_ids),
                     **metrics.record(ref, None),
                     "tokens": ref.tokens, "text": ref_text, **({"task": prompt.meta["task"]}
                                                                if prompt.meta.get("task") else {})})
        if prompt.reference and any(p.approximate for p in policies.values()):
            rows[-1]["rouge_l_ref"] = metrics.rouge_l(ref_text, prompt.reference)
        for m in methods:
            pol = policies[m.key]
            res = _run_method(pol, pair, prompt_ids, max_new, temp, top_p, eos, _gen(seed * 100003 + i),
                              ref.tokens if greedy else None)
            bar.update()
            row = {"method": m.key, "prompt_id": prompt.prompt_id, "prompt_tokens": len(prompt_ids),
                   **metrics.record(res, ref), "tokens": res.tokens}
            if prompt.meta.get("task"):
                row["task"] = prompt.meta["task"]
            row["text"] = pair.tokenizer.decode(res.tokens, skip_special_tokens=True)
            if pol.approximate:
                row["rouge_l_target"] = metrics.rouge_l(row["text"], ref_text)
                row["rouge_l_ref"] = metrics.rouge_l(row["text"], prompt.reference) if prompt.reference else None
            rows.append(row)
    bar.close()

    if greedy:
        tie_margins(pair, rows, dict(zip([p.prompt_id for p in prompts], ids)), policies, cfg.get("tie_tol"),
                    float(cfg.get("tie_ulps", 4)))

    # c from our loop's timed draft steps (transformers' loop exposes no draft/target split)
    ours = [r for r in rows if r["method"] != "target" and not getattr(policies[r["method"]], "external", False)]
    target_all = [r for r in rows if r["method"] == "target"]
    c = metrics.measured_c(sum(r["draft_s"] for r in ours), sum(r["draft_calls"] for r in ours),
                           sum(r["target_s"] for r in target_all),
                           sum(r["target_calls"] - 1 for r in target_all))  # target_s excludes the prefill call

    def summarize(subset: list[dict]) -> dict:
        target_rows = [r for r in subset if r["method"] == "target"]
        summary = {"target": metrics.target_summary(target_rows)}
        for m in methods:
            pol = policies[m.key]
            s = metrics.summarize([r for r in subset if r["method"] == m.key], target_rows, profile, greedy,
                                  not pol.approximate)
            s.update(oracle=pol.oracle, approximate=pol.approximate, params=pol.describe(), measured_c=c,
                     external=bool(getattr(pol, "external", False)))
            summary[m.key] = s
        summary["target"]["measured_c"] = c
        return summary

    tasks = sorted({r["task"] for r in rows if r.get("task")})
    by_task = {t: summarize([r for r in rows if r.get("task") == t]) for t in tasks} if len(tasks) > 1 else {}
    return summarize(rows), rows, by_task


@torch.inference_mode()
def tie_margins(pair, rows: list[dict], prompt_ids: dict, policies: dict, tie_tol=None, tie_ulps: float = 4.0) -> None:
    """For each greedy exact output that differs from target-only: the target's logit margin between the two
    tokens at the first divergence, from one untimed full pass over prompt + common prefix, and the tolerance below
    which that margin is a tie (`tie_tol` if set, else `tie_ulps` ulps of the pair's dtype at the larger logit).
    A margin within it is a near-tie argmax flipped by low-precision numerics (a 1-token step vs a multi-token
    verify pass round differently), not a bug."""
    ref = {r["prompt_id"]: r["tokens"] for r in rows if r["method"] == "target"}
    for r in rows:
        if r["method"] == "target" or r.get("matches_target", True) or policies[r["method"]].approximate:
            continue
        j = r["prefix_match"]
        a, b = ref[r["prompt_id"]], r["tokens"]
        if j >= min(len(a), len(b)):  # one output is a prefix of the other (EOS): not a tie
            r["divergence_margin"], r["divergence_tol"] = float("inf"), 0.0
            continue
        x = torch.tensor([prompt_ids[r["prompt_id"]] + a[:j]], device=pair.device)
        logits = pair.target(x).logits[0, -1, : pair.vocab_size].float()
        r["divergence_margin"] = float((logits[a[j]] - logits[b[j]]).abs())
        magnitude = float(torch.maximum(logits[a[j]].abs(), logits[b[j]].abs()))
        r["divergence_tol"] = (float(tie_tol) if tie_tol is not None
                               else metrics.tie_tolerance(str(pair.dtype), magnitude, tie_ulps))


# ---------------------------------------------------------------------------------------------------------- output


def _fmt(v, digits=3):
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if v == v else "nan"
    return str(v)


def markdown_table(summary: dict, title: str = "") -> str:
    cols = [("tok/s", "tokens_per_s", 1), ("speedup", "speedup", 2), ("±", "speedup_std", 2),
            ("cost-model", "cost_model_speedup", 2), ("accept", "acceptance_rate", 3),
            ("mean acc len", "mean_accepted_length", 2), ("target calls/tok", "target_calls_per_token", 3),
            ("draft calls/tok", "draft_calls_per_token", 3), ("mean K", "mean_draft_length", 2),
            ("policy overhead", "policy_overhead_frac", 4), ("lossless", "lossless", 0),
            ("lossless up to ties", "lossless_up_to_ties", 0)]
    lines = [f"### {title}" if title else "", "",
             "| method | " + " | ".join(c[0] for c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for key, s in summary.items():
        name = key + (" (oracle)" if s.get("oracle") else "") + (" (approx.)" if s.get("approximate") else "") + (
            " (transformers)" if s.get("external") else "")
        lines.append(f"| {name} | " + " | ".join(_fmt(s.get(c[1]), c[2]) for c in cols) + " |")
    approx = {k: s for k, s in summary.items() if s.get("approximate")}
    if approx:
        lines += ["", "| approximate method | target calls saved | unchecked tokens | TVD est. | token agreement | "
                  "ROUGE-L vs ref | ROUGE-L vs target |", "|---|---|---|---|---|---|---|"]
        base = summary.get("target", {})
        lines.append("| target-only (= exact SD) | 0.000 | 0.000 | 0.000 | 1.000 | "
                     f"{_fmt(base.get('rouge_l_ref'))} | 1.000 |")
        for k, s in approx.items():
            lines.append(f"| {k} | " + " | ".join(_fmt(s.get(x)) for x in (
                "target_calls_saved_frac", "unchecked_frac", "tvd_est", "token_agreement", "rouge_l_ref",
                "rouge_l_target")) + " |")
    c = next(iter(summary.values())).get("measured_c")
    lines += ["", f"Measured c (draft step ÷ target step) = {_fmt(c)}; batch size 1; oracle rows read the target-only "
              "output (an upper bound, not a method)."]
    return "\n".join(lines) + "\n"


def plots(summary: dict, rows: list[dict], out_dir: Path) -> None:
    from utils.plotting import pyplot

    plt = pyplot()
    import numpy as np

    keys = [k for k in summary if k != "target"]
    if not keys:
        return
    fig, ax = plt.subplots(figsize=(1.2 * len(keys) + 2, 3.5))
    per_prompt = [[r.get("speedup", 0.0) for r in rows if r["method"] == k] for k in keys]
    means = [summary[k]["speedup"] for k in keys]
    stds = [float(np.std(v)) if v else 0.0 for v in per_prompt]
    ax.bar(range(len(keys)), means, yerr=stds, capsize=4, color=["#999" if summary[k].get("oracle") else "#4477aa"
                                                                     for k in keys])
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(keys)), keys, rotation=30, ha="right")
    ax.set_ylabel("speedup vs target-only (± std over prompts)")
    fig.tight_layout()
    fig.savefig(out_dir / "speedup.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for k in keys:
        acc = summary[k].get("per_position_acceptance") or []
        xs = [j for j, a in enumerate(acc) if a is not None]
        ax.plot(xs, [acc[j] for j in xs], marker="o", ms=3, label=k)
    ax.set_xlabel("position in draft round")
    ax.set_ylabel("P(accept | previous accepted)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance_by_position.png", dpi=120)
    plt.close(fig)


def task_table(by_task: dict, title: str = "") -> str:
    """SVIP Table 1 layout: one row per method, speedup per task (and the mean accepted length in brackets)."""
    tasks = list(by_task)
    methods = list(next(iter(by_task.values())))
    lines = [f"### {title}" if title else "", "", "| method | " + " | ".join(tasks) + " | overall (mean) |",
             "|---|" + "---|" * (len(tasks) + 1)]
    for k in methods:
        cells = [f"{by_task[t][k]['speedup']:.2f}× ({by_task[t][k]['mean_accepted_length']:.2f})" for t in tasks]
        mean = sum(by_task[t][k]["speedup"] for t in tasks) / len(tasks)
        lines.append(f"| {k} | " + " | ".join(cells) + f" | {mean:.2f}× |")
    lines += ["", "Speedup vs target-only on the same prompts (mean accepted length = new tokens per target call)."]
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: Path, summary: dict, rows: list[dict], run_info: dict, title: str, make_plots: bool,
                  prefix: str = "", by_task: dict | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    if by_task:
        write_text_atomic(out_dir / f"{prefix}by_task.json", json.dumps(by_task, indent=2))
        write_text_atomic(out_dir / f"{prefix}by_task.md", task_table(by_task, title))
    write_text_atomic(out_dir / f"{prefix}prompts.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    write_text_atomic(out_dir / f"{prefix}run.json", json.dumps(run_info, indent=2))
    write_text_atomic(out_dir / f"{prefix}summary.md", markdown_table(summary, title))
    if make_plots:
        plots(summary, rows, out_dir)
    write_text_atomic(out_dir / f"{prefix}summary.json", json.dumps(summary, indent=2))  # last: its presence = done


def run_info(cfg: DictConfig, pair, split: str, summary: dict, profile=None) -> dict:
    tuning = cfg.get("mode") == "tune" and split == str(cfg.tune.split)
    return {
        "pair": pair.pair_id, "draft": OmegaConf.to_container(cfg.pair.draft, resolve=True),
        "dataset": str(cfg.dataset.name), "split": split,
        "limit": cfg.tune.get("limit", cfg.get("limit")) if tuning else cfg.get("limit"),
        "max_new_tokens": int(cfg.max_new_tokens), "temperature": float(cfg.temperature), "top_p": float(cfg.top_p),
        "seed": int(cfg.seed), "device": str(pair.device), "dtype": str(pair.dtype), "batch_size": 1,
        "torch_threads": torch.get_num_threads(), "measured_c": summary["target"].get("measured_c"),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
        "policies": [str(p) for p in cfg.policies], "tuned": cfg.get("tuned"),
        "params": {k: v.get("params") for k, v in summary.items() if isinstance(v, dict) and v.get("params")},
        "cost_profile": profile.to_dict() if profile is not None else None,
    }


# ------------------------------------------------------------------------------------------------------------ tune


def tune_grid(cfg: DictConfig, methods: list[Method], untuned: bool = True) -> list[Method]:
    """Every grid point of `tune.grid.<policy>` for the listed policies; the others once with their params
    (`untuned=False` leaves them out: tuning has nothing to choose for them). A grid is a product space
    ({param: [values]}) whose optional `also` adds the points of more product spaces (e.g. thresholds, plus (a, b)
    under another rule; repeats dropped); see `product_spaces`."""
    grid = OmegaConf.to_container(cfg.tune.grid, resolve=True) or {}
    out = []
    for m in methods:
        name = parse_spec(m.spec)[0]
        spaces = grid.get(name) or {}
        if not spaces:
            if untuned:
                out.append(m)
            continue
        seen = set()
        for space in product_spaces(spaces):
            keys = list(space)
            for values in itertools.product(*(space[k] for k in keys)):
                point = dict(zip(keys, values))
                label = ",".join(f"{k}={v}" for k, v in point.items())
                if label not in seen:
                    seen.add(label)
                    out.append(Method(f"{m.key}[{label}]", m.spec, {**m.params, **point}))
    return out


def product_spaces(space) -> list[dict]:
    """A `tune.grid.<policy>` entry as a list of product spaces: the entry without `also`, then what `also` holds
    (one space or a list; nested `also`s unfold too). A list is taken as the spaces themselves."""
    if isinstance(space, (list, tuple)):
        return [sp for item in space for sp in product_spaces(item)]
    space = dict(space or {})
    also = space.pop("also", None)
    return ([space] if space else []) + (product_spaces(also) if also else [])


def grid_params(space) -> list[str]:
    """The parameters a `tune.grid.<policy>` entry sweeps."""
    return list(dict.fromkeys(k for sp in product_spaces(space) for k in sp))


def choose(summary: dict, methods: list[Method], grid_methods: list[Method], metric: str) -> list[Method]:
    """Per original method, the grid point with the best `metric` on the tuning split."""
    chosen = []
    for m in methods:
        cands = [g for g in grid_methods if g.key == m.key or g.key.startswith(m.key + "[")]
        if not cands:  # no grid: runs with its configured parameters
            chosen.append(m)
            continue
        best = max(cands, key=lambda g: summary[g.key].get(metric) or float("-inf"))
        chosen.append(Method(m.key, m.spec, best.params))
    return chosen


def main(cfg: DictConfig) -> dict:
    check_settings(cfg)
    methods = methods_from_cfg(cfg)
    mode = str(cfg.get("mode", "run"))
    if mode not in ("run", "tune", "sweep"):
        raise UserError(f"mode must be run, tune or sweep, got '{mode}'")
    threads = cfg.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    torch.manual_seed(int(cfg.seed))
    from models.pair import load_pair

    pair = load_pair(cfg.pair)
    profile = get_profile(pair, cfg.get("profile"))  # measured once per machine, then cached
    for m in methods:  # a bad checkpoint or parameter fails before any decoding
        build_policy(m.spec, m.params, pair=pair, profile=profile)
    out_dir = Path(cfg.out_dir) if cfg.get("out_dir") else _hydra_dir()
    make_plots = bool(cfg.get("plots", True))
    if mode in ("run", "sweep"):
        if mode == "sweep":  # every grid point of tune.grid as its own row, on `split`; nothing is chosen
            methods = tune_grid(cfg, methods)
        title = f"{pair.pair_id} · {cfg.dataset.name}/{cfg.split} · T={cfg.temperature} · {cfg.max_new_tokens} new tokens"
        result = run_split(cfg, pair, str(cfg.split), methods, profile)
        return _publish(cfg, pair, out_dir, str(cfg.split), result, title, make_plots, profile)
    grid = tune_grid(cfg, methods, untuned=False)
    if not grid:
        raise UserError(f"mode=tune: none of {[m.key for m in methods]} has a grid in tune.grid; "
                        f"gridded: {sorted(OmegaConf.to_container(cfg.tune.grid) or {})}")
    metric = str(cfg.tune.metric)
    tsum, trows, _ = run_split(cfg, pair, str(cfg.tune.split), grid, profile, desc=f"tune on {cfg.tune.split}",
                               limit=cfg.tune.get("limit", cfg.get("limit")))
    chosen = choose(tsum, methods, grid, metric)
    tuned = {m.key: m.params for m in chosen}
    out_dir.mkdir(parents=True, exist_ok=True)
    tinfo = run_info(cfg, pair, str(cfg.tune.split), tsum, profile)
    write_outputs(out_dir, tsum, trows, tinfo, f"tuning on {cfg.tune.split} (metric {metric})", False, prefix="tune_")
    wandb_log.log_result(tsum, tinfo, out_dir, prefix="tune", tuned=tuned)
    write_text_atomic(out_dir / "tuned.json", json.dumps({"metric": metric, "split": str(cfg.tune.split),
                                                       "chosen": tuned}, indent=2))
    print(markdown_table(tsum, f"tuning on {cfg.tune.split}"))
    print("chosen:", json.dumps(tuned))
    if not cfg.tune.get("eval_split"):
        return tsum
    split = str(cfg.tune.eval_split)
    return _publish(cfg, pair, out_dir, split, run_split(cfg, pair, split, chosen, profile, desc=f"eval on {split}"),
                    f"{pair.pair_id} · {cfg.dataset.name}/{split} · tuned on {cfg.tune.split}", make_plots, profile)


def _publish(cfg, pair, out_dir: Path, split: str, result: tuple, title: str, make_plots: bool, profile) -> dict:
    """Write a run's outputs (summary, per-prompt rows, run info, plots) and print its tables."""
    summary, rows, by_task = result
    info = run_info(cfg, pair, split, summary, profile)
    write_outputs(out_dir, summary, rows, info, title, make_plots, by_task=by_task)
    wandb_log.log_result(summary, info, out_dir, by_task=by_task)  # no-op unless logger=wandb
    print(markdown_table(summary, title))
    if by_task:
        print(task_table(by_task, title))
    print(f"wrote {out_dir}/summary.json")
    return summary


def _hydra_dir() -> Path:
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001 - called outside Hydra
        return Path("logs/decode/latest")
