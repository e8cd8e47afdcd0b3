"""`python -m train.distill pair=NAME`: distil a cheap draft (a shallow student) from the pair's target.

Why: speculative decoding only pays when the draft is both cheap (cost ratio c = draft step / target step small) and
close to the target (acceptance high). A slice of the target's first layers is cheap but far (Σmin(p,q) ≈ 0.06 on
SmolLM2); a little token-level KL training on what the target itself writes (DistillSpec's on-policy data) closes
much of the gap.

Recipe, top to bottom:
1. data: the target's own continuations of train-split prompts of the domains we decode, generated batched with a KV
   cache, plus raw WikiText-2 train text. The teacher's top-k probabilities (+ the rest mass) are stored per position
   at generation time, so training never runs the 30-layer teacher again. Cached on disk; a rerun skips it.
2. student: `layer_subset(target, layers, share=False)`: copies of the chosen layers (+ optionally the final norm),
   trainable in fp32; embeddings and LM head shared with the target and frozen.
3. loss: KL(p_target || q_student) from the top-k teacher (cross-entropy over the k kept tokens + the rest mass), on
   continuation positions only (the LM head runs only there). AdamW, warmup + cosine, gradient clipping, bf16 autocast.
4. a held-out check (validation splits) every `val_every` steps writes snapshot student files; the best one is the
   output. A before/after table reports held-out Σmin(p,q), greedy agreement, the measured cost ratio c and the
   predicted speedup (Leviathan et al.'s improvement factor at the best constant draft length).

The output file holds only the student's own tensors and JSON metadata (`models.student.STUDENT_META`): load it with
`models.student.load_student(target, path)` or a pair config `draft: {source: student, weights: PATH}`. The loss, the
batches and the Lightning module and callback live in train/distill_module.py.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from eval.theory import best_gamma
from models.lm import cache_kw
from models.pair import Pair, eos_ids, load_pair
from models.sources import cache_root
from models.student import decoder_parts, layer_subset, load_student, write_student_file
from utils.cli import UserError, check_name, hydra_entry
from utils.files import atomic_write

log = logging.getLogger(__name__)
CODE_VERSION = "distill-1"


# ------------------------------------------------------------------------------------------------------- the student


def make_student(target, layers: list[int], own_norm: bool = True):
    """Trainable copies of the target's `layers` (+ final norm) in fp32; embeddings and LM head shared and frozen."""
    student = layer_subset(target, list(layers), share=False)
    inner = decoder_parts(student)
    if own_norm:
        inner.norm = copy.deepcopy(decoder_parts(target).norm)
    for p in student.parameters():
        p.requires_grad_(False)
    for module in own_modules(student, own_norm):
        module.float()
        for p in module.parameters():
            p.requires_grad_(True)
    return student.train()


def own_modules(student, own_norm: bool) -> list[torch.nn.Module]:
    inner = decoder_parts(student)
    return list(inner.layers) + ([inner.norm] if own_norm else [])


def student_state(student, own_norm: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors that differ from the target: the student's layers (and norm), nothing shared."""
    keep = lambda k: k.startswith("model.layers.") or (own_norm and k.startswith("model.norm."))  # noqa: E731
    return {k: v.detach().to(dtype).contiguous().clone() for k, v in student.state_dict().items() if keep(k)}


def save_student(student, path: Path, info: dict, dtype: torch.dtype) -> Path:
    """Write the student file atomically (safetensors + JSON metadata that `load_student` reads)."""
    return write_student_file(Path(path), student_state(student, "norm" in info.get("own_modules", []), dtype), info)


# --------------------------------------------------------------------------------------------------------- the data


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)
    vals, idx = probs.topk(min(k, probs.shape[-1]), dim=-1)
    return vals.to(torch.float16), idx.to(torch.int32)


