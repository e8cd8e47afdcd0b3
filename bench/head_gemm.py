"""Why float32 verification was expensive, and what `models.lm_head.project` changes.

    python bench/head_gemm.py [--pair smollm2_135m] [--threads 2] [--repeats 40]

1. The LM head's product at the default pair's shape (49,152 × 576) for n = 1..9 rows: torch's `F.linear(h, W)`
   against `models.lm_head.project` (W @ hᵀ, one row padded to two), in float32 and bfloat16; and the target's
   layer products (576×576, 192×576, 1536×576, 576×1536) in float32, where the same cliff shows.
2. The target's cost curve t(n)/t(1) in float32 (models.cost.measure, the loop's own calls) with torch's product
   ("before") and with `project` ("after"); and bf16 for reference.
Writes bench/results/head_gemm.json (one entry per machine) and head_gemm.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import models.lm_head as lm_head  # noqa: E402
from models.cost import DEFAULTS, machine, measure  # noqa: E402

OUT = REPO / "bench" / "results"


SHAPES = {"lm head 49152x576": (49152, 576), "q/o 576x576": (576, 576), "k/v 192x576": (192, 576),
          "mlp up 1536x576": (1536, 576), "mlp down 576x1536": (576, 1536)}


def product_times(dtype: torch.dtype, repeats: int, shape=(49152, 576)) -> dict:
    w = torch.randn(*shape, dtype=dtype)
    fns = {"F.linear": lambda x: torch.nn.functional.linear(x, w), "project": lambda x: lm_head.project(x, w)}
    out = {}
    for n in range(1, 10):
        x = torch.randn(n, shape[1], dtype=dtype)
        ts = {k: [] for k in fns}
        for f in fns.values():
            for _ in range(3):
                f(x)
        for _ in range(repeats):  # interleaved, so drift of a shared machine hits both alike
            for k, f in fns.items():
                t = time.perf_counter()
                f(x)
                ts[k].append(1000 * (time.perf_counter() - t))
        out[n] = {k: statistics.median(v) for k, v in ts.items()}
    return out


def curves(pair_name: str, repeats: int) -> dict:
    from models.pair import load_pair

    settings = OmegaConf.merge(DEFAULTS, {"max_n": 9, "repeats": repeats, "prefill_lengths": [32]})
    out = {}
    for dtype in ("float32", "bfloat16"):
        cfg = OmegaConf.load(REPO / "conf" / "pair" / f"{pair_name}.yaml")
        cfg.dtype = dtype
        pair = load_pair(cfg)
        for fast in ((False, True) if dtype == "float32" else (True,)):
            lm_head.FAST_FLOAT32 = fast
            prof = measure(pair, settings, progress=False)
            label = f"{dtype} " + ("after (project)" if fast else "before (F.linear)") if dtype == "float32" else dtype
            out[label] = {"target_ms": prof.target_ms, "draft_ms": prof.draft_ms[0], "cost_ratio": prof.cost_ratio,
                          "verify_ratio": [prof.target_ms[i] / prof.target_ms[0] for i in range(len(prof.target_ms))]}
        lm_head.FAST_FLOAT32 = True
        del pair
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="smollm2_135m")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    entry = {"machine": machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "lm_head_ms": {str(d).replace("torch.", ""): product_times(d, args.repeats)
                            for d in (torch.float32, torch.bfloat16)},
             "body_ms": {name: product_times(torch.float32, args.repeats * 4, shape)
                         for name, shape in SHAPES.items() if not name.startswith("lm head")},
             "target_curve": curves(args.pair, max(args.repeats // 2, 10))}
    path = OUT / "head_gemm.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[entry["machine"]] = entry
    OUT.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    lines = []
    for name, e in data.items():
        lines += [f"### {name} · {e['threads']} threads · torch {e['torch']} · {e['date']}", "",
                  "LM head product (ms), n rows × 576 → 49,152:", "",
                  "| dtype | form | " + " | ".join(f"n={n}" for n in range(1, 10)) + " |",
                  "|---|---|" + "---|" * 9]
        for dt, rows in e["lm_head_ms"].items():
            for form in ("F.linear", "project"):
                lines.append(f"| {dt} | {form} | " + " | ".join(f"{rows[str(n)][form]:.1f}" if str(n) in rows
                                                               else f"{rows[n][form]:.1f}" for n in range(1, 10)) + " |")
        if e.get("body_ms"):
            lines += ["", "The target's layer products in float32 (µs), F.linear / project — the same small-row cliff, "
                      "which `project` does not cure there:", "",
                      "| product | " + " | ".join(f"n={n}" for n in range(1, 10)) + " |", "|---|" + "---|" * 9]
            for name, rows in e["body_ms"].items():
                lines.append(f"| {name} | " + " | ".join(
                    f"{1000 * rows[str(n) if str(n) in rows else n]['F.linear']:.0f} / "
                    f"{1000 * rows[str(n) if str(n) in rows else n]['project']:.0f}" for n in range(1, 10)) + " |")
        lines += ["", "Target pass over n tokens ÷ one target step (models.cost, the loop's own calls):", "",
                  "| setting | t(1) ms | draft ms | c | " + " | ".join(f"n={n}" for n in range(2, 10)) + " |",
                  "|---|---|---|---|" + "---|" * 8]
        for label, curve in e["target_curve"].items():
            lines.append(f"| {label} | {curve['target_ms'][0]:.1f} | {curve['draft_ms']:.1f} | {curve['cost_ratio']:.3f} | "
                         + " | ".join(f"{v:.2f}" for v in curve["verify_ratio"][1:9]) + " |")
        lines.append("")
    (OUT / "head_gemm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
