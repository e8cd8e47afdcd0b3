"""Is bf16 worth it on this CPU? Time a batch-1 matrix-vector product and a 6-row product (a verify pass) of the
default target's shapes in float32 and bfloat16, and say what `pair.dtype=auto` resolves to here.

    python -m bench.cpu_dtype [threads=1] [repeats=200] [out_dir=results/bench]

Writes results/bench/cpu_dtype.json (one entry per machine name, so runs on different CPUs sit side by side) and
prints a Markdown table. On a CPU without native bf16 instructions PyTorch emulates bf16 and the matrix-vector product,
the whole cost of a batch-1 decoding step, is an order of magnitude slower than float32.
"""

from __future__ import annotations

import time

import torch
from omegaconf import DictConfig

from bench import write_result
from models.cost import machine
from models.pair import cpu_has_native_bf16
from utils.cli import hydra_entry

SHAPES = {"attn proj 576x576": (576, 576), "mlp up 576x1536": (576, 1536), "lm head 576x49152": (576, 49152)}


def best_time(rows: int, shape: tuple[int, int], dtype: torch.dtype, repeats: int) -> float:
    x, w = torch.randn(rows, shape[0], dtype=dtype), torch.randn(*shape, dtype=dtype)
    for _ in range(5):
        x @ w
    best = float("inf")
    for _ in range(3):  # best of 3 blocks: the least disturbed by other load
        t = time.perf_counter()
        for _ in range(repeats):
            x @ w
        best = min(best, (time.perf_counter() - t) / repeats)
    return best


def run(cfg: DictConfig) -> None:
    threads, repeats = int(cfg.threads), int(cfg.repeats)
    torch.set_num_threads(threads)
    rows = []
    for label, shape in SHAPES.items():
        reps = max(10, repeats // (20 if shape[1] > 10000 else 1))
        for n in (1, 6):
            f32 = best_time(n, shape, torch.float32, reps)
            bf16 = best_time(n, shape, torch.bfloat16, reps)
            rows.append({"shape": label, "rows": n, "float32_us": 1e6 * f32, "bfloat16_us": 1e6 * bf16,
                         "bf16_over_fp32": bf16 / f32})
    name = machine()
    entry = {"machine": name, "torch": torch.__version__, "threads": threads,
             "auto_resolves_to": "bfloat16" if cpu_has_native_bf16() else "float32",
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    write_result(cfg.out_dir, "cpu_dtype", entry, markdown, key=name)


def markdown(entries: dict) -> list[str]:
    """One table per machine: each product's µs in float32 and bfloat16, and what `auto` resolves to there."""
    lines = []
    for name, e in entries.items():
        lines += [f"{name}, {e['threads']} thread(s), torch {e['torch']}, {e['date']}: pair.dtype=auto → "
                  f"{e['auto_resolves_to']}", "", "| product | rows | float32 µs | bfloat16 µs | bf16 / fp32 |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['rows']} | {r['float32_us']:.0f} | {r['bfloat16_us']:.0f} | "
                  f"{r['bf16_over_fp32']:.1f} |" for r in e["rows"]]
        lines.append("")
    return lines


if __name__ == "__main__":
    hydra_entry("bench/cpu_dtype")(run)()
