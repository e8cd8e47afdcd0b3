"""A trained stop head inside transformers' own generate() vs target-only generate() and transformers' dynamic
assistant: same prompts, one process, greedy, batch 1.

    python -m bench.hf_generate [ckpt=models/weights/heads/disco_plus_copy_token_mbpp.ckpt] [pair=smollm2_135m]
        [limit=20] [max_new_tokens=128] [policy.rule=auto] [threads=N] [out_dir=results/hf_generate]

Three calls of `pair.target.generate(ids, do_sample=False, max_new_tokens=M, eos_token_id=..., ...)`, on the plain
transformers modules (never our lean forward), each method drafting with its own copy of the pair's draft:
- `target_only`: no assistant;
- `transformers_dynamic`: `assistant_model=draft` with transformers' dynamic settings (decode/hf.py's HFAssisted:
  num_assistant_tokens 20, num_assistant_tokens_schedule "heuristic", assistant_confidence_threshold 0.4, which
  transformers refits from the ROC of each call's drafted tokens);
- `ours`: `assistant_model=draft, custom_generate=hook` with `hook = decode.hf_generate.stop_policy_generator(ckpt)`:
  the head decides every draft length (its stored stop rule; the expected-value rule reads the pair's measured cost
  profile, models.cost, measured once and cached).
Warm-up: one full-length generation per method, then fresh objects (transformers' heuristic keeps its K across
calls). Per prompt the three run in a rotated order, so slow drift of a shared machine hits each alike. Identical =
the same tokens as target-only generate(). Writes <out_dir>/summary.md and <out_dir>/bar.json.
"""

from __future__ import annotations

import copy
import time

import torch
import transformers
from omegaconf import DictConfig, OmegaConf

from bench import command, repo_path, write_result
from data_gen.prompts import load_prompts
from decode.hf import HFAssisted
from decode.hf_generate import stop_policy_generator
from decode.loop import GenResult
from decode.run import tokenize_prompts
from models.cost import machine
from models.profiling import get_profile
from models.lm import Clock
from models.pair import load_pair
from utils.cli import hydra_entry

METHODS = ("target_only", "transformers_dynamic", "ours")
LABELS = {"target_only": "target-only generate()", "transformers_dynamic": "transformers dynamic assistant",
          "ours": "ours: stop head in generate()"}


@torch.inference_mode()
def timed_generate(pair, prompt_ids: list[int], max_new_tokens: int, eos: set[int] | None, **extra):
    """(new tokens, seconds) of one greedy `target.generate()` call, `extra` naming the assistant and hook."""
    x = torch.tensor([prompt_ids], device=pair.device)
    clock = Clock(pair.device)
    t0 = clock()
    out = pair.target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                               eos_token_id=sorted(eos or []), pad_token_id=pair.tokenizer.pad_token_id, **extra)
    return out[0, len(prompt_ids):].tolist(), clock() - t0


class Plain:
    """Target-only greedy `generate()`: the baseline every speedup divides by."""

    def __init__(self, pair):
        self.pair = pair

    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos: set[int] | None = None) -> GenResult:
        tokens, wall = timed_generate(self.pair, prompt_ids, max_new_tokens, eos)
        return GenResult(tokens=tokens, wall_s=wall, target_calls=len(tokens))


class Ours:
    """The head inside generate() through decode.hf_generate; counters from the hook's per-round record."""

    def __init__(self, pair, cfg: DictConfig):
        self.pair = pair
        # its own copy of the draft, as HFAssisted has (the student shares modules with the target)
        self.assistant = copy.deepcopy(pair.draft)
        params = {k: v for k, v in OmegaConf.to_container(cfg.policy, resolve=True).items() if v is not None}
        self.hook = stop_policy_generator(str(repo_path(cfg.ckpt)), self.assistant, pair=pair,
                                          profile=lambda: get_profile(pair, cfg.profile), **params)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos: set[int] | None = None) -> GenResult:
        tokens, wall = timed_generate(self.pair, prompt_ids, max_new_tokens, eos, assistant_model=self.assistant,
                                      custom_generate=self.hook)
        rounds = list(self.hook.rounds)
        drafted = sum(k for k, _ in rounds)
        return GenResult(tokens=tokens, wall_s=wall, target_calls=len(rounds),
                         draft_calls=drafted, drafted=drafted, accepted=sum(n for _, n in rounds), rounds=rounds)


def build(pair, cfg: DictConfig) -> dict:
    """A fresh object per method (adaptive state starts afresh)."""
    dyn = cfg.dynamic
    return {"target_only": Plain(pair),
            "transformers_dynamic": HFAssisted(pair, int(dyn.num_assistant_tokens), str(dyn.schedule),
                                               float(dyn.confidence_threshold)),
            "ours": Ours(pair, cfg)}