def generate_continuations(pair: Pair, texts: list[str], max_new_tokens: int, batch_size: int, temperature: float,
                           topk: int, max_len: int, seed: int, desc: str) -> list[dict]:
    """The target's continuations of `texts` (batched, KV cache) with its top-k probabilities at every new token
    (train.distill_data.generate, the one batched generator).

    Returns items {ids: prompt+continuation (int32), start: prompt length, vals, idx: (n_new, k), index}; a continuation
    ends after the first EOS. Prompts longer than max_len - max_new_tokens are skipped, not cut (a cut chat prompt
    is not what decoding sees).
    """
    from train.distill_data import generate

    tok = pair.tokenizer
    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    order = sorted((i for i, e in enumerate(enc) if 0 < len(e) <= max_len - max_new_tokens), key=lambda i: len(enc[i]))
    out = []
    for b in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch"):
        idx = order[b : b + batch_size]
        for i, o in zip(idx, generate(pair, [enc[i] for i in idx], temperature, max_new_tokens, topk, seed + b)):
            if o["cont"]:  # `index`: the text's position in `texts` (items come in length order)
                out.append({"ids": torch.tensor(enc[i] + o["cont"], dtype=torch.int32), "start": len(enc[i]),
                            "vals": o["vals"], "idx": o["idx"], "index": i})
    return out


@torch.inference_mode()
def teacher_text(pair: Pair, texts: list[str], topk: int, chunk_tokens: int, desc: str) -> list[dict]:
    """Raw text chunks scored by the target (teacher-forced), top-k at every position after the first."""
    out = []
    for text in tqdm(texts, desc=desc, unit="chunk"):
        ids = pair.tokenizer(text, add_special_tokens=False)["input_ids"][:chunk_tokens]
        if len(ids) < 2:
            continue
        x = torch.tensor([ids], device=pair.device)
        logits = pair.target(x).logits[0, :-1, : pair.vocab_size]
        vals, idx = _topk(logits.cpu(), topk)
        out.append({"ids": torch.tensor(ids, dtype=torch.int32), "start": 1, "vals": vals, "idx": idx})
    return out


def dataset_prompts(pair: Pair, dataset: str, split: str, limit, chat: bool | None = None, splits: str | None = None,
                    **overrides):
    """(prompts, rendered texts) of a dataset split; a test split is refused (distillation data never sees one).
    `splits` picks another split scheme of the dataset (MBPP, Spec-Bench), e.g. the one a recipe was written with;
    `overrides` set other keys of its conf/dataset file (e.g. WikiText-2's chunks_per_article)."""
    from data_gen.prompts import load_prompts, render

    if split == "test":
        raise UserError(f"distillation data must not use a test split (dataset {dataset}); "
                        "use train, validation or distill")
    dcfg = OmegaConf.load(check_name("dataset", dataset))
    if splits is not None:
        dcfg.splits = splits
    for k, v in overrides.items():
        if k not in dcfg:
            raise UserError(f"dataset {dataset} has no setting {k!r} (conf/dataset/{dataset}.yaml)")
        dcfg[k] = v
    prompts = load_prompts(dcfg, split, None if limit is None else int(limit))
    use_chat = pair.chat_template if chat is None else chat
    return prompts, [render(p, pair.tokenizer, use_chat) for p in prompts]


def cached(path: Path, make) -> list[dict]:
    """Load a cached list of items, or make and store it atomically."""
    if path.is_file():
        return torch.load(path, weights_only=True)
    items = make()
    atomic_write(path, lambda tmp: torch.save(items, tmp))
    return items


def cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def build_data(pair: Pair, cfg: DictConfig) -> tuple[list[dict], list[dict], list[dict], Path]:
    """(train items, held-out continuations, held-out text) — from the cache when present."""
    d = cfg.data
    root = Path(os.path.expanduser(str(d.cache_dir))) if d.get("cache_dir") else cache_root(pair.cfg) / "distill"
    root = root / pair.pair_id
    base = (pair.pair_id, pair.tokenizer_hash, CODE_VERSION)
    train, topk = [], int(d.topk)
    # python -m train.distill_data's folder(s): the finished shards (a folder may still be growing); a list adds
    # top-up sets (e.g. more sampled answers to chat prompts, made with another out_root) to the main one
    from train.distill_data import load_items

    folders = d.get("responses") or []
    folders = [folders] if isinstance(folders, str) else list(folders)
    caps = d.get("max_shards")  # one number pins the first folder; a list pins each folder (null: all its shards)
    caps = list(caps) if OmegaConf.is_list(caps) or isinstance(caps, list) else [caps]
    if len(caps) > max(1, len(folders)):
        raise UserError(f"data.max_shards lists {len(caps)} caps for {len(folders)} data.responses folder(s)")
    for j, folder in enumerate(folders):
        items, made = load_items(Path(os.path.expanduser(str(folder))), caps[j] if j < len(caps) else None)
        if made.get("tokenizer_hash") != pair.tokenizer_hash:
            raise UserError(f"data.responses={folder} was made with another tokenizer than pair {pair.name}'s")
        if j and int(made["topk"]) != topk:
            raise UserError(f"data.responses: {folder} keeps top-{made['topk']}, the first folder top-{topk}; a batch "
                            "holds one top-k width, so remake one of them with the other's topk")
        train, topk = train + items, int(made["topk"])  # the text below must match it
    for src in ([] if d.get("responses") else d.sources):
        key = cache_key(base, OmegaConf.to_container(src), d.max_new_tokens, d.temperature, d.topk, d.max_len, cfg.seed)
        _, texts = dataset_prompts(pair, src.dataset, src.split, src.get("limit"), splits=src.get("splits"))
        train += cached(root / f"gen-{src.dataset}-{src.split}-{key}.pt", lambda: generate_continuations(
            pair, texts, int(d.max_new_tokens), int(d.gen_batch_size), float(d.temperature), int(d.topk),
            int(d.max_len), int(cfg.seed), f"target continuations {src.dataset}/{src.split}"))
    if d.get("text") and (d.text.chunks is None or int(d.text.chunks) > 0):
        t = d.text
        more = {} if t.get("chunks_per_article") is None else {"chunks_per_article": int(t.chunks_per_article)}
        prompts, _ = dataset_prompts(pair, t.dataset, t.split, None if t.chunks is None else int(t.chunks), **more)
        texts = [f"{p.text} {p.reference}" for p in prompts]
        key = cache_key(base, OmegaConf.to_container(t), topk)
        text = cached(root / f"text-{t.dataset}-{t.split}-{key}.pt",
                      lambda: teacher_text(pair, texts, topk, int(t.chunk_tokens), "teacher on text"))
        train += [{**it, "source": f"text_{t.dataset}"} for it in text]  # data.source_weights={text_wikitext2: w}
    heldout = []
    for src in d.heldout:
        key = cache_key(base, OmegaConf.to_container(src), 64, d.max_len)
        _, texts = dataset_prompts(pair, src.dataset, src.split, src.get("limit"), splits=src.get("splits"))
        heldout += cached(root / f"heldout-{src.dataset}-{src.split}-{key}.pt", lambda: generate_continuations(
            pair, texts, 64, int(d.gen_batch_size), 0.0, 1, int(d.max_len), int(cfg.seed), "held-out continuations"))
    prompts, _ = dataset_prompts(pair, "wikitext2", "validation", int(d.heldout_text_chunks))
    heldout_text = [{"ids": torch.tensor(pair.tokenizer(f"{p.text} {p.reference}", add_special_tokens=False)
                                         ["input_ids"][:256], dtype=torch.int32), "start": 1} for p in prompts]
    if not train:
        raise UserError("distillation data is empty; check data.sources (limits, max_len vs prompt lengths)")
    return train, heldout, heldout_text, root


def weighted(items: list[dict], weights, seed: int) -> list[dict]:
    """The training items with each source's share changed: an item whose `source` starts with a key of `weights`
    (the longest such key) appears `w` times — a fractional part is one more copy for that share of the source's
    items, drawn with `seed`; w = 0 drops the source. Items of no listed source keep weight 1 (raw text is source
    `text_<dataset>`).
    Why: the responses are 40% code, while Spec-Bench is chat; re-weighting shifts what the student spends its few
    layers on without generating new data."""
    if not weights:
        return items

    def number(v) -> float:
        try:
            return float(v)
        except (TypeError, ValueError):
            return float("nan")

    table = {str(k): number(v) for k, v in dict(weights).items()}
    bad = [k for k, v in table.items() if not (v >= 0 and math.isfinite(v))]  # nan, negative, inf
    if bad:
        raise UserError(f"data.source_weights: {', '.join(bad)} must be a number >= 0 (1 keeps a source as it is)")
    rng, out = random.Random(seed), []
    for it in items:
        src = str(it.get("source", ""))
        keys = [k for k in table if src.startswith(k)]
        w = table[max(keys, key=len)] if keys else 1.0
        out += [it if j == 0 else {**it, "round": j} for j in range(int(w) + (rng.random() < w - int(w)))]
    if not out:
        raise UserError("data.source_weights drops every training item; give some source a weight > 0")
    return out


