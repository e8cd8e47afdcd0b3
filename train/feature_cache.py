"""The target's EAGLE-3 features cached beside a distillation corpus: written by `python -m train.distill_data
features.cache=true`, read by `python -m train.eagle data.features=cached`.

Why: on the fly, train.eagle runs the target over every batch of every epoch (and again on every rerun) to get the
draft's input features; at 1.5B on a CPU that pass is most of a training step. The corpus's sequences are fixed, so
one teacher-forced pass per sequence, stored, serves every epoch. The soft labels need no second pass: the corpus
already holds the teacher's top-k at every response position (train.batch_gen keeps it while generating).

Layout, beside shard `shard-NNNNN/` of a responses folder (under trace_root, never committed):
    shard-NNNNN.features.safetensors
        feats      (N, 3, H) in `features.dtype` (bf16 by default): models.eagle3.target_features at `layers`
        prompt_at  (rows,) int64: where row r's prompt positions (its first `start` tokens) begin in feats
        resp_at    (rows,) int64: where its response positions begin
        metadata   layers, dtype, config_hash, rows, positions, response_positions, seconds (the feature pass)
Prompt positions are stored too: the draft attends over the whole sequence, and the prompt's keys read the target's
features there, so a response position's loss depends on them. The answers to one prompt (one per temperature) share
their prompt's segment: a causal model's features of a prefix do not depend on what follows it.
A file is written to a hidden temp file and renamed into place (a killed run leaves no half file); a rerun computes
the files its shards lack. The folder's manifest records `features` (layers, dtype, hidden, bytes_per_position) and,
rebuilt at the end of every run from the shards, `feature_shards`: each shard's positions and seconds (generation
and feature pass apart), the throughput table's source.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from data_gen import store
from models.eagle3 import Eagle3Config, target_features
from train.distill_store import topk_probs
from utils.cli import UserError
from utils.files import atomic_write

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SUFFIX = ".features.safetensors"


# ------------------------------------------------------------------------------------------------------- the spec


def spec_of(fcfg, target) -> dict:
    """What the cache holds for this target: `features.layers` (null: EAGLE-3's, as models.eagle3 chooses them),
    the storage dtype, the hidden size and the bytes a position costs on disk."""
    dtype = str(fcfg.get("dtype", "bfloat16"))
    if dtype not in DTYPES:
        raise UserError(f"features.dtype must be one of {', '.join(DTYPES)}, got '{dtype}'")
    layers = fcfg.get("layers")
    ecfg = Eagle3Config.of_target(target, list(layers) if layers is not None else None)
    size = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    return {"layers": list(ecfg.layers), "dtype": dtype, "hidden": ecfg.hidden,
            "bytes_per_position": 3 * ecfg.hidden * size}


def adopt(folder: Path, manifest: dict, spec: dict) -> dict:
    """The manifest with the cache's spec: recorded when absent (a corpus that gains a cache), refused in one line
    when the folder's features were made at other layers or in another dtype."""
    have = manifest.get("features")
    if have is None:
        manifest = {**manifest, "features": spec}
        store.write_json_atomic(Path(folder) / store.MANIFEST, manifest)
        return manifest
    if (have["layers"], have["dtype"]) != (spec["layers"], spec["dtype"]):
        raise UserError(f"{folder} caches features at layers {have['layers']} in {have['dtype']}, this run asks for "
                        f"{spec['layers']} in {spec['dtype']}; rerun with features.layers={have['layers']} "
                        f"features.dtype={have['dtype']}, or pick another out_root")
    return manifest


def path_of(folder: Path, index: int) -> Path:
    return Path(folder) / f"{store.shard_name(index)}{SUFFIX}"


def has_features(folder: Path, index: int) -> bool:
    return path_of(folder, index).is_file()


# ----------------------------------------------------------------------------------------------------- writing


def _passes(rows: list[dict], batch_tokens: int) -> list[list[list[int]]]:
    """Rows grouped by prompt (the answers to one prompt together), groups packed into passes of at most
    `batch_tokens` padded tokens (one group at least), similar lengths together."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(tuple(r["ids"][: int(r["start"])]), []).append(i)
    order = sorted(groups.values(), key=lambda g: max(len(rows[i]["ids"]) for i in g))
    passes, cur, width, n = [], [], 0, 0
    for g in order:
        w = max(width, *(len(rows[i]["ids"]) for i in g))
        if cur and w * (n + len(g)) > batch_tokens:
            passes.append(cur)
            cur, w, n = [], max(len(rows[i]["ids"]) for i in g), 0
        cur.append(g)
        width, n = w, n + len(g)
    return passes + ([cur] if cur else [])


@torch.no_grad()
def _row_topk(target, last: torch.Tensor, start: int, end: int, k: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """The target's top-k before each response token of one row, from its final-norm output `last` (T, H): the
    distributions at positions start-1 .. end-2, as train.distill_data.teacher_topk computes them."""
    vals, idx = topk_probs(target.get_output_embeddings()(last[start - 1 : end - 1])[:, :vocab], k)
    return vals.cpu(), idx.cpu()


def shard_features(target, rows: list[dict], spec: dict, batch_tokens: int, pad_id: int,
                   topk: tuple[int, int] | None = None) -> tuple[dict[str, torch.Tensor], list]:
    """The feature file's tensors for a shard's rows ({ids, start}, in shard order): one teacher-forced pass per
    batch of rows (models.eagle3.target_features), each prompt's segment once, then each row's response. With
    `topk` = (k, vocab), the same pass also gives each row's teacher top-k (vals, idx), so a shard rebuilt from its
    ids costs one pass of the target, not two; else that list holds None."""
    dtype = DTYPES[spec["dtype"]]
    segs, at, prompt_at, resp_at = [], 0, [0] * len(rows), [0] * len(rows)
    tops: list = [None] * len(rows)
    for part in _passes(rows, batch_tokens):
        members = [i for g in part for i in g]
        width = max(len(rows[i]["ids"]) for i in members)
        x = torch.full((len(members), width), pad_id, dtype=torch.long)
        att = torch.zeros(len(members), width, dtype=torch.long)
        for b, i in enumerate(members):
            x[b, : len(rows[i]["ids"])] = torch.as_tensor(rows[i]["ids"], dtype=torch.long)
            att[b, : len(rows[i]["ids"])] = 1
        feats, last = target_features(target, x, att, spec["layers"], last=True)
        feats = feats.to(dtype).cpu()
        b = 0
        for g in part:
            start = int(rows[g[0]]["start"])
            segs.append(feats[b, :start])
            for i in g:
                prompt_at[i] = at
            at += start
            for i in g:
                segs.append(feats[b, start : len(rows[i]["ids"])])
                resp_at[i] = at
                at += len(rows[i]["ids"]) - start
                if topk is not None:
                    tops[i] = _row_topk(target, last[b], start, len(rows[i]["ids"]), *topk)
                b += 1
    return {"feats": torch.cat(segs).contiguous(), "prompt_at": torch.tensor(prompt_at, dtype=torch.int64),
            "resp_at": torch.tensor(resp_at, dtype=torch.int64)}, tops


def write_features(folder: Path, index: int, rows: list[dict], target, spec: dict, fcfg, pad_id: int,
                   config_hash: str) -> dict:
    """Compute and write one shard's feature file atomically; returns its metadata (positions and seconds)."""
    t0 = time.perf_counter()
    tensors, _ = shard_features(target, rows, spec, int(fcfg.batch_tokens), pad_id)
    return save_features(folder, index, rows, tensors, spec, config_hash, time.perf_counter() - t0)


def save_features(folder: Path, index: int, rows: list[dict], tensors: dict, spec: dict, config_hash: str,
                  seconds: float) -> dict:
    """Write one shard's feature tensors (shard_features) atomically; returns its metadata."""
    from safetensors.torch import save_file

    path = path_of(folder, index)
    for stale in Path(folder).glob(f".{path.name}.*.tmp"):  # a killed run's half file
        stale.unlink(missing_ok=True)
    meta = {"layers": json.dumps(spec["layers"]), "dtype": spec["dtype"], "config_hash": config_hash,
            "rows": str(len(rows)), "positions": str(int(tensors["feats"].shape[0])),
            "response_positions": str(sum(len(r["ids"]) - int(r["start"]) for r in rows)),
            "seconds": f"{seconds:.3f}"}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))
    return meta