def timed_rows(methods: dict, prompts, ids, max_new_tokens: int, eos: set[int]) -> list[dict]:
    """Every method on every prompt, the order rotated per prompt; one row per method × prompt."""
    rows = []
    for i, (prompt, x) in enumerate(zip(prompts, ids)):
        order = METHODS[i % len(METHODS):] + METHODS[:i % len(METHODS)]
        res = {name: methods[name].generate(x, max_new_tokens, eos=eos) for name in order}
        ref = res["target_only"].tokens
        for name in METHODS:
            r = res[name]
            rows.append({"method": name, "prompt_id": prompt.prompt_id, "wall_s": r.wall_s, "new_tokens": len(r.tokens),
                         "target_calls": r.target_calls, "drafted": r.drafted, "accepted": r.accepted,
                         "identical": r.tokens == ref})
        print(f"{prompt.prompt_id}: " + "  ".join(f"{name} {res[name].wall_s:.2f}s" for name in METHODS), flush=True)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Per method: seconds, tok/s, speedup (tok/s ÷ target-only tok/s), mean accepted length, identical prompts."""
    out = {}
    for name in METHODS:
        mine = [r for r in rows if r["method"] == name]
        secs, toks = sum(r["wall_s"] for r in mine), sum(r["new_tokens"] for r in mine)
        calls, drafted = sum(r["target_calls"] for r in mine), sum(r["drafted"] for r in mine)
        out[name] = {"seconds": secs, "new_tokens": toks, "tokens_per_s": toks / secs if secs else 0.0,
                     "mean_accepted_length": toks / calls if calls and name != "target_only" else None,
                     "acceptance_rate": sum(r["accepted"] for r in mine) / drafted if drafted else None,
                     "target_calls": calls, "identical_prompts": sum(r["identical"] for r in mine),
                     "prompts": len(mine)}
    base = out["target_only"]["tokens_per_s"]
    for s in out.values():
        s["speedup"] = s["tokens_per_s"] / base if base else float("nan")
    return out


def markdown(summary: dict, about: dict) -> str:
    lines = [
        "# A trained stop head inside transformers' generate() (issue 28)", "",
        f"`{about['command']}` — {about['prompts']} {about['dataset']} {about['split']} prompts, up to "
        f"{about['max_new_tokens']} new tokens, greedy, batch 1. Machine: {about['machine']}; dtype {about['dtype']}; "
        f"{about['threads']} torch threads; torch {about['torch']}, transformers {about['transformers']}; {about['date']}.",
        f"Head: `{about['ckpt']}` (stop rule: {about['rule']}). transformers' dynamic assistant: "
        f"num_assistant_tokens {about['dynamic']['num_assistant_tokens']}, schedule {about['dynamic']['schedule']}, "
        f"assistant_confidence_threshold {about['dynamic']['confidence_threshold']}.", "",
        "| method | seconds | tok/s | speedup vs target-only | mean accepted length | identical |",
        "|---|---|---|---|---|---|",
    ]
    for name in METHODS:
        s = summary[name]
        mal = "—" if s["mean_accepted_length"] is None else f"{s['mean_accepted_length']:.2f}"
        same = "—" if name == "target_only" else f"{s['identical_prompts']}/{s['prompts']}"
        lines.append(f"| {LABELS[name]} | {s['seconds']:.2f} | {s['tokens_per_s']:.1f} | {s['speedup']:.2f} | {mal} "
                     f"| {same} |")
    lines += ["", "Speedup = tok/s ÷ target-only tok/s, same process and prompts, warm-up first, order rotated per "
              "prompt. Mean accepted length = new tokens ÷ target calls. Identical = the same tokens as target-only "
              "greedy generate(), prompt for prompt.", ""]
    return "\n".join(lines)


def run(cfg: DictConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    pair = load_pair(cfg.pair)
    prompts = load_prompts(cfg.dataset, cfg.split, cfg.limit)
    m = int(cfg.max_new_tokens)
    ids = tokenize_prompts(pair, prompts, m)
    eos = pair.eos_ids
    methods = build(pair, cfg)
    if cfg.warmup:  # first calls allocate caches and pick kernels; keep them out of the timings
        for method in methods.values():
            method.generate(ids[0], m, eos=eos)
        methods = build(pair, cfg)
    summary = summarize(timed_rows(methods, prompts, ids, m, eos))
    write(cfg, pair, summary, methods["ours"], len(prompts))


def write(cfg: DictConfig, pair, summary: dict, ours: Ours, n_prompts: int) -> None:
    about = {"command": command("hf_generate"), "prompts": n_prompts, "dataset": str(cfg.dataset.name),
             "split": cfg.split, "max_new_tokens": int(cfg.max_new_tokens), "machine": machine(),
             "dtype": str(pair.dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
             "torch": torch.__version__, "transformers": transformers.__version__,
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "ckpt": str(cfg.ckpt),
             "rule": ours.hook.policy.describe().get("rule", ours.hook.policy.name),
             "dynamic": OmegaConf.to_container(cfg.dynamic, resolve=True)}
    bar = {"prompts": n_prompts,
           "identical": summary["ours"]["identical_prompts"] == n_prompts,
           "ours_s": summary["ours"]["seconds"],
           "transformers_dynamic_s": summary["transformers_dynamic"]["seconds"],
           "target_only_s": summary["target_only"]["seconds"],
           "machine": about["machine"], "dtype": about["dtype"], "date": about["date"],
           "config": {**{k: v for k, v in about.items() if k not in ("machine", "dtype", "date")},
                      "pair": pair.pair_id, "policy": ours.hook.policy.describe()},
           "methods": summary}
    write_result(cfg.out_dir, "bar", bar, markdown(summary, about).rstrip("\n").split("\n"), md_stem="summary")


if __name__ == "__main__":
    hydra_entry("bench/hf_generate")(run)()