# ------------------------------------------------------------------------------------------------------ measurement


@torch.inference_mode()
def acceptance(draft, target, items: list[dict], vocab: int, device, teacher_cache: dict | None = None) -> dict:
    """Teacher-forced agreement of draft q and target p on positions item["start"]: of each sequence.

    Returns token-weighted means of Σmin(p,q) (the per-token acceptance rate of exact sampling verification) and of
    1[argmax q = argmax p] (greedy verification), plus the per-sequence Σmin means. `teacher_cache` (dict) keeps the
    target's probabilities between calls, so repeated checks during training do not rerun the target.
    """
    sums, agrees, per_seq, n = 0.0, 0.0, [], 0
    for i, it in enumerate(items):
        ids = it["ids"].long().unsqueeze(0).to(device)
        s = int(it["start"])
        if teacher_cache is not None and i in teacher_cache:
            p = teacher_cache[i].float()
        else:
            p = torch.softmax(target(ids).logits[0, s - 1 : -1, :vocab].float(), -1)
            if teacher_cache is not None:
                teacher_cache[i] = p.to(torch.bfloat16)
        q = torch.softmax(draft(ids).logits[0, s - 1 : -1, :vocab].float(), -1)
        m = torch.minimum(p, q).sum(-1)
        sums += m.sum().item()
        agrees += (p.argmax(-1) == q.argmax(-1)).float().sum().item()
        per_seq.append(m.mean().item())
        n += m.numel()
    return {"sum_min": sums / max(n, 1), "greedy_agree": agrees / max(n, 1), "tokens": n, "per_seq_sum_min": per_seq}