def read_meta(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


def stored_rows(folder: Path, index: int) -> list[dict]:
    """A finished shard's rows ({ids, start}, in shard order): what a feature pass over an existing shard reads."""
    from datasets import load_from_disk

    ds = load_from_disk(str(Path(folder) / store.shard_name(index))).select_columns(["ids", "start"])
    return [{"ids": list(r["ids"]), "start": int(r["start"])} for r in ds]


def throughput(folder: Path, shards: dict[int, dict]) -> dict:
    """{shard name: response positions, stored feature positions, generation and feature seconds} of the shards
    present (None where a shard has no feature file yet, or predates the timings)."""
    out = {}
    for index in sorted(shards):
        path = path_of(folder, index)
        meta = read_meta(path) if path.is_file() else {}
        out[store.shard_name(index)] = {
            "positions": int(shards[index].get("positions", 0)), "gen_seconds": shards[index].get("gen_seconds"),
            "machine": shards[index].get("machine"), "threads": shards[index].get("threads"),
            "dtype": shards[index].get("dtype"),
            "feature_positions": int(meta["positions"]) if meta else None,
            "feature_seconds": float(meta["seconds"]) if meta else None}
    return out


# ----------------------------------------------------------------------------------------------------- reading


def check_cache(folder: Path, manifest: dict | None, target_cfg: dict) -> dict:
    """The cache's spec, after one-line refusals: no corpus there, no cache, or another target made it (the
    layers are checked against the draft once it is built: train.eagle.check_layers)."""
    if manifest is None:
        raise UserError(f"data.cache_dirs: no corpus at {folder} (no manifest.json); make it with python -m "
                        "train.distill_data features.cache=true")
    spec = manifest.get("features")
    if spec is None:
        raise UserError(f"data.cache_dirs: {folder} caches no features; add them with the python -m "
                        "train.distill_data command that made it plus features.cache=true")
    made_by = (manifest.get("config") or {}).get("pair", {}).get("target")
    if made_by != target_cfg:
        raise UserError(f"data.cache_dirs: {folder} was made by another target ({json.dumps(made_by)}) than this "
                        f"pair's; train with the pair that made it")
    return spec


def cached_rows(folder: Path, index: int, k: int) -> list[dict]:
    """One shard's rows with their teacher top-k ((n, k) float16 / int32) and feature offsets."""
    from safetensors import safe_open

    from datasets import load_from_disk

    path = path_of(folder, index)
    if not path.is_file():
        raise UserError(f"data.cache_dirs: {store.shard_name(index)} of {folder} has no feature file; rerun python -m "
                        "train.distill_data with features.cache=true to add it")
    with safe_open(str(path), "pt") as f:
        prompt_at, resp_at = f.get_tensor("prompt_at").tolist(), f.get_tensor("resp_at").tolist()
    ds = load_from_disk(str(Path(folder) / store.shard_name(index))).with_format("numpy")
    out = []
    for r, row in enumerate(ds):
        n = len(row["ids"]) - int(row["start"])
        out.append({"ids": row["ids"].tolist(), "start": int(row["start"]), "source": str(row["source"]),
                    "prompt_id": str(row["prompt_id"]), "vals": torch.as_tensor(row["topk_vals"]).view(n, k),
                    "idx": torch.as_tensor(row["topk_idx"]).view(n, k),
                    "feat": (str(path), int(prompt_at[r]), int(resp_at[r]))})
    return out


class Features:
    """Reads rows' features from the cache files (memory-mapped, one open handle per file)."""

    def __init__(self):
        self.files: dict[str, object] = {}

    def row(self, item: dict) -> torch.Tensor:
        """(len(ids), 3, H) float32 of an item (its ids possibly cut by data.max_len)."""
        from safetensors import safe_open

        path, p0, r0 = item["feat"]
        if path not in self.files:
            self.files[path] = safe_open(path, "pt")
        sl = self.files[path].get_slice("feats")
        start, n = int(item["start"]), len(item["ids"]) - int(item["start"])
        return torch.cat([sl[p0 : p0 + start], sl[r0 : r0 + n]]).float()


def collate_cached(items: list[dict], pad_id: int, features: Features, topk: int | None = None) -> dict:
    """train.eagle_module.collate's batch plus the cached features (B, T, 3, H) and the teacher's top-k (B, T, k)
    at the positions before each response token (position start − 1 + i predicts token start + i), zeros elsewhere."""
    from train.eagle_module import collate

    batch = collate(items, pad_id)
    B, T = batch["x"].shape
    first = features.row(items[0])
    k = int(items[0]["vals"].shape[-1]) if topk is None else int(topk)
    feats = first.new_zeros(B, T, *first.shape[1:])
    vals, idx = torch.zeros(B, T, k), torch.zeros(B, T, k, dtype=torch.long)
    for r, it in enumerate(items):
        f = first if r == 0 else features.row(it)
        feats[r, : len(f)] = f
        s, n = int(it["start"]), len(it["ids"]) - int(it["start"])
        skip = 1 if s == 0 else 0  # a response from the first token: nothing in the row predicts that token
        vals[r, s - 1 + skip : s - 1 + n] = it["vals"][skip:n, :k].float()
        idx[r, s - 1 + skip : s - 1 + n] = it["idx"][skip:n, :k].long()
    return {**batch, "feats": feats, "topk_vals": vals, "topk_idx": idx}

