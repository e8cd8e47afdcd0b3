"""Measure the bars of issue 3 for the pair config's draft: acceptance, cost ratio c, predicted speedup.

    python -m bench.distill_metrics [pair=smollm2_135m] [weights=FILE] [baseline=true] [name=distill]
        [vocab_subset=[4096,8192,...]] [vocab_freq=models/weights/smollm2_135m_vocab_freq.json] [quantize=true]
        [prompts=20] [out_dir=results/bench]

Loads the pair exactly as every stage does (`load_pair(cfg.pair)`, any `pair.*` override applies; `weights` swaps
in another student file, e.g. a snapshot, before the config is switched). Then, on this machine:
- the target's own greedy continuations (64 new tokens, batch 1) of each domain's test prompts (`domains`: the first 20
  MBPP test prompts in DISCO format, 20 HumanEval problems, every Spec-Bench test question; rendered with the chat
  template as the pair says), teacher-forced through draft and target: mean Σmin(p,q) (per-token acceptance of exact
  sampling verification) and greedy agreement argmax q = argmax p, per domain and per Spec-Bench category;
- Σmin(p,q) on WikiText-2 test text (20 chunks of ≤256 tokens, raw text, no chat template);
- c = median draft decode step / median target decode step (batch 1, KV cache, the pair's dtype);
- Leviathan et al.'s predicted speedup at the best constant draft length, for both acceptance notions;
- the cost profile of the loop's own calls (models.cost: c and t_target(n)/t_target(1)) and the best-K speedup it
  predicts, where a verification pass over K+1 tokens costs t(K+1) instead of one step (`speedup_profile`).
`quantize=true` adds a row for the same draft with int8 weights (`pair.draft.quantize=int8`; the "draft" row then has
the float weights). `vocab_subset=[N,...]` adds one row per N: the same draft with an FR-Spec head over the N most
frequent tokens (models.lm_head.SubsetHead; the pair's `vocab_subset` setting is ignored for the "full" row).
Writes results/bench/<name>.json and .md. `baseline=true` adds the untrained layer subset of the same layers.
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from bench import command, repo_path, write_result
from data_gen.prompts import load_prompts, render
from models.cost import machine
from models.pair import load_pair
from models.student import layer_subset
from train.distill_corpus import generate_continuations
from train.distill_eval import acceptance, leviathan_speedup, measure_cost_ratio
from utils.cli import CONF_DIR, UserError, hydra_entry

BARS = {"sum_min": 0.50, "greedy_agree": 0.50, "c": 0.30, "speedup": 1.3}


def profile_speedup(alpha: float, prof, max_k: int = 16) -> dict:
    """Best constant K under the profile: E[tokens per round] ÷ (K·c + t(K+1)/t(1)), i.i.d. acceptance α."""
    best = {"speedup": 1.0, "gamma": 0}
    for k in range(1, max_k + 1):
        tokens = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
        s = tokens / (k * prof.cost_ratio + float(prof.verify_ratio(k + 1)))
        if s > best["speedup"]:
            best = {"speedup": s, "gamma": k}
    return best


def domain_acceptance(draft, pair, sets: dict[str, list[dict]]) -> dict:
    """{domain: Σmin(p,q), greedy agreement, tokens}, plus Spec-Bench by category (token-weighted, like the pools)."""
    out = {}
    for name, items in sets.items():
        groups: dict[str, list[dict]] = {}
        for it in items:
            groups.setdefault(it.get("category", ""), []).append(it)
        per = {g: acceptance(draft, pair.target, its, pair.vocab_size, pair.device) for g, its in sorted(groups.items())}
        n = sum(a["tokens"] for a in per.values())
        out[name] = {k: sum(a[k] * a["tokens"] for a in per.values()) / max(n, 1) for k in ("sum_min", "greedy_agree")}
        out[name]["tokens"] = n
        if len(per) > 1:
            out[name]["by_category"] = {g: {k: a[k] for k in ("sum_min", "greedy_agree", "tokens")} for g, a in per.items()}
    return out


def measure(draft, pair, sets, text, cost_ids) -> dict:
    import dataclasses

    from models.profiling import DEFAULTS, measure as measure_profile

    domains = domain_acceptance(draft, pair, sets)
    a = domains["mbpp"]
    w = acceptance(draft, pair.target, text, pair.vocab_size, pair.device)
    cost = measure_cost_ratio(draft, pair.target, pair.vocab_size, cost_ids, repeats=35)
    prof = measure_profile(dataclasses.replace(pair, draft=draft),
                           OmegaConf.merge(DEFAULTS, {"max_n": 9, "prefill_lengths": [32], "repeats": 21}), False)
    row = {"mbpp_sum_min": a["sum_min"], "mbpp_greedy_agree": a["greedy_agree"], "mbpp_tokens": a["tokens"],
           "wikitext2_sum_min": w["sum_min"], "wikitext2_greedy_agree": w["greedy_agree"], "wikitext2_tokens": w["tokens"],
           "domains": domains, **cost}
    row["speedup_greedy"] = leviathan_speedup(a["greedy_agree"], cost["c"])
    row["speedup_sampling"] = leviathan_speedup(a["sum_min"], cost["c"])
    row["profile"] = {"c": prof.cost_ratio, "draft_ms": prof.draft_ms[0], "target_ms": prof.target_ms[0],
                      "verify_ratio": [float(prof.verify_ratio(n)) for n in range(1, 10)]}
    row["speedup_profile_greedy"] = profile_speedup(a["greedy_agree"], prof)
    row["speedup_profile_sampling"] = profile_speedup(a["sum_min"], prof)
    row["bars_met"] = {
        "sum_min>=0.50": a["sum_min"] >= BARS["sum_min"], "greedy_agree>=0.50": a["greedy_agree"] >= BARS["greedy_agree"],
        "c<=0.30": cost["c"] <= BARS["c"], "speedup>=1.3": max(row["speedup_greedy"]["speedup"],
                                                               row["speedup_sampling"]["speedup"]) >= BARS["speedup"]}
    return row


def continuation_sets(cfg: DictConfig, pair) -> dict[str, list[dict]]:
    """The target's greedy continuations (≤64 new tokens, batch 1) of each domain's test prompts (`domains`: MBPP
    first, its numbers are issue 3's bars), each item tagged with its Spec-Bench category."""
    sets = {}
    for d in cfg.domains:
        dcfg = OmegaConf.load(CONF_DIR / "dataset" / f"{d.dataset}.yaml")
        prompts = load_prompts(dcfg, str(d.split), None if d.get("limit") is None else int(d.limit))
        texts = [render(p, pair.tokenizer, pair.chat_template) for p in prompts]
        got = generate_continuations(pair, texts, 64, 1, 0.0, 1, 10**6, 0, f"target greedy continuations ({d.name})")
        sets[str(d.name)] = [{**it, "category": prompts[it["index"]].meta.get("category", "")} for it in got]
    if "mbpp" not in sets:
        raise UserError("domains must include one named mbpp (issue 3's bars read it)")
    return sets


def pair_config(cfg: DictConfig) -> DictConfig:
    """The pair config the "draft" row measures: the extra rows (FR-Spec heads, int8) are built from its float,
    full-head draft; `weights` swaps in another student file with the config's other draft settings."""
    pcfg = OmegaConf.create(OmegaConf.to_container(cfg.pair, resolve=True))
    if subset_sizes(cfg):  # the "draft" row is the full head; subset rows are built below, all with float weights (the
        pcfg.draft.vocab_subset = None  # full head is the target's own matrix, which int8 must not touch)
        pcfg.draft.quantize = None
    if cfg.quantize:  # the "draft" row is the draft with its float weights; the int8 row is built below
        pcfg.draft.quantize = None
    if cfg.weights:  # another student file with the config's other draft settings (FR-Spec head, int8)
        pcfg.draft.source, pcfg.draft.weights = "student", str(repo_path(cfg.weights).resolve())
    return pcfg


def subset_sizes(cfg: DictConfig) -> list[int]:
    """`vocab_subset`: one N or a list of N (FR-Spec heads to measure too)."""
    value = cfg.get("vocab_subset") or []
    try:
        return [int(x) for x in (value if isinstance(value, (list, ListConfig)) else [value])]
    except (TypeError, ValueError):
        raise UserError(f"vocab_subset={value}: give token counts, e.g. vocab_subset=[4096,8192]") from None


def measure_rows(cfg: DictConfig, pcfg: DictConfig, pair, sets, text, cost_ids) -> dict:
    """`sets`: the continuations by domain (continuation_sets)."""
    """One row per draft variant: the config's draft, its FR-Spec heads, the untrained layer subset, int8."""
    rows = {}
    info = getattr(pair.draft, "student_info", None)
    rows["draft"] = measure(pair.draft, pair, sets, text, cost_ids)
    if subset_sizes(cfg):
        from models.lm_head import SubsetHead, read_frequencies, subset_ids

        full = pair.draft.get_output_embeddings()
        freq = read_frequencies(repo_path(cfg.vocab_freq))
        for n in subset_sizes(cfg):
            ids = subset_ids(freq, n, set(pair.tokenizer.all_special_ids), pair.vocab_size)
            pair.draft.set_output_embeddings(SubsetHead(full.weight, ids, pair.vocab_size))
            rows[f"vocab_subset={n}"] = measure(pair.draft, pair, sets, text, cost_ids)
            rows[f"vocab_subset={n}"]["subset_size"] = len(ids)
        pair.draft.set_output_embeddings(full)
    if cfg.baseline:
        layers = info["layers"] if info else list(pcfg.draft.get("layers", [0, 1, 2, 3]))
        rows[f"layer_subset{layers}"] = measure(layer_subset(pair.target, layers), pair, sets, text, cost_ids)
    if cfg.quantize:  # last: it quantizes the draft in place (what load_pair does for pair.draft.quantize=int8)
        from models.lm_head import int8_float_rows, quantize_linears

        quantize_linears(pair.draft, keep={id(p) for p in pair.target.parameters()},
                         float_rows=int8_float_rows(pcfg.draft))
        rows["quantize=int8"] = measure(pair.draft, pair, sets, text, cost_ids)
    return rows


def markdown(result: dict, pair, code, text) -> list[str]:
    rows = result["rows"]
    lines = [f"# Draft metrics ({result['date']})", "", f"`{result['command']}` — pair `{result['pair']}`, draft "
             f"`{json.dumps(result['draft'])}`, {pair.dtype}, batch 1, {torch.get_num_threads()} threads, "
             f"{result['machine']['name']}, 1-min load average {result['machine']['loadavg_before']:.1f} before the run "
             "(it adds its own threads while it runs; c is a median over interleaved repeats).", "",
             "| draft | Σmin(p,q) MBPP | greedy agree MBPP | Σmin(p,q) WikiText-2 | c (draft/target ms) | speedup greedy (γ) | speedup sampling (γ) | profile c | t(K+1)/t(1), K=1..4 | profile speedup greedy (γ) | profile speedup sampling (γ) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['mbpp_sum_min']:.3f} | {r['mbpp_greedy_agree']:.3f} | {r['wikitext2_sum_min']:.3f} | "
                     f"{r['c']:.3f} ({r['draft_step_ms']:.1f}/{r['target_step_ms']:.1f}) | "
                     f"{r['speedup_greedy']['speedup']:.2f} ({r['speedup_greedy']['gamma']}) | "
                     f"{r['speedup_sampling']['speedup']:.2f} ({r['speedup_sampling']['gamma']}) | "
                     f"{r['profile']['c']:.3f} | {' / '.join(f'{v:.2f}' for v in r['profile']['verify_ratio'][1:5])} | "
                     f"{r['speedup_profile_greedy']['speedup']:.2f} ({r['speedup_profile_greedy']['gamma']}) | "
                     f"{r['speedup_profile_sampling']['speedup']:.2f} ({r['speedup_profile_sampling']['gamma']}) |")
    lines += ["", f"Bars (issue 3): Σmin ≥ 0.50, greedy agreement ≥ 0.50, c ≤ 0.30, predicted speedup ≥ 1.3; "
              f"met by `draft`: {json.dumps(rows['draft']['bars_met'])}",
              f"MBPP: {len(code)} test prompts × ≤64 target greedy tokens ({rows['draft']['mbpp_tokens']} positions); "
              f"WikiText-2: {len(text)} test chunks ({rows['draft']['wikitext2_tokens']} positions)."]
    return lines + domain_tables(rows)


def domain_tables(rows: dict) -> list[str]:
    """Per-domain agreement of every row, and Spec-Bench by category (issue 29's before/after layout)."""
    names = list(next(iter(rows.values()))["domains"])
    lines = ["", "Σmin(p,q) / greedy agreement by domain (target greedy continuations of test prompts):", "",
             "| draft | " + " | ".join(names) + " | WikiText-2 text Σmin |", "|---" * (len(names) + 2) + "|"]
    for name, r in rows.items():
        d = r["domains"]
        lines.append(f"| {name} | " + " | ".join(f"{d[n]['sum_min']:.3f} / {d[n]['greedy_agree']:.3f}" for n in names)
                     + f" | {r['wikitext2_sum_min']:.3f} |")
    for n in names:
        cats = next(iter(rows.values()))["domains"][n].get("by_category")
        if not cats:
            continue
        lines += ["", f"{n} by category (Σmin / greedy agreement; tokens):", "",
                  "| draft | " + " | ".join(f"{c} ({cats[c]['tokens']})" for c in cats) + " |", "|---" * (len(cats) + 1) + "|"]
        for name, r in rows.items():
            by = r["domains"][n]["by_category"]
            lines.append(f"| {name} | " + " | ".join(f"{by[c]['sum_min']:.3f} / {by[c]['greedy_agree']:.3f}" for c in cats) + " |")
    return lines


def run(cfg: DictConfig) -> None:
    load_before = os.getloadavg()[0]  # what else was running: a busy CPU slows the draft and target unevenly
    pcfg = pair_config(cfg)
    pair = load_pair(pcfg)
    torch.manual_seed(0)
    t0 = time.time()
    sets = continuation_sets(cfg, pair)
    code = sets["mbpp"]
    wt = load_prompts(OmegaConf.load(CONF_DIR / "dataset/wikitext2.yaml"), "test", 20)
    text = [{"ids": torch.tensor(pair.tokenizer(f"{p.text} {p.reference}", add_special_tokens=False)["input_ids"][:256]),
             "start": 1} for p in wt]
    cost_ids = code[0]["ids"][: code[0]["start"]].long().unsqueeze(0).to(pair.device)
    info = getattr(pair.draft, "student_info", None)
    rows = measure_rows(cfg, pcfg, pair, sets, text, cost_ids)
    result = {
        "pair": str(cfg.pair.name), "draft": OmegaConf.to_container(pcfg.draft), "student_info": {
            k: v for k, v in (info or {}).items() if k not in ("recipe",)},
        "rows": rows, "bars": BARS, "prompts": {**{f"{k}_test": len(v) for k, v in sets.items()}, "new_tokens": 64,
                                   "wikitext2_test_chunks": len(text)},
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "device": str(pair.device), "dtype": str(pair.dtype), "loadavg": os.getloadavg(),
                    "loadavg_before": load_before, "name": machine()},
        "command": command("distill_metrics"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "seconds": time.time() - t0,
    }
    write_result(cfg.out_dir, cfg.name, result, markdown(result, pair, code, text))


if __name__ == "__main__":
    hydra_entry("bench/distill_metrics")(run)()
