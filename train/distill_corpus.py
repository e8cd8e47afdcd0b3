"""The distillation's data: the teacher's continuations of prompts and its top-k on raw text, cached by content
(`build_data`), and the per-source weighting of a mix (`weighted`)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from models.pair import Pair
from models.sources import cache_root
from train.distill_store import topk_probs
from utils.cli import UserError, check_name
from utils.files import atomic_write

CODE_VERSION = "distill-1"  # in the data cache key and the student file: a change here rebuilds the cache


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
        vals, idx = topk_probs(logits.cpu(), topk)
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
