"""Why float32 verification was expensive on CPU, and what `pair.linear=packed` (models.lm_head) changes.

    python -m bench.head_gemm [pair=smollm2_135m] [threads=2] [repeats=40] [out_dir=results/bench]

1. Products at the default pair's shapes (the 49,152 x 576 LM head, the 8,192-row FR-Spec draft head, the target's
   576x576, 192x576, 1536x576 and 576x1536 layers) for n = 1..9 rows: torch's `F.linear` against
   `models.lm_head.PackedLinear` (oneDNN, weight reordered once), in float32 and bfloat16.
2. The target's cost curve t(n)/t(1), t(1) and the draft step (models.profiling.measure, the loop's own calls) with
   `pair.linear=torch` ("before") and `pair.linear=packed` ("after"), in both dtypes.
Writes results/bench/head_gemm.json (one entry per machine) and head_gemm.md.
"""

from __future__ import annotations

import time

import torch
from omegaconf import DictConfig, OmegaConf

from bench import interleaved_median_us, write_result
from models.cost import machine
from models.profiling import DEFAULTS, measure
from models.lm_head import PackedLinear
from utils.cli import hydra_entry

SHAPES = {"lm head 49152x576": (49152, 576), "draft head 8192x576": (8192, 576), "q/o 576x576": (576, 576),
          "k/v 192x576": (192, 576), "mlp up 1536x576": (1536, 576), "mlp down 576x1536": (576, 1536)}
ROWS = range(1, 10)


def product_times(dtype: torch.dtype, repeats: int, shape) -> dict:
    """Median µs per product, n rows x shape[1] → shape[0], both forms timed interleaved so a shared machine's drift
    hits them alike."""
    w = torch.nn.Parameter(torch.randn(*shape, dtype=dtype), requires_grad=False)
    packed = PackedLinear(w)
    fns = {"F.linear": lambda x: torch.nn.functional.linear(x, w), "packed": packed}
    out = {}
    for n in ROWS:
        x = torch.randn(1, n, shape[1], dtype=dtype)  # no grad anywhere: the packed path, as in decoding
        out[str(n)] = interleaved_median_us({k: (lambda f=f: f(x)) for k, f in fns.items()}, repeats, warmup=3)
    return out


def curves(pair_cfg: DictConfig, repeats: int) -> dict:
    from models.pair import load_pair

    settings = OmegaConf.merge(DEFAULTS, {"max_n": 9, "repeats": repeats, "prefill_lengths": [32]})
    out = {}
    for dtype in ("float32", "bfloat16"):
        for linear in ("torch", "packed"):
            cfg = OmegaConf.create(OmegaConf.to_container(pair_cfg, resolve=True))
            cfg.dtype, cfg.linear = dtype, linear
            pair = load_pair(cfg)
            prof = measure(pair, settings, progress=False)
            out[f"{dtype} {'before (torch)' if linear == 'torch' else 'after (packed)'}"] = {
                "target_ms": prof.target_ms, "draft_ms": prof.draft_ms[0], "cost_ratio": prof.cost_ratio,
                "verify_ratio": [t / prof.target_ms[0] for t in prof.target_ms]}
            del pair
    return out


def markdown(data: dict) -> list[str]:
    lines = []
    for name, e in data.items():
        lines += [f"### {name} · {e['threads']} threads · torch {e['torch']} · {e['date']}", "",
                  "Products (µs), n rows → out features, F.linear / packed:", "",
                  "| dtype | product | " + " | ".join(f"n={n}" for n in ROWS) + " |", "|---|---|" + "---|" * len(ROWS)]
        for dt, shapes in e["products_us"].items():
            for shape, rows in shapes.items():
                lines.append(f"| {dt} | {shape} | " + " | ".join(
                    f"{rows[str(n)]['F.linear']:.0f} / {rows[str(n)]['packed']:.0f}" for n in ROWS) + " |")
        lines += ["", "Target pass over n tokens ÷ one target step (models.cost, the loop's own calls):", "",
                  "| setting | t(1) ms | draft ms | c | " + " | ".join(f"n={n}" for n in range(2, 10)) + " |",
                  "|---|---|---|---|" + "---|" * 8]
        for label, curve in e["target_curve"].items():
            lines.append(f"| {label} | {curve['target_ms'][0]:.1f} | {curve['draft_ms']:.1f} | {curve['cost_ratio']:.3f} | "
                         + " | ".join(f"{v:.2f}" for v in curve["verify_ratio"][1:9]) + " |")
        lines.append("")
    return lines


def run(cfg: DictConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    entry = {"machine": machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "products_us": {str(d).replace("torch.", ""): {name: product_times(d, cfg.repeats, shape)
                                                              for name, shape in SHAPES.items()}
                             for d in (torch.float32, torch.bfloat16)},
             "target_curve": curves(cfg.pair, max(cfg.repeats // 2, 10))}
    # entries of the older format (W @ hᵀ) are dropped
    write_result(cfg.out_dir, "head_gemm", entry, markdown, key=entry["machine"], keep=lambda e: "products_us" in e)


if __name__ == "__main__":
    hydra_entry("bench/head_gemm")(run)()
