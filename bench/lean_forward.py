"""What `pair.forward=lean` (models.lean) saves over transformers' forward, per model call of the decoder.

    python bench/lean_forward.py [--pair smollm2_135m] [--dtype auto] [--threads 2] [--repeats 60]

Loads the pair once and times, through the decoder's own `models.lm.LM` calls after a 192-token context, a draft step,
a target step and a 6-token verification pass with transformers' forward and with the lean one, interleaved so a
shared machine's drift hits both alike (medians, ms), plus the largest difference between the two forwards' logits
over those calls (0 where they are the same bits). Writes bench/results/lean_forward.json (one entry per machine and
dtype) and lean_forward.md.
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

from models.cost import machine  # noqa: E402
from models.lm import LM  # noqa: E402
from models.pair import load_pair  # noqa: E402
from utils.cli import check_name  # noqa: E402

OUT = REPO / "bench" / "results"
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="smollm2_135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = OmegaConf.load(check_name("pair", args.pair))
    cfg.dtype = args.dtype
    pair = load_pair(cfg)
    dtype = str(pair.dtype).replace("torch.", "")
    rows = measure(pair, args.repeats)
    entry = {"machine": machine(), "dtype": dtype, "threads": args.threads, "pair": args.pair, "context": CONTEXT,
             "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "calls": rows}
    path = OUT / "lean_forward.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[f"{entry['machine']} · {dtype}"] = entry
    path.write_text(json.dumps(data, indent=1))
    lines = ["# transformers' forward vs models.lean, per decoder call (`python bench/lean_forward.py`)", ""]
    for key, e in data.items():
        lines += [f"## {key} · {e['threads']} threads · {e['pair']} · torch {e['torch']} · {e['date']}", "",
                  "| call | transformers ms | lean ms | lean ÷ transformers | max logit difference |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {r['transformers_ms']:.2f} | {r['lean_ms']:.2f} | {r['ratio']:.2f} | {r['max_logit_diff']:g} |"
                  for name, r in e["calls"].items()]
        lines.append("")
    (OUT / "lean_forward.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
