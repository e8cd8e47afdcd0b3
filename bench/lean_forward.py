"""What `pair.forward=lean` (models.lean) saves over transformers' forward, per model call of the decoder.

    python -m bench.lean_forward [pair=smollm2_135m] [dtype=auto] [threads=2] [repeats=60] [out_dir=results/bench]

Loads the pair once and times, through the decoder's own `models.lm.LM` calls after a 192-token context, a draft step,
a target step and a 6-token verification pass with transformers' forward and with the lean one, interleaved so a
shared machine's drift hits both alike (medians, ms), plus the largest difference between the two forwards' logits
over those calls (0 where they are the same bits). Writes results/bench/lean_forward.json (one entry per machine and
dtype) and lean_forward.md.
"""

from __future__ import annotations

import statistics
import time

import torch
from omegaconf import DictConfig, OmegaConf

from bench import write_result
from models.cost import machine
from models.lm import LM
from models.pair import load_pair
from utils.cli import hydra_entry

CONTEXT = 192
CALLS = {"draft step": ("draft", 1), "target step": ("target", 1), "verification (6 tokens)": ("target", 6)}


@torch.inference_mode()
def measure(pair, repeats: int) -> dict:
    ids = torch.randint(100, pair.vocab_size - 1, (CONTEXT + 8,), generator=torch.Generator().manual_seed(0)).tolist()
    lms = {(role, fwd): LM(getattr(pair, role), pair.vocab_size, lean=fwd == "lean")
           for role in ("draft", "target") for fwd in ("hf", "lean")}
    caches = {}
    for key, lm in lms.items():
        caches[key] = lm.new_cache()
        lm(ids[:CONTEXT], caches[key], last=0)
    times = {(name, fwd): [] for name in CALLS for fwd in ("hf", "lean")}
    diff = {name: 0.0 for name in CALLS}
    for r in range(repeats + 5):
        for name, (role, n) in CALLS.items():
            out = {}
            for fwd in ("hf", "lean"):
                lm, cache = lms[(role, fwd)], caches[(role, fwd)]
                t = time.perf_counter()
                out[fwd], _ = lm(ids[CONTEXT: CONTEXT + n], cache, last=n)
                dt = time.perf_counter() - t
                cache.crop(-n)
                if r >= 5:
                    times[(name, fwd)].append(dt)
            z = [x[torch.isfinite(x)].float() for x in (out["hf"], out["lean"])]
            diff[name] = max(diff[name], float((z[0] - z[1]).abs().max()))
    rows = {}
    for name in CALLS:
        hf, lean = (1000 * statistics.median(times[(name, f)]) for f in ("hf", "lean"))
        rows[name] = {"transformers_ms": round(hf, 2), "lean_ms": round(lean, 2), "ratio": round(lean / hf, 3),
                      "max_logit_diff": round(diff[name], 4)}
    return rows


def run(cfg: DictConfig) -> None:
    torch.set_num_threads(cfg.threads)
    pair_cfg = OmegaConf.create(OmegaConf.to_container(cfg.pair, resolve=True))
    pair_cfg.dtype = cfg.dtype
    pair = load_pair(pair_cfg)
    dtype = str(pair.dtype).replace("torch.", "")
    rows = measure(pair, cfg.repeats)
    entry = {"machine": machine(), "dtype": dtype, "threads": cfg.threads, "pair": str(cfg.pair.name), "context": CONTEXT,
             "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "calls": rows}
    write_result(cfg.out_dir, "lean_forward", entry, markdown, key=f"{entry['machine']} · {dtype}")


def markdown(data: dict) -> list[str]:
    lines = ["# transformers' forward vs models.lean, per decoder call (`python -m bench.lean_forward`)", ""]
    for key, e in data.items():
        lines += [f"## {key} · {e['threads']} threads · {e['pair']} · torch {e['torch']} · {e['date']}", "",
                  "| call | transformers ms | lean ms | lean ÷ transformers | max logit difference |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {r['transformers_ms']:.2f} | {r['lean_ms']:.2f} | {r['ratio']:.2f} | {r['max_logit_diff']:g} |"
                  for name, r in e["calls"].items()]
        lines.append("")
    return lines


if __name__ == "__main__":
    hydra_entry("bench/lean_forward")(run)()
