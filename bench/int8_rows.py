"""Where the int8 draft's products should leave torch's int8 kernel (`pair.draft.int8_float_rows`).

    python -m bench.int8_rows [threads=[1,2]] [repeats=20] [out_dir=results/bench]

1. Products at the default draft's int8 shapes (q/k/v and gate/up stacked as models.lean runs them, o, down, the
   8,192-row FR-Spec head) for n rows: `aten._weight_int8pack_mm` (what Int8Linear runs below the switch) against
   a bf16 copy of the dequantized weight through oneDNN, packed once (what it runs from the switch on), bf16
   activations, median µs, interleaved.
2. The pair's cost profile (models.profiling.measure, the loop's own calls) with the switch off and at the pair's own:
   draft step, a token tree's draft level of n nodes ÷ draft step, and the draft's prefill.
Writes results/bench/int8_rows.json (one entry per machine) and int8_rows.md. bf16 CPUs only: elsewhere the draft
keeps float weights (models.lm_head.int8_kernel_is_fast) and the script says so.
"""

from __future__ import annotations

import time

import torch
from omegaconf import DictConfig, OmegaConf

import models.lm_head as lm_head
from bench import command, interleaved_median_us, write_result
from models.cost import machine
from models.profiling import DEFAULTS, measure
from utils.cli import UserError, hydra_entry

SHAPES = {"q/k/v 960x576": (960, 576), "o 576x576": (576, 576), "gate/up 3072x576": (3072, 576),
          "down 576x1536": (576, 1536), "draft head 8192x576": (8192, 576)}


def product_times(shape, rows, repeats: int) -> dict:
    """Median µs per product for each row count: the int8 kernel and the packed bf16 copy, timed interleaved."""
    torch.manual_seed(0)
    q = lm_head.Int8Linear(torch.randn(*shape, dtype=torch.bfloat16) * 0.02)
    float_copy = q._float_copy(torch.bfloat16)
    scale = q.scale.to(torch.bfloat16)
    fns = {"int8": lambda x: torch.ops.aten._weight_int8pack_mm(x, q.qweight, scale), "bf16": float_copy}
    out = {}
    for n in rows:
        x = torch.randn(n, shape[1], dtype=torch.bfloat16)
        out[str(n)] = interleaved_median_us({k: (lambda f=f: f(x)) for k, f in fns.items()}, repeats, warmup=1)
    return out


def profiles(pair_cfg: DictConfig, repeats: int) -> dict:
    """The pair's draft costs with the switch off (`draft.int8_float_rows=null`: every call through the int8 kernel)
    and at the pair's own switch."""
    from models.pair import load_pair

    settings = OmegaConf.merge(DEFAULTS, {"repeats": repeats, "refresh": True})
    switch, out = lm_head.int8_float_rows(pair_cfg.draft), {}
    for label, rows in (("int8 kernel only", None), (f"bf16 copy from {switch} rows", switch)):
        prof = measure(load_pair(OmegaConf.merge(pair_cfg, {"draft": {"int8_float_rows": rows}})), settings,
                       progress=False)
        out[label] = {"draft_ms": prof.draft_ms[0], "target_ms": prof.target_ms[0], "cost_ratio": prof.cost_ratio,
                      "level_ratio": [t / prof.draft_ms[0] for t in prof.draft_level_ms or []],
                      "prefill_lengths": prof.prefill_lengths, "prefill_draft_ms": prof.prefill_draft_ms}
    return out


def markdown(data: dict) -> list[str]:
    lines = ["# Int8 draft products: torch's int8 kernel vs a packed bf16 copy, by rows", ""]
    for name, e in data.items():
        lines += [f"## {name} · torch {e['torch']} · {e['date']}", "", f"`{e['command']}`", "",
                  f"Products (µs, median of {e['repeats']}), int8 kernel / bf16 copy; Int8Linear switches at "
                  f"{e['switch']} rows. Each product repeats one weight, which stays in cache: below ~5 rows the "
                  "int8 kernel's halved bytes pay only when weights stream from memory, as in the profile below.", ""]
        rows = [str(n) for n in e["rows"]]
        for threads, shapes in e["products_us"].items():
            lines += [f"{threads} thread(s):", "", "| product | " + " | ".join(f"n={n}" for n in rows) + " |",
                      "|---|" + "---|" * len(rows)]
            for shape, t in shapes.items():
                lines.append(f"| {shape} | " + " | ".join(f"{t[n]['int8']:.0f} / {t[n]['bf16']:.0f}" for n in rows) + " |")
            lines.append("")
        lines += [f"Cost profile ({e['profile_threads']} threads; models.profiling.measure): draft step, a draft level of n "
                  "nodes ÷ draft step, the draft's prefill:", "",
                  "| draft products | step ms | c | level n=2..12 ÷ step | prefill ms (L) |", "|---|---|---|---|---|"]
        for label, p in e["profile"].items():
            levels = " / ".join(f"{r:.2f}" for r in p["level_ratio"][1:])
            prefill = ", ".join(f"{ms:.0f} ({n})" for n, ms in zip(p["prefill_lengths"], p["prefill_draft_ms"]))
            lines.append(f"| {label} | {p['draft_ms']:.2f} | {p['cost_ratio']:.3f} | {levels} | {prefill} |")
        lines.append("")
    return lines


def run(cfg: DictConfig) -> None:
    if not (lm_head.packed_available() and lm_head.packed_bf16_available()):
        raise UserError("bench.int8_rows times bf16 products on a CPU oneDNN can pack bf16 on; this one cannot "
                        "(the default draft keeps float weights here: models.lm_head.int8_kernel_is_fast)")
    rows = [int(n) for n in cfg.rows]
    entry = {"machine": machine(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "command": command("int8_rows"), "switch": lm_head.int8_float_rows(cfg.pair.draft), "rows": rows,
             "repeats": cfg.repeats, "products_us": {}}
    for threads in cfg.threads:
        torch.set_num_threads(int(threads))
        entry["products_us"][str(threads)] = {name: product_times(shape, rows, int(cfg.repeats))
                                              for name, shape in SHAPES.items()}
    pair_cfg = OmegaConf.merge(cfg.pair, {"dtype": "bfloat16"})
    entry["profile_threads"] = torch.get_num_threads()
    entry["profile"] = profiles(pair_cfg, int(cfg.profile_repeats))
    write_result(cfg.out_dir, "int8_rows", entry, markdown, key=entry["machine"])


if __name__ == "__main__":
    hydra_entry("bench/int8_rows")(run)()
