"""Our speculative loop vs transformers' assisted generation at the same constant K (greedy, batch 1, same prompts).

    python -m bench.decode_vs_transformers [pair=smollm2_135m] [dataset=mbpp] [split=test] [limit=5]
        [max_new_tokens=64] [k=5] [repeats=1] [threads=N] [out_dir=results/bench]

transformers runs `target.generate(input_ids, assistant_model=draft, do_sample=False, max_new_tokens=M)` with the
draft's generation_config set to num_assistant_tokens=K, num_assistant_tokens_schedule="constant",
assistant_confidence_threshold=0 (no early stop), so both sides draft exactly K tokens per round. Ours runs
decode.loop.speculative with the `constant` policy (k=K). Per prompt the two alternate (after one warm-up of each),
so drift on a shared machine hits both alike. Writes results/bench/decode_vs_transformers.json with ours_s,
transformers_s, ratio = ours_s / transformers_s (≤ 1 means we are at least as fast) and outputs_match.
"""

from __future__ import annotations

import copy
import platform
import time

import torch
from omegaconf import DictConfig

from bench import write_result
from data_gen.prompts import load_prompts
from decode.loop import autoregressive, speculative
from decode.metrics import agreement
from decode.rules import Constant
from decode.run import tokenize_prompts
from models.pair import load_pair
from utils.cli import hydra_entry


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def hf_assisted(pair, assistant, ids: list[int], max_new: int, eos: set[int]) -> tuple[list[int], float]:
    x = torch.tensor([ids], device=pair.device)
    sync(pair.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = pair.target.generate(x, attention_mask=torch.ones_like(x), assistant_model=assistant, do_sample=False,
                                   max_new_tokens=max_new, eos_token_id=sorted(eos), pad_token_id=pair.tokenizer.pad_token_id)
    sync(pair.device)
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def ours(pair, ids: list[int], k: int, max_new: int, eos: set[int]) -> tuple[list[int], float]:
    res = speculative(pair, ids, Constant(k=k), max_new, 0.0, 1.0, eos)
    return res.tokens, res.wall_s


def constant_assistant(pair, k: int):
    """The draft as transformers' assistant, drafting exactly k tokens per round. The layer-subset draft shares
    modules with the target; transformers gets its own copy so nothing is shared."""
    assistant = copy.deepcopy(pair.draft)
    gc = assistant.generation_config
    gc.num_assistant_tokens = k
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0
    return assistant


def timed_rows(pair, assistant, prompts, ids, cfg, eos: set[int]) -> list[dict]:
    """Both sides on every prompt, `cfg.repeats` times, alternating which goes first (so neither always runs on a
    just-warmed cache); rows keep both outputs under `_ours` / `_hf` for `explain_mismatches`."""
    rows = []
    for rep in range(cfg.repeats):
        for p, x in zip(prompts, ids):
            if (rep + len(rows)) % 2 == 0:
                t_o, s_o = ours(pair, x, cfg.k, cfg.max_new_tokens, eos)
                t_h, s_h = hf_assisted(pair, assistant, x, cfg.max_new_tokens, eos)
            else:
                t_h, s_h = hf_assisted(pair, assistant, x, cfg.max_new_tokens, eos)
                t_o, s_o = ours(pair, x, cfg.k, cfg.max_new_tokens, eos)
            same = t_o == t_h
            rows.append({"prompt_id": p.prompt_id, "repeat": rep, "ours_s": s_o, "transformers_s": s_h,
                         "ours_tokens": len(t_o), "transformers_tokens": len(t_h), "match": same,
                         "first_divergence": None if same else agreement(t_o, t_h)["prefix_match"],
                         "_ours": t_o, "_hf": t_h})
            print(f"{p.prompt_id}: ours {s_o:.3f}s ({len(t_o)} tok)  transformers {s_h:.3f}s ({len(t_h)} tok)  "
                  f"match={same}", flush=True)
    return rows


def explain_mismatches(pair, rows: list[dict], ids, cfg, eos: set[int]) -> None:
    """Untimed: where the two disagree, which one equals plain greedy decoding? (bf16 near-ties can flip an argmax
    when the same positions are computed in differently shaped passes; each side is compared with its own
    target-only decoding: ours = decode.loop.autoregressive, transformers = target.generate without assistant)"""
    for row, x in zip(rows, ids * cfg.repeats):
        t_o, t_h = row.pop("_ours"), row.pop("_hf")
        if row["match"] or row["repeat"]:
            continue
        ar = autoregressive(pair, x, cfg.max_new_tokens, eos=eos).tokens
        plain, _ = hf_assisted(pair, None, x, cfg.max_new_tokens, eos)
        row.update(ours_equals_own_target_only=t_o == ar, transformers_equals_own_target_only=t_h == plain,
                   target_only_ours_vs_transformers_first_divergence=agreement(ar, plain)["prefix_match"])


def run(cfg: DictConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    pair = load_pair(cfg.pair)
    prompts = load_prompts(cfg.dataset, cfg.split, cfg.limit)
    ids = tokenize_prompts(pair, prompts, cfg.max_new_tokens)
    eos = pair.eos_ids
    assistant = constant_assistant(pair, cfg.k)
    warm = cfg.max_new_tokens  # warm-up both over the full length (cache growth, allocator, kernel choice)
    hf_assisted(pair, assistant, ids[0], warm, eos)
    ours(pair, ids[0], cfg.k, warm, eos)
    rows = timed_rows(pair, assistant, prompts, ids, cfg, eos)
    ours_s, hf_s = sum(r["ours_s"] for r in rows), sum(r["transformers_s"] for r in rows)
    match = all(r["match"] for r in rows)
    explain_mismatches(pair, rows, ids, cfg, eos)
    result = {
        "ours_s": ours_s,
        "transformers_s": hf_s,
        "ratio": ours_s / hf_s if hf_s else float("nan"),
        "outputs_match": bool(match),
        "pair": pair.pair_id,
        "dataset": str(cfg.dataset.name),
        "split": cfg.split,
        "prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "k": cfg.k,
        "repeats": cfg.repeats,
        "greedy": True,
        "batch_size": 1,
        "device": str(pair.device),
        "dtype": str(pair.dtype),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "per_prompt": rows,
    }
    line = (f"ours {result['ours_s']:.2f} s vs transformers {result['transformers_s']:.2f} s: ratio "
            f"{result['ratio']:.3f} (≤ 1: ours at least as fast), outputs match: {result['outputs_match']}")
    write_result(cfg.out_dir, "decode_vs_transformers", result, [line])


if __name__ == "__main__":
    hydra_entry("bench/decode_vs_transformers")(run)()
