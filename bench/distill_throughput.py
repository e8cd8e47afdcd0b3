"""Distillation-data throughput: positions per second of `train.distill_data` vs the bare batched forward.

    python -m bench.distill_throughput [pair=smollm2_135m] [prompts=24] [max_new_tokens=256] [batch_size=24]
        [repeats=1] [threads=0] [out_dir=results/bench]

"Ours" is `train.distill_data.shard_rows` + `write_shard` end to end on the first `prompts` of the job's own prompt
plan (chat template, train.batch_gen's batched generation with the teacher's top-k recorded at every step, greedy and
T = 1, Arrow shard with checksums). "Bare" is what one would write first: transformers' batched `generate` of the
same prompts at the same temperatures (one call per temperature), nothing recorded, nothing written. Best of
`repeats`, run alternately so machine load hits both alike. The ratio says what the job's own generator gains net of
the recording and the storage (the responses differ in their samples, not in their law, so positions are counted on
each side). Writes distill_throughput.{json,md} under out_dir.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from bench import command, compose_stage, write_result
from data_gen.traces import _left_pad
from models.pair import load_pair
from train import distill_data as dd
from utils.cli import hydra_entry


def data_cfg(cfg: DictConfig) -> DictConfig:
    """The data job's config with this bench's pair and sizes (no generated prompts: phase 2 only)."""
    c = compose_stage("distill_data", [f"responses.max_new_tokens={cfg.max_new_tokens}",
                                      f"batch_size={cfg.batch_size}", "gen_prompts.enabled=false", "progress=false"])
    c.pair = cfg.pair
    return c


def run_ours(c: DictConfig, pair, prompts) -> tuple[float, int]:
    start = time.perf_counter()
    rows = dd.shard_rows(c, pair, prompts, 0)
    with tempfile.TemporaryDirectory() as tmp:
        dd.write_shard(Path(tmp), 0, rows, {})
    return time.perf_counter() - start, sum(len(r["ids"]) - r["start"] for r in rows)


@torch.inference_mode()
def run_bare(c: DictConfig, pair, prompts) -> tuple[float, int]:
    from transformers import GenerationConfig

    enc = sorted((dd._encode(pair, p.text) for p in prompts), key=len)
    enc = [e for e in enc if len(e) <= int(c.max_prompt_tokens)]
    eos = dd.eos_ids(pair.target, pair.tokenizer)
    positions, start = 0, time.perf_counter()
    for temp in c.responses.temperatures:
        gc = GenerationConfig(max_new_tokens=int(c.responses.max_new_tokens), do_sample=temp > 0, temperature=1.0,
                              top_k=None, top_p=None, pad_token_id=pair.tokenizer.pad_token_id, eos_token_id=sorted(eos))
        for b in range(0, len(enc), int(c.batch_size)):
            ids, mask, _ = _left_pad(enc[b : b + int(c.batch_size)], pair.tokenizer.pad_token_id, pair.device)
            out = pair.target.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
            for row in out[:, ids.shape[1]:].tolist():
                positions += next((t + 1 for t, x in enumerate(row) if x in eos), len(row))
    return time.perf_counter() - start, positions


def run(cfg: DictConfig) -> None:
    if int(cfg.threads) > 0:
        torch.set_num_threads(int(cfg.threads))
    c = data_cfg(cfg)
    pcfg = OmegaConf.create(OmegaConf.to_container(cfg.pair, resolve=True))
    pcfg.draft = OmegaConf.create({"source": "layer_subset", "layers": [0]})  # only the target runs
    pair = load_pair(pcfg)
    prompts = dd.all_prompts(c, [])[: int(cfg.prompts)]
    run_bare(c, pair, prompts[:2]), run_ours(c, pair, prompts[:2])  # warm-up both paths
    ours, bare = [], []
    for _ in range(int(cfg.repeats)):
        bare.append(run_bare(c, pair, prompts))
        ours.append(run_ours(c, pair, prompts))
    (t_o, n_o), (t_b, n_b) = min(ours), min(bare)
    result = {"command": command("distill_throughput"), "pair": pair.pair_id,
              "dtype": str(pair.dtype).replace("torch.", ""), "device": str(pair.device), "prompts": len(prompts),
              "temperatures": list(c.responses.temperatures), "max_new_tokens": int(cfg.max_new_tokens),
              "batch_size": int(cfg.batch_size), "positions_ours": n_o, "positions_bare": n_b,
              "positions_per_s_ours": round(n_o / t_o, 2), "positions_per_s_bare": round(n_b / t_b, 2),
              "ratio": round((n_o / t_o) / (n_b / t_b), 3), "seconds_ours": [round(t, 2) for t, _ in ours],
              "seconds_bare": [round(t, 2) for t, _ in bare], "torch_threads": torch.get_num_threads(),
              "cpu": platform.processor() or platform.machine(), "load_avg_1min": round(os.getloadavg()[0], 2),
              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    line = (f"| distillation data | {result['pair']} {result['dtype']} {result['device']}, {len(prompts)} prompts × "
            f"T {result['temperatures']}, ≤{cfg.max_new_tokens} new tokens, batch {cfg.batch_size}, "
            f"{result['torch_threads']} threads, {result['cpu']} | ours {result['positions_per_s_ours']} pos/s vs bare "
            f"{result['positions_per_s_bare']} pos/s | ratio {result['ratio']} |")
    write_result(cfg.out_dir, "distill_throughput", result, [f"`{result['command']}` ({result['date_utc']})", "", line])


if __name__ == "__main__":
    hydra_entry("bench/distill_throughput")(run)()
