"""Trace throughput: positions labelled per second by data_gen vs the bare cost of the same model work.

    python -m bench.trace_throughput [pair=smollm2_135m] [prompts=8] [max_new_tokens=32] [batch_size=8] [repeats=3]
        [split=test] [threads=0] [out_dir=results/bench]

"Ours" is `data_gen.run.generate` end to end (prompt prep, batched target generation with KV cache, the teacher-forced
draft pass, statistics, Arrow shard + manifest writes) into a temporary trace root. "Bare" is the least work that
could give the same labels: transformers' own batched greedy `generate` of the same continuations with KV cache,
plus one batched draft forward over prompt + continuation. The bar: ours ≥ 0.8 × bare (positions/s). Best of
`repeats` for each, run alternately so machine load hits both alike. Writes results/bench/trace_throughput.json and
a Markdown line to results/bench/trace_throughput.md.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time

import torch
from omegaconf import DictConfig, open_dict

from bench import compose_stage, write_result
from data_gen.prompts import load_prompts, render
from data_gen.run import generate
from data_gen.store import load_traces
from models.pair import load_pair
from utils.cli import hydra_entry

BAR = 0.8


def cfg_for(a: dict, root: str):
    """data_gen's config for these settings and the bench's pair (with its overrides), writing under `root`."""
    cfg = compose_stage(
        "data_gen",
        [f"pair={a['pair'].name}", "dataset=mbpp", "trace=target_ar", f"split={a['split']}", f"limit={a['prompts']}",
         f"batch_size={a['batch_size']}", f"prompts_per_shard={a['prompts']}", f"trace.max_new_tokens={a['max_new_tokens']}",
         f"trace_root={root}", "progress=false"],
    )
    with open_dict(cfg):
        cfg.pair = a["pair"]
    return cfg


def run_ours(cfg, pair, split) -> tuple[float, int]:
    start = time.perf_counter()
    folder = generate(cfg, split, pair)
    elapsed = time.perf_counter() - start
    ds, _ = load_traces(folder)
    return elapsed, ds.num_rows


@torch.no_grad()
def run_bare(pair, texts: list[str], max_new: int, batch_size: int) -> tuple[float, int]:
    """HF batched greedy generate (KV cache) + one batched draft forward over prompt + continuation."""
    tok = pair.tokenizer
    tok.padding_side = "left"
    special = not pair.chat_template
    positions = 0
    start = time.perf_counter()
    for b in range(0, len(texts), batch_size):
        enc = tok(texts[b : b + batch_size], return_tensors="pt", padding=True, add_special_tokens=special).to(pair.device)
        out = pair.target.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
        mask = torch.cat([enc["attention_mask"], torch.ones_like(out[:, enc["input_ids"].shape[1]:])], dim=-1)
        pair.draft(input_ids=out, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
        new = out[:, enc["input_ids"].shape[1]:]
        eos = tok.eos_token_id
        for row in new.tolist():  # positions up to and including the first EOS, as data_gen counts them
            positions += row.index(eos) + 1 if eos in row else len(row)
    return time.perf_counter() - start, positions


def run(cfg: DictConfig) -> None:
    a = {k: cfg[k] for k in ("pair", "prompts", "max_new_tokens", "batch_size", "repeats", "split", "threads")}
    if a["threads"] > 0:  # on a shared, oversubscribed CPU one thread per process measures more steadily
        torch.set_num_threads(a["threads"])
    pair = load_pair(cfg.pair)
    prompts = load_prompts(cfg_for(a, "/tmp").dataset, a["split"], a["prompts"])
    texts = [render(p, pair.tokenizer, pair.chat_template) for p in prompts]
    ours, bare = [], []
    with tempfile.TemporaryDirectory() as tmp:
        run_bare(pair, texts[:2], 4, 2)  # warm-up both paths (allocator, kernels, lazy imports)
        run_ours(cfg_for(dict(a, prompts=2, max_new_tokens=4, batch_size=2), f"{tmp}/warm"), pair, a["split"])
        for r in range(a["repeats"]):
            bare.append(run_bare(pair, texts, a["max_new_tokens"], a["batch_size"]))
            ours.append(run_ours(cfg_for(a, f"{tmp}/r{r}"), pair, a["split"]))
    t_ours, n_ours = min(ours)
    t_bare, n_bare = min(bare)
    result = {
        "pair": pair.pair_id,
        "dtype": str(pair.dtype).replace("torch.", ""),
        "device": str(pair.device),
        "prompts": a["prompts"],
        "split": a["split"],
        "max_new_tokens": a["max_new_tokens"],
        "batch_size": a["batch_size"],
        "positions_ours": n_ours,
        "positions_bare": n_bare,
        "seconds_ours": round(t_ours, 3),
        "seconds_bare": round(t_bare, 3),
        "positions_per_s_ours": round(n_ours / t_ours, 2),
        "positions_per_s_bare": round(n_bare / t_bare, 2),
        "ratio": round((n_ours / t_ours) / (n_bare / t_bare), 3),
        "bar": BAR,
        "all_seconds_ours": [round(t, 3) for t, _ in ours],
        "all_seconds_bare": [round(t, 3) for t, _ in bare],
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    result["pass"] = result["ratio"] >= BAR
    line = (
        f"| trace throughput | {result['pair']} {result['dtype']} {result['device']}, {a['prompts']} MBPP prompts, "
        f"{a['max_new_tokens']} new tokens, batch {a['batch_size']} | data_gen {result['positions_per_s_ours']} pos/s vs bare "
        f"{result['positions_per_s_bare']} pos/s | ratio {result['ratio']} (bar ≥ {BAR}: {'pass' if result['pass'] else 'FAIL'}) |"
    )
    write_result(cfg.out_dir, "trace_throughput", result, [line])


if __name__ == "__main__":
    hydra_entry("bench/trace_throughput")(run)()
