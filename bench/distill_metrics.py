"""Measure the bars of issue 3 for the pair config's draft: acceptance, cost ratio c, predicted speedup.

    python bench/distill_metrics.py [--pair conf/pair/smollm2_135m.yaml] [--weights FILE] [--baseline] [--out NAME]
        [--vocab-subset 4096,8192,...] [--vocab-freq models/weights/smollm2_135m_vocab_freq.json] [--quantize]

Loads the pair exactly as every stage does (`load_pair(OmegaConf.load(path))`; `--weights` swaps in another student
file, e.g. a snapshot, before the config is switched). Then, on this machine:
- the target's own greedy continuations (64 new tokens, batch 1) of the first 20 MBPP test prompts (DISCO format,
  rendered with the chat template as the pair says), teacher-forced through draft and target: mean Σmin(p,q)
  (per-token acceptance of exact sampling verification) and greedy agreement argmax q = argmax p;
- Σmin(p,q) on WikiText-2 test text (20 chunks of ≤256 tokens, raw text, no chat template);
- c = median draft decode step / median target decode step (batch 1, KV cache, the pair's dtype);
- Leviathan et al.'s predicted speedup at the best constant draft length, for both acceptance notions;
- the cost profile of the loop's own calls (models.cost: c and t_target(n)/t_target(1)) and the best-K speedup it
  predicts, where a verification pass over K+1 tokens costs t(K+1) instead of one step (`speedup_profile`).
`--quantize` adds a row for the same draft with int8 weights (`pair.draft.quantize=int8`; the "draft" row then has
the float weights). `--vocab-subset` adds one row per N: the same draft with an FR-Spec head over the N most frequent
tokens (models.lm_head.SubsetHead; the pair's `vocab_subset` setting is ignored for the "full" row).
Writes bench/results/<out>.json and .md. `--baseline` adds the untrained layer subset of the same layers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from data_gen.prompts import load_prompts, render  # noqa: E402
from models.pair import layer_subset, load_pair  # noqa: E402
from train.distill import acceptance, generate_continuations, leviathan_speedup, measure_cost_ratio  # noqa: E402

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


def measure(draft, pair, code, text, cost_ids) -> dict:
    import dataclasses

    from models.cost import DEFAULTS, measure as measure_profile

    a = acceptance(draft, pair.target, code, pair.vocab_size, pair.device)
    w = acceptance(draft, pair.target, text, pair.vocab_size, pair.device)
    cost = measure_cost_ratio(draft, pair.target, cost_ids, steps=32, repeats=7)
    prof = measure_profile(dataclasses.replace(pair, draft=draft),
                           OmegaConf.merge(DEFAULTS, {"max_n": 9, "prefill_lengths": [32], "repeats": 21}), False)
    row = {"mbpp_sum_min": a["sum_min"], "mbpp_greedy_agree": a["greedy_agree"], "mbpp_tokens": a["tokens"],
           "wikitext2_sum_min": w["sum_min"], "wikitext2_greedy_agree": w["greedy_agree"], "wikitext2_tokens": w["tokens"],
           **cost}
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="conf/pair/smollm2_135m.yaml")
    ap.add_argument("--weights", default=None, help="measure this student file instead of the config's draft")
    ap.add_argument("--baseline", action="store_true", help="also measure the untrained layer subset")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--out", default="distill")
    ap.add_argument("--vocab-subset", default="", help="comma-separated N: FR-Spec draft heads to measure too")
    ap.add_argument("--vocab-freq", default="models/weights/smollm2_135m_vocab_freq.json")
    ap.add_argument("--quantize", action="store_true", help="also measure the config's draft with int8 weights "
                    "(pair.draft.quantize=int8, models.lm_head.Int8Linear)")
    args = ap.parse_args()

    cfg = OmegaConf.load(REPO / args.pair if not os.path.isabs(args.pair) else args.pair)
    subset_sizes = [int(x) for x in args.vocab_subset.split(",") if x.strip()]
    if subset_sizes:  # the "draft" row is the full head; subset rows are built below, all with float weights (the
        cfg.draft.vocab_subset = None  # full head is the target's own matrix, which int8 must not touch)
        cfg.draft.quantize = None
    if args.quantize:  # the "draft" row is the draft with its float weights; the int8 row is built below
        cfg.draft.quantize = None
    if args.weights:  # another student file with the config's other draft settings (FR-Spec head, int8)
        cfg.draft.source, cfg.draft.weights = "student", str(Path(args.weights).resolve())
    pair = load_pair(cfg)
    torch.manual_seed(0)
    mbpp = load_prompts(OmegaConf.load(REPO / "conf/dataset/mbpp.yaml"), "test", args.prompts)
    texts = [render(p, pair.tokenizer, pair.chat_template) for p in mbpp]
    t0 = time.time()
    code = generate_continuations(pair, texts, 64, 1, 0.0, 1, 10**6, 0, "target greedy continuations (MBPP test)")
    wt = load_prompts(OmegaConf.load(REPO / "conf/dataset/wikitext2.yaml"), "test", 20)
    text = [{"ids": torch.tensor(pair.tokenizer(f"{p.text} {p.reference}", add_special_tokens=False)["input_ids"][:256]),
             "start": 1} for p in wt]
    cost_ids = code[0]["ids"][: code[0]["start"]].long().unsqueeze(0).to(pair.device)

    rows = {}
    info = getattr(pair.draft, "student_info", None)
    rows["draft"] = measure(pair.draft, pair, code, text, cost_ids)
    if subset_sizes:
        from models.lm_head import SubsetHead, read_frequencies, subset_ids

        full = pair.draft.get_output_embeddings()
        freq = read_frequencies(REPO / args.vocab_freq)
        for n in subset_sizes:
            ids = subset_ids(freq, n, set(pair.tokenizer.all_special_ids), pair.vocab_size)
            pair.draft.set_output_embeddings(SubsetHead(full.weight, ids, pair.vocab_size))
            rows[f"vocab_subset={n}"] = measure(pair.draft, pair, code, text, cost_ids)
            rows[f"vocab_subset={n}"]["subset_size"] = len(ids)
        pair.draft.set_output_embeddings(full)
    if args.baseline:
        layers = info["layers"] if info else list(cfg.draft.get("layers", [0, 1, 2, 3]))
        rows[f"layer_subset{layers}"] = measure(layer_subset(pair.target, layers), pair, code, text, cost_ids)
    if args.quantize:  # last: it quantizes the draft in place (what load_pair does for pair.draft.quantize=int8)
        from models.lm_head import quantize_linears

        quantize_linears(pair.draft, keep={id(p) for p in pair.target.parameters()})
        rows["quantize=int8"] = measure(pair.draft, pair, code, text, cost_ids)

    result = {
        "pair": args.pair, "draft": OmegaConf.to_container(cfg.draft), "student_info": {
            k: v for k, v in (info or {}).items() if k not in ("recipe",)},
        "rows": rows, "bars": BARS, "prompts": {"mbpp_test": len(code), "new_tokens": 64, "wikitext2_test_chunks": len(text)},
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "device": str(pair.device), "dtype": str(pair.dtype), "loadavg": os.getloadavg()},
        "command": "python bench/distill_metrics.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "seconds": time.time() - t0,
    }
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.out}.json").write_text(json.dumps(result, indent=1, default=str))
    lines = [f"# Draft metrics ({result['date']})", "", f"`{result['command']}` — pair `{args.pair}`, draft "
             f"`{json.dumps(result['draft'])}`, {pair.dtype}, batch 1, {torch.get_num_threads()} threads, "
             f"load average {os.getloadavg()[0]:.1f} (CPU shared with other jobs: c is a median over interleaved repeats).", "",
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
    (out / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
