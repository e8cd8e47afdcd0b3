"""Two CPU kernels that cost a batch-1 decoder more than their size says, at the default pair's shapes.

    python -m bench.small_ops [threads=2] [repeats=300] [pair=smollm2_135m] [out_dir=results/bench]

1. Greedy argmax over the vocabulary (49,152 logits, 1 and 4 rows): `argmax(-1)` against `max(-1).indices` (the
   same first index; models.distributions.greedy_ids) in bfloat16 and float32. torch 2.13's CPU argmax of bfloat16 runs
   scalar code, so the decoder uses max(-1) for every draft step and verified position.
2. Attention at SmolLM2's shapes (9 query heads, 3 key/value heads, head dim 64, `scaled_dot_product_attention`
   as transformers calls it) for q = 1..9 query rows over 64..512 cached positions, in bfloat16, float32, and
   bfloat16 computed through float32. A single query row in bfloat16 (every target-only step and every draft step)
   is the slow case in isolation. Inside target-only decoding of MBPP prompts a float32 single-row path (tried as
   a `pair.attention` option, then removed) did not change a target step measurably (a one-off A/B, session 11's
   note on issue 15), so the decoder keeps transformers' sdpa.
3. Where a draft step of the default pair goes (`pair`, auto dtype, the loop's own `models.lm.LM` call after a
   200-token prompt): wall time per step and torch.profiler's self CPU time per op kind, so what is matrix products,
   what is attention and what is everything else (transformers' module code and the small ops it issues).
Writes results/bench/small_ops.json (one entry per machine) and small_ops.md; µs are medians of interleaved repeats.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from bench import interleaved_median_us, write_result
from models.cost import machine
from models.lm import LM
from models.pair import load_pair
from utils.cli import hydra_entry

VOCAB, HEADS, KV_HEADS, HEAD_DIM = 49152, 9, 3, 64
CONTEXTS, QUERIES = (64, 128, 256, 512), (1, 2, 3, 5, 9)


def timed(fns: dict, repeats: int) -> dict:
    """Median µs per call of each function, interleaved so a shared machine's drift hits them alike."""
    return {k: round(v, 1) for k, v in interleaved_median_us(fns, repeats, warmup=5).items()}


def argmax_times(repeats: int) -> dict:
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 4):
            z = torch.randn(rows, VOCAB).to(dtype)
            out[f"{str(dtype)[6:]} x{rows}"] = timed({"argmax(-1)": lambda: z.argmax(-1),
                                                      "max(-1).indices": lambda: z.max(-1).indices}, repeats)
    return out


def attention_times(repeats: int) -> dict:
    out = {}
    for ctx in CONTEXTS:
        for q_len in QUERIES:
            q = torch.randn(1, HEADS, q_len, HEAD_DIM).bfloat16()
            k, v = (torch.randn(1, KV_HEADS, ctx, HEAD_DIM).bfloat16() for _ in range(2))
            mask = None if q_len == 1 else torch.ones(q_len, ctx, dtype=torch.bool).tril(ctx - q_len)
            qf, kf, vf = q.float(), k.float(), v.float()

            def sdpa(a, b, c):
                return F.scaled_dot_product_attention(a, b, c, attn_mask=mask, enable_gqa=True)

            out[f"ctx {ctx} q {q_len}"] = timed({
                "bf16": lambda: sdpa(q, k, v),
                "fp32": lambda: sdpa(qf, kf, vf),
                "bf16 via fp32": lambda: sdpa(q.float(), k.float(), v.float()).bfloat16(),
            }, repeats)
    return out


def draft_step(pair_cfg: DictConfig, steps: int = 40) -> dict:
    """ms per draft step (median) and profiler self-CPU ms per step by op kind."""
    from torch.profiler import ProfilerActivity, profile

    pair = load_pair(pair_cfg)
    lm = LM.of(pair, "draft")
    cache = lm.new_cache()
    lm(list(range(100, 300)), cache, last=1)
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        lm([5], cache, last=1)
        ts.append(1e3 * (time.perf_counter() - t))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            lm([5], cache, last=1)
    kinds = {"products (packed)": ("mkldnn::_linear_pointwise",), "products (torch)": ("aten::mm", "aten::addmm"),
             "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",)}
    by = {k: 0.0 for k in [*kinds, "other ops"]}
    for ev in prof.key_averages():
        kind = next((k for k, names in kinds.items() if ev.key in names), "other ops")
        by[kind] += ev.self_cpu_time_total / 1e3 / steps
    return {"pair": str(pair_cfg.name), "dtype": str(pair.dtype).replace("torch.", ""), "step_ms": round(statistics.median(ts), 3),
            "self_cpu_ms": {k: round(v, 3) for k, v in by.items()}}


def markdown(entry: dict) -> str:
    lines = [f"Measured by `python -m bench.small_ops` on {entry['machine']}, {entry['threads']} threads, torch "
             f"{entry['torch']}, {entry['date']}; µs, median of {entry['repeats']} interleaved repeats.", "",
             "Greedy argmax over 49,152 logits (models.distributions.greedy_ids uses max(-1)):", "",
             "| dtype x rows | argmax(-1) | max(-1).indices |", "|---|---|---|"]
    for key, t in entry["argmax"].items():
        lines.append(f"| {key} | {t['argmax(-1)']} | {t['max(-1).indices']} |")
    lines += ["", "Attention, 9 query / 3 key-value heads of dim 64 (SmolLM2), `scaled_dot_product_attention`:", "",
              "| cached positions, query rows | bf16 | fp32 | bf16 via fp32 |", "|---|---|---|---|"]
    for key, t in entry["attention"].items():
        lines.append(f"| {key} | {t['bf16']} | {t['fp32']} | {t['bf16 via fp32']} |")
    d = entry["draft_step"]
    lines += ["", f"A draft step of `{d['pair']}` ({d['dtype']}, 200 cached positions): {d['step_ms']} ms; profiler "
              "self CPU per step (ms; the profiler adds its own overhead):", "",
              "| " + " | ".join(d["self_cpu_ms"]) + " |", "|" + "---|" * len(d["self_cpu_ms"]),
              "| " + " | ".join(str(v) for v in d["self_cpu_ms"].values()) + " |"]
    return "\n".join(lines) + "\n"


def run(cfg: DictConfig) -> None:
    torch.set_num_threads(cfg.threads)
    with torch.inference_mode():
        entry = {"machine": machine(), "threads": cfg.threads, "torch": torch.__version__, "repeats": cfg.repeats,
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "argmax": argmax_times(cfg.repeats), "attention": attention_times(cfg.repeats),
                 "draft_step": draft_step(cfg.pair)}
    write_result(cfg.out_dir, "small_ops", entry, lambda runs: markdown(entry).rstrip("\n").split("\n"),
                 key=entry["machine"])


if __name__ == "__main__":
    hydra_entry("bench/small_ops")(run)()