@torch.inference_mode()
def step_time(model, ids: torch.Tensor, steps: int) -> float:
    """Median seconds of one batch-1 decode step with a KV cache after prefilling `ids`."""
    out = model(ids, use_cache=True)
    cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(nxt, **cache_kw(model, cache), use_cache=True)
        times.append(time.perf_counter() - t0)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times.sort()
    return times[len(times) // 2]


def measure_cost_ratio(draft, target, ids: torch.Tensor, steps: int = 32, repeats: int = 5) -> dict:
    """The cost ratio c = draft decode step / target decode step (key `c`), both medians over interleaved repeats
    (robust to a busy CPU)."""
    step_time(draft, ids, 4), step_time(target, ids, 4)  # warm-up
    d, t = [], []
    for _ in range(repeats):
        d.append(step_time(draft, ids, steps))
        t.append(step_time(target, ids, steps))
    d, t = sorted(d)[repeats // 2], sorted(t)[repeats // 2]
    return {"c": d / t, "draft_step_ms": 1e3 * d, "target_step_ms": 1e3 * t}


def leviathan_speedup(alpha: float, cost_ratio: float, max_gamma: int = 32) -> dict:
    """Leviathan et al. (2023) Thm 3.8 via eval.theory: the best constant γ ≥ 1 and its speedup; γ = 0 (speedup 1)
    when no γ beats target-only decoding."""
    gamma, factor = best_gamma(alpha, cost_ratio, max_gamma)
    return {"speedup": factor, "gamma": gamma} if factor > 1.0 else {"speedup": 1.0, "gamma": 0}


def describe(draft, target, pair: Pair, heldout, heldout_text, cost_ids, measure_cost: bool, cache=None) -> dict:
    cont = acceptance(draft, target, heldout, pair.vocab_size, pair.device,
                      None if cache is None else cache.setdefault("cont", {}))
    text = acceptance(draft, target, heldout_text, pair.vocab_size, pair.device,
                      None if cache is None else cache.setdefault("text", {}))
    row = {"heldout_sum_min": cont["sum_min"], "heldout_greedy_agree": cont["greedy_agree"],
           "heldout_text_sum_min": text["sum_min"], "heldout_tokens": cont["tokens"]}
    if measure_cost:
        row.update(measure_cost_ratio(draft, target, cost_ids))
        row["speedup_sampling"] = leviathan_speedup(row["heldout_sum_min"], row["c"])
        row["speedup_greedy"] = leviathan_speedup(row["heldout_greedy_agree"], row["c"])
    return row


def print_table(rows: dict[str, dict]) -> None:
    cols = [("heldout_sum_min", "Σmin(p,q) cont."), ("heldout_greedy_agree", "greedy agree"),
            ("heldout_text_sum_min", "Σmin(p,q) text"), ("c", "cost ratio c")]
    head = f"{'':>10} " + " ".join(f"{name:>16}" for _, name in cols) + f" {'speedup (γ) greedy/sampling':>30}"
    print(head)
    for label, r in rows.items():
        vals = " ".join(f"{r[k]:16.3f}" if k in r else f"{'-':>16}" for k, _ in cols)
        sp = (f"{r['speedup_greedy']['speedup']:.2f} ({r['speedup_greedy']['gamma']}) / "
              f"{r['speedup_sampling']['speedup']:.2f} ({r['speedup_sampling']['gamma']})") if "c" in r else "-"
        print(f"{label:>10} {vals} {sp:>30}")
    sys.stdout.flush()


def _run_dir() -> Path:
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # called outside Hydra (tests)
        import tempfile

        return Path(tempfile.mkdtemp(prefix="distill-"))


def _frozen_target(cfg: DictConfig, layers: list[int]) -> Pair:
    """The pair with its target frozen and a throwaway draft (never needs the shipped student file); refuses
    `student.layers` that are not the target's."""
    pcfg = copy.deepcopy(cfg.pair)
    pcfg.draft = OmegaConf.create({"source": "layer_subset", "layers": [0]})
    pair = load_pair(pcfg)
    for p in pair.target.parameters():
        p.requires_grad_(False)
    n_layers = len(decoder_parts(pair.target).layers)
    if not layers or any(not 0 <= i < n_layers for i in layers):
        raise UserError(f"student.layers={layers} must be indices of the target's {n_layers} layers, e.g. [0,1,2,3]")
    return pair


def _fit(cfg: DictConfig, pair: Pair, student, train: list[dict], run_dir: Path, evaluate, save, subset):
    """Lightning fits the student on the cached teacher top-k, checkpointing every `train.ckpt_minutes` and resuming
    from `run_dir/checkpoints/last.ckpt`; returns (trainer, snapshot callback, batches per epoch)."""
    from datetime import timedelta

    from lightning import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from train.distill_module import DistillModule, LengthBatches, Snapshots, collate

    tcfg = cfg.train
    loader = torch.utils.data.DataLoader(
        train, batch_sampler=LengthBatches([len(it["ids"]) for it in train], int(tcfg.batch_size), int(cfg.seed),
                                    [int(it.get("round", 0)) for it in train]),
        collate_fn=lambda b: collate(b, pair.tokenizer.pad_token_id))
    module = DistillModule(student, pair.vocab_size, tcfg, subset, teacher=pair)
    snaps = Snapshots(run_dir, int(tcfg.val_every), evaluate, save)
    ckpt = ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True, save_top_k=0,
                           train_time_interval=timedelta(minutes=float(tcfg.ckpt_minutes)))
    trainer = Trainer(
        accelerator="cuda" if pair.device.type == "cuda" else "cpu", devices=1, precision=train_precision(tcfg, pair),
        max_steps=int(tcfg.max_steps), max_time={"minutes": float(tcfg.max_minutes)} if tcfg.get("max_minutes") else None,
        gradient_clip_val=float(tcfg.grad_clip), callbacks=[snaps, ckpt], logger=CSVLogger(str(run_dir), name="csv"),
        log_every_n_steps=10, num_sanity_val_steps=0, use_distributed_sampler=False, enable_model_summary=False,
        default_root_dir=str(run_dir))
    last = run_dir / "checkpoints" / "last.ckpt"
    resume = last if last.is_file() and cfg.get("resume", True) else None
    if resume is not None:
        print(f"resuming from {resume}", flush=True)
    trainer.fit(module, loader, ckpt_path=str(resume) if resume else None)
    if trainer.global_step < int(tcfg.max_steps):  # stopped by the time budget: keep exactly where it stands
        trainer.save_checkpoint(str(last))
    return trainer, snaps, len(loader)


def train_precision(tcfg: DictConfig, pair: Pair) -> str:
    """`auto`: bf16 autocast where the pair runs in bf16 (CUDA, CPUs with native bf16), else float32 — emulated
    bf16 products are several times slower than float32 on CPUs without it."""
    p = str(tcfg.precision)
    return ("bf16-mixed" if pair.dtype == torch.bfloat16 else "32-true") if p == "auto" else p


def train_signature(cfg: DictConfig) -> dict:
    """What a resumed run must share with the run it continues (budget, threads and output paths may change)."""
    c = OmegaConf.to_container(cfg, resolve=True)
    t = {k: v for k, v in c["train"].items() if k not in ("max_minutes", "ckpt_minutes", "val_every")}
    return {"student": c["student"], "train": t, "data": c["data"], "seed": c["seed"], "target": c["pair"]["target"],
            "code_version": CODE_VERSION}


def _check_resume(cfg: DictConfig, run_dir: Path) -> None:
    """A run folder holds one training run: a rerun continues it only with the same recipe."""
    path = run_dir / "train_signature.json"
    sig = json.loads(json.dumps(train_signature(cfg), default=str))
    if path.is_file() and cfg.get("resume", True) and (run_dir / "checkpoints" / "last.ckpt").is_file():
        before = json.loads(path.read_text())
        if before != sig:
            diff = sorted(k for k in set(before) | set(sig) if before.get(k) != sig.get(k))
            raise UserError(f"{run_dir} holds a distillation run with another recipe (differs in: {', '.join(diff)}); "
                            "pass name=<new run> for a new run, or resume=false to start this one over")
    path.write_text(json.dumps(sig, indent=1))


def warm_start(student, target, scfg: DictConfig):
    """Start training from a student file (`student.init`, e.g. the shipped draft or an ablation's best) instead of
    the target's raw layers: a long run on new data need not relearn what a shorter one already did. The file must
    hold the same layers (and own norm); returns it loaded, for the `before` row."""
    start = load_student(target, str(scfg.init))
    info = start.student_info
    layers, own_norm = [int(i) for i in scfg.layers], bool(scfg.own_norm)
    if info["layers"] != layers or ("norm" in info.get("own_modules", [])) != own_norm:
        raise UserError(f"student.init={scfg.init} holds layers {info['layers']} (own norm: "
                        f"{'norm' in info.get('own_modules', [])}); set student.layers={info['layers']} and "
                        f"student.own_norm to match, or pick another file")
    student.load_state_dict(student_state(start, own_norm, torch.float32), strict=False)
    print(f"warm start from {scfg.init} (its step {info.get('step')}, {info.get('command', '')})", flush=True)
    return start


def student_subset(cfg: DictConfig, pair: Pair, target) -> torch.Tensor | None:
    """The FR-Spec ids the draft's head will score (`student.vocab_subset`, default: the pair's), or None."""
    n = cfg.student.get("vocab_subset")
    if not n:
        return None
    from models.lm_head import read_frequencies, subset_ids
    from models.pair import REPO_ROOT

    path = Path(str(cfg.student.vocab_freq))
    freq = read_frequencies(path if path.is_absolute() else REPO_ROOT / path)
    always = set(getattr(pair.tokenizer, "all_special_ids", []) or []) | eos_ids(target, pair.tokenizer)
    return subset_ids(freq, int(n), always, pair.vocab_size)


def distill(cfg: DictConfig) -> dict:
    """The whole job; returns the metrics written next to the student file."""
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(int(cfg.seed))
    layers = [int(i) for i in cfg.student.layers]
    pair = _frozen_target(cfg, layers)
    target = pair.target
    run_dir = _run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    _check_resume(cfg, run_dir)
    out = Path(cfg.out) if cfg.get("out") else run_dir / "student.safetensors"
    if out.suffix != ".safetensors":
        raise UserError(f"out={out} must end in .safetensors")

    t_data = time.time()
    train, heldout, heldout_text, cache = build_data(pair, cfg)
    train = weighted(train, cfg.data.get("source_weights"), int(cfg.seed))
    t_data = time.time() - t_data
    n_train_tokens = sum(len(it["ids"]) - int(it["start"]) for it in train)
    print(f"data: {len(train)} sequences, {n_train_tokens} trained positions (cache {cache}); "
          f"held-out {len(heldout)} continuations + {len(heldout_text)} text chunks", flush=True)
    if int(cfg.train.max_steps) <= 0:  # data-only run: fill the cache (e.g. on a big machine) and stop
        return {"train_sequences": len(train), "train_positions": n_train_tokens}
    cost_ids = heldout[0]["ids"][: int(heldout[0]["start"])].long().unsqueeze(0).to(pair.device)
    teacher_cache: dict = {}

    def evaluate(model, cost=False):
        return describe(model, target, pair, heldout, heldout_text, cost_ids, cost, teacher_cache)

    student = make_student(target, layers, bool(cfg.student.own_norm))
    start = warm_start(student, target, cfg.student) if cfg.student.get("init") else layer_subset(target, layers)
    subset = student_subset(cfg, pair, target)
    rows = {"before": evaluate(start, bool(cfg.measure_cost))}
    print_table(rows)
    info = {"layers": layers, "own_modules": ["norm"] if cfg.student.own_norm else [], "target": pair.pair_id,
            "tokenizer_hash": pair.tokenizer_hash, "code_version": CODE_VERSION,
            "vocab_subset": None if subset is None else int(cfg.student.vocab_subset),
            "command": "python -m " + " ".join(["train.distill"] + sys.argv[1:]),
            "recipe": OmegaConf.to_container(cfg, resolve=True)}

    def save(model, path, row):
        return save_student(model, path, {**info, "step": row.get("step"), "metrics": {
            k: v for k, v in row.items() if isinstance(v, (int, float))}}, pair.dtype)

    t_train = time.time()
    trainer, snaps, batches = _fit(cfg, pair, student, train, run_dir, evaluate, save, subset)
    t_train = time.time() - t_train
    if trainer.global_step < int(cfg.train.max_steps):
        print(f"stopped at step {trainer.global_step} of {cfg.train.max_steps} (train.max_minutes={cfg.train.max_minutes}); "
              f"checkpoint in {run_dir / 'checkpoints'}: rerun the same command to continue", flush=True)
        return {"steps": trainer.global_step, "complete": False, "run_dir": str(run_dir)}

    final = load_student(target, run_dir / "student-best.safetensors").to(pair.device)
    rows["after"] = evaluate(final, bool(cfg.measure_cost))
    print_table(rows)
    best_row = max(snaps.history, key=lambda r: r["heldout_sum_min"])
    metrics = {"before": rows["before"], "after": rows["after"], "best_step": best_row["step"],
               "steps": trainer.global_step, "train_minutes": t_train / 60, "data_minutes": t_data / 60,
               "train_sequences": len(train), "train_positions": n_train_tokens,
               "positions_seen": int(trainer.global_step * n_train_tokens / max(batches, 1)),
               "history": snaps.history}
    info.update(step=best_row["step"], steps_run=trainer.global_step, train_minutes=round(t_train / 60, 2),
                metrics={k: v for k, v in rows["after"].items() if isinstance(v, (int, float))})
    save_student(final, out, info, pair.dtype)
    with open(out.with_suffix(".json"), "w") as fh:
        json.dump({**metrics, "info": info}, fh, indent=1, default=str)
    print(f"student ({len(layers)} layers from {layers}, step {best_row['step']}) -> {out} "
          f"({out.stat().st_size / 2**20:.1f} MiB)")
    return metrics


@hydra_entry("distill")
def main(cfg: DictConfig) -> None:
    distill(cfg)


if __name__ == "__main__":
    main()
