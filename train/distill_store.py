"""The responses corpus on disk (train.distill_data's folders): shard tables, the committed token ids, and the
items train.distill trains on. Apart from the job so the job reads as its phases; the layout is data_gen.store's.

A shard holds per response: prompt_id, source, temperature, ids (prompt + response), start (the response's first
index) and the teacher's top-k before each response token (topk_vals float16 / topk_idx int32, flattened). Its ids
alone (`SEQ_COLUMNS`) are exported to `seq_dir` as zstd parquet, small enough to commit and enough to rebuild it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import torch

from data_gen import store
from utils.cli import UserError

SEQ_COLUMNS = ("prompt_id", "source", "temperature", "ids", "start")


def topk_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k of softmax(logits) as the corpora store them: float16 probabilities, int32 token ids."""
    probs = torch.softmax(logits.float(), dim=-1)
    vals, idx = probs.topk(min(k, probs.shape[-1]), dim=-1)
    return vals.to(torch.float16), idx.to(torch.int32)


def _table(rows: list[dict]):
    import pyarrow as pa

    return pa.table({
        "prompt_id": pa.array([r["prompt_id"] for r in rows], pa.string()),
        "source": pa.array([r["source"] for r in rows], pa.string()),
        "temperature": pa.array([float(r["temperature"]) for r in rows], pa.float32()),
        "ids": pa.array([np.asarray(r["ids"], np.int32) for r in rows], pa.list_(pa.int32())),
        "start": pa.array([int(r["start"]) for r in rows], pa.int32()),
        "topk_vals": pa.array([r["vals"].numpy().reshape(-1) for r in rows], pa.list_(pa.float16())),
        "topk_idx": pa.array([r["idx"].numpy().reshape(-1) for r in rows], pa.list_(pa.int32())),
    })


def write_shard(folder: Path, index: int, rows: list[dict], extra: dict) -> dict:
    """One responses shard, atomically, with checksums: data_gen's shard layout (store.save_table_shard)."""
    return store.save_table_shard(folder, index, _table(rows), {
        "positions": int(sum(len(r["ids"]) - int(r["start"]) for r in rows)),
        "prompt_ids": sorted({r["prompt_id"] for r in rows}), **extra})


def export_seqs(seq_dir: Path, index: int, rows: list[dict], chash: str) -> None:
    """The shard's token ids (no top-k) as zstd parquet: small enough to commit, enough to rebuild the shard."""
    import pyarrow.parquet as pq

    t = _table(rows).select(list(SEQ_COLUMNS)).replace_schema_metadata({"config_hash": chash})
    seq_dir.mkdir(parents=True, exist_ok=True)
    path = seq_dir / f"{store.shard_name(index)}.parquet"
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    pq.write_table(t, tmp, compression="zstd")
    os.replace(tmp, path)


def read_seqs(seq_dir: Path, index: int, chash: str) -> list[dict] | None:
    import pyarrow.parquet as pq

    path = seq_dir / f"{store.shard_name(index)}.parquet"
    if not path.is_file():
        return None
    t = pq.read_table(path)
    made = (t.schema.metadata or {}).get(b"config_hash", b"").decode()
    if made != chash:
        raise UserError(f"{path} was made with config hash {made}, this run's is {chash}; move {seq_dir} aside or "
                        "restore the settings it was made with")
    return t.to_pylist()


def load_items(folder: Path | str, max_shards: int | None = None) -> tuple[list[dict], dict]:
    """(training items {ids, start, vals, idx, source}, manifest) from the shards present in a responses folder —
    the in-memory form train.distill trains on (a partial folder is usable: training can start while data grows).
    `max_shards`: only the first N shards of the plan, all of which must be finished (runs that must see the same
    data, e.g. an ablation, while the folder grows)."""
    from datasets import load_from_disk

    folder = Path(folder)
    manifest = store.read_manifest(folder)
    if manifest is None:
        raise UserError(f"no distillation data at {folder} (no manifest.json); run python -m train.distill_data first")
    k = int(manifest["topk"])
    items = []
    shards = sorted(store.existing_shards(folder, full=False))
    if max_shards is not None:
        if [i for i in shards if i < int(max_shards)] != list(range(int(max_shards))):
            raise UserError(f"{folder} has {len(shards)} finished shards, not the first {max_shards}; run python -m "
                            "train.distill_data until it has, or lower data.max_shards")
        shards = shards[: int(max_shards)]
    for index in shards:
        ds = load_from_disk(str(folder / store.shard_name(index))).with_format("numpy")
        for row in ds:
            n = len(row["ids"]) - int(row["start"])
            items.append({"ids": torch.as_tensor(row["ids"], dtype=torch.int32), "start": int(row["start"]),
                          "vals": torch.as_tensor(row["topk_vals"]).view(n, k),
                          "idx": torch.as_tensor(row["topk_idx"]).view(n, k), "source": str(row["source"])})
    if not items:
        raise UserError(f"{folder} has no finished shard yet; run python -m train.distill_data to make some")
    return items, manifest
