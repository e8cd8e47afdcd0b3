"""Trace storage: one folder per (pair, dataset, trace kind, decoding settings, split), Arrow shards + a manifest.

Layout of a trace folder:
    manifest.json        config, config_hash, pair id, tokenizer hash, code version, the shard plan; after the last
                         shard also rows, stats and `complete: true`
    shard-00000/         one fixed group of `prompts_per_shard` prompts, written by `Dataset.save_to_disk` into a
                         hidden temp dir and renamed into place only when complete (so a SIGKILL never leaves a
                         half shard visible); `shard.json` inside records its rows, prompt ids and arrow checksums.

A rerun skips the shards that exist, so it ends with exactly the rows of an uninterrupted run. The config hash
decides whether an existing folder is reused; a different config is refused (`overwrite=true` starts over).

What train, eval and decode agree on about traces (the head splits, columns as arrays, which traces a checkpoint
was trained on, whether it can read a folder) lives beside it in data_gen.contract; this module only stores.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from data_gen.kinds import trace_kind
from data_gen.tree_format import TREE_COLUMNS
from utils.cli import UserError
from utils.files import sha256_file, write_text_atomic

FORMAT_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "manifest.json"
SHARD_META = "shard.json"
SCALARS = ("q_draft", "p_draft", "tvd", "draft_entropy", "target_entropy", "target_margin", "cross_entropy")


# ------------------------------------------------------------------------------------------------------ naming


def _fmt(x) -> str:
    return f"{float(x):g}"


def folder_name(cfg: DictConfig, split: str) -> str:
    """`<pair>--<dataset>--<kind>-t<T>-p<top_p>-n<max_new>-s<seed>[-h]--<split>[-pt<N>][-lim<N>]` (readable, no
    hash; -pt: the dataset's per_task_limit)."""
    t = cfg.trace
    dataset = str(cfg.dataset.name)
    if cfg.dataset.get("category") not in (None, "all") and dataset == str(cfg.dataset.get("loader")):
        dataset += f"-{cfg.dataset.category}"
    kind = trace_kind(t)
    decoding = (
        f"{t.kind}-t{_fmt(t.get('temperature', 0))}-p{_fmt(t.get('top_p', 1.0))}-n{int(t.max_new_tokens)}"
        f"-s{int(t.get('seed', 0))}{'-h' if kind.store_hidden(t) else ''}{kind.folder_suffix(t)}"
    )
    limit = cfg.get("limit")
    per_task = cfg.dataset.get("per_task_limit")
    tail = f"-pt{int(per_task)}" if per_task is not None else ""
    tail += f"-lim{int(limit)}" if limit is not None and int(limit) >= 0 else ""
    return f"{cfg.pair.name}--{dataset}--{decoding}--{split}{tail}"


def trace_folder(cfg: DictConfig, split: str) -> Path:
    """Where the traces for cfg.pair x cfg.dataset x cfg.trace x split live (whether or not they exist yet)."""
    root = cfg.get("trace_root") or "traces"
    return Path(os.path.expanduser(str(root))) / folder_name(cfg, split)


def hash_payload(cfg: DictConfig) -> dict:
    """Everything that decides the rows (not batch size, device or sharding, which never change them)."""
    pair = OmegaConf.to_container(cfg.pair, resolve=True)
    # linear: the manifest records what it resolved to (data_gen.run); forward: the decoder's model calls
    # (models.lm.LM), which trace generation's teacher-forced passes through transformers' forward never make
    for key in ("device", "cache_dir", "linear", "forward", "eagle3"):  # eagle3: an EAGLE-3 kind hashes its weights
        pair.pop(key, None)
    # the int8 draft's kernel switch (models.lm_head.Int8Linear) moves its many-row products by one bf16 rounding, as
    # `linear` does: a kernel choice, not a data set, so folders made before the option existed keep their hash
    (pair.get("draft") or {}).pop("int8_float_rows", None)
    from models.pair import draft_files

    files = draft_files(cfg.pair)
    if files:  # the draft's content, not only its path: a new student at the shipped path makes new traces
        pair["draft_files"] = files
    trace = OmegaConf.to_container(cfg.trace, resolve=True)
    trace.pop("_target_", None)  # the kind is recorded by name (`kind`): folders from before the key keep their hash
    files = trace_kind(cfg.trace).files(cfg.trace)
    if files:  # a kind's own draft (eagle_chain's weights), by content as the pair's
        trace["files"] = files
    return {
        "format": FORMAT_VERSION,
        **trace_kind(cfg.trace).hash_extra(),
        "pair": pair,
        "dataset": OmegaConf.to_container(cfg.dataset, resolve=True),
        "trace": trace,
        "limit": cfg.get("limit"),
        "prompts_per_shard": int(cfg.get("prompts_per_shard", 16)),
        "max_prompt_tokens": cfg.get("max_prompt_tokens"),
        "prompt_overflow": str(cfg.get("prompt_overflow", "truncate")),
    }


def prompts_hash(prompts) -> str:
    """The prompt set's content (ids and texts): the config hash names the data set, not the data files' bytes, so a
    folder records this too and is not reused once the files under data/ change."""
    blob = json.dumps([[p.prompt_id, p.text] for p in prompts], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def config_hash(cfg: DictConfig) -> str:
    blob = json.dumps(hash_payload(cfg), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """The git commit of this checkout (with `+dirty` when data_gen/ or models/ have local edits), else `unknown`."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "data_gen", "models"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ------------------------------------------------------------------------------------------------ atomic writes


def write_json_atomic(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=True, default=str))


def create_manifest(folder: Path, data: dict) -> dict:
    """Write the folder's first manifest unless another job got there first; returns the manifest now in place.

    Shard jobs that start at the same instant all try: the manifest is written to a temp file and hard-linked to
    its name, which succeeds for exactly one job (`link` fails when the name exists; no reader ever sees a partial
    file). The others get the winner's manifest back and check it like a resume would. Filesystems without hard
    links fall back to an `O_EXCL` create of a lock file beside it, with the same one-winner guarantee.
    """
    path = Path(folder) / MANIFEST
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    try:
        try:
            os.link(tmp, path)
            return data
        except FileExistsError:
            pass
        except OSError:  # no hard links here (some network/FUSE filesystems): one O_EXCL lock decides the winner
            try:
                os.close(os.open(path.with_name(f".{path.name}.lock"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                os.replace(tmp, path)
                return data
            except FileExistsError:
                pass
    finally:
        tmp.unlink(missing_ok=True)
    for _ in range(100):  # the winner's manifest: appears at once with link; within moments with the lock fallback
        found = read_manifest(folder)
        if found is not None:
            return found
        time.sleep(0.1)
    raise UserError(f"another job is creating {path} but it did not appear within 10 s; rerun the same command")


def read_manifest(folder: Path) -> dict | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        raise UserError(f"{path} is corrupt (not JSON); delete the folder {folder} or rerun with overwrite=true") from None


def check_writable(root: Path) -> None:
    """Refuse an unwritable trace root before any work, creating nothing: the nearest existing ancestor decides."""
    probe = Path(os.path.abspath(os.path.expanduser(str(root))))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"trace_root {root} is not writable ({probe} is not a writable directory); pass trace_root=<a writable dir>")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


# ------------------------------------------------------------------------------------------------------- shards


def _table(rows: list[dict], topk: int, hidden: int):
    """A pyarrow table of trace rows from per-continuation column dicts (see data_gen.traces.chain_batch)."""
    import pyarrow as pa

    def cat(name, dtype):
        parts = [np.asarray(r[name], dtype=dtype) for r in rows]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    def rep(name):
        return [r[name] for r in rows for _ in range(r["n"])]

    cols = {
        "prompt_id": pa.array(rep("prompt_id"), pa.string()),
        "split": pa.array(rep("split"), pa.string()),
        "kind": pa.array(rep("kind"), pa.string()),
        "position": pa.array(cat("position", np.int32)),
        "draft_token": pa.array(cat("draft_token", np.int32)),
        "target_token": pa.array(cat("target_token", np.int32)),
    }
    for name in SCALARS:
        if all(name in r for r in rows):  # target_margin: absent from rows built by older code/tests
            cols[name] = pa.array(cat(name, np.float32))
    for name in ("start", "step"):  # eagle_chain rows: the round's start position and the drafting step
        if rows and all(name in r for r in rows):
            cols[name] = pa.array(cat(name, np.int32))
    if rows and all("context_token" in r for r in rows):
        cols["context_token"] = pa.array(cat("context_token", np.int32))
        # the prompt's token ids on each continuation's first row only (empty lists elsewhere): copy features need it
        prompts = [list(r["prompt_tokens"]) if i == 0 else [] for r in rows for i in range(r["n"])]
        cols["prompt_tokens"] = pa.array(prompts, pa.list_(pa.int32()))
    topk_flat = np.concatenate([np.asarray(r["draft_topk"], np.float32).reshape(-1) for r in rows]) if rows else np.zeros(0, np.float32)
    cols["draft_topk"] = pa.FixedSizeListArray.from_arrays(pa.array(topk_flat), topk)
    if hidden:
        flat = np.concatenate([np.asarray(r["draft_hidden"], np.float16).reshape(-1) for r in rows])
        cols["draft_hidden"] = pa.FixedSizeListArray.from_arrays(pa.array(flat), hidden)
    return pa.table(cols)


def save_table_shard(folder: Path, index: int, table, meta: dict) -> dict:
    """Write an Arrow table as shard `index` atomically: save into a hidden temp dir, record the arrow files'
    checksums and `meta` in shard.json, then rename into place (a SIGKILL never leaves a half shard visible). The
    shard layout every sharded job shares (data_gen traces, train.distill_data responses)."""
    import datasets

    folder = Path(folder)
    tmp = folder / f".tmp-{shard_name(index)}-{uuid.uuid4().hex[:8]}"
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # our own bar is the one to watch
    try:
        datasets.Dataset(table).save_to_disk(str(tmp))
    finally:
        if bars:
            datasets.enable_progress_bars()
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(tmp.glob("*.arrow"))}
    meta = {"shard": index, "rows": table.num_rows, **meta, "files": files,
            "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json_atomic(tmp / SHARD_META, meta)
    os.rename(tmp, folder / shard_name(index))
    return meta


def _tree_table(rows: list[dict], topk: int):
    """A pyarrow table of `tree` trace rows (data_gen.traces.tree_rows: one row per candidate-tree node)."""
    import pyarrow as pa

    def rep(name):
        return [r[name] for r in rows for _ in range(r["n"])]

    cols = {"prompt_id": pa.array(rep("prompt_id"), pa.string()), "split": pa.array(rep("split"), pa.string()),
            "kind": pa.array(rep("kind"), pa.string())}
    for name in ("position", *TREE_COLUMNS):
        cols[name] = pa.array(np.concatenate([np.asarray(r[name]) for r in rows]) if rows else np.zeros(0, np.int32))
    flat = np.concatenate([np.asarray(r["draft_topk"], np.float32).reshape(-1) for r in rows]) if rows else np.zeros(0, np.float32)
    cols["draft_topk"] = pa.FixedSizeListArray.from_arrays(pa.array(flat), topk)
    return pa.table(cols)


def write_shard(folder: Path, index: int, rows: list[dict], topk: int, hidden: int, extra: dict) -> dict:
    """Write one trace shard atomically (save_table_shard), with summary sums so finalizing never re-reads it.
    A `tree` shard's sums: on-path nodes (as `sum_acceptance`: the manifest's rate is the on-path share of nodes) and
    on-path rank-1 depth-1 nodes (as `greedy_matches`)."""
    if rows and rows[0]["kind"] == "tree":
        table = _tree_table(rows, topk)
        on, depth, rank = (table.column(c).to_numpy() for c in ("on_path", "depth", "rank"))
        first = depth == 1
        return save_table_shard(folder, index, table, {
            "prompt_ids": [r["prompt_id"] for r in rows], "sum_acceptance": float(on.sum()),
            "kind_rows": {"tree": table.num_rows}, "greedy_matches": int((on & first & (rank == 1)).sum()), **extra})
    table = _table(rows, topk, hidden)
    return save_table_shard(folder, index, table, {
        "prompt_ids": [r["prompt_id"] for r in rows],
        "sum_acceptance": float((1.0 - table.column("tvd").to_numpy().astype(np.float64)).sum()),
        "kind_rows": {k: int(v) for k, v in zip(*np.unique(table.column("kind").to_numpy(zero_copy_only=False), return_counts=True))},
        "greedy_matches": int((table.column("draft_token").to_numpy() == table.column("target_token").to_numpy()).sum()),
        **extra,
    })


def remove_stale_tmp(folder: Path, index: int) -> None:
    """Temp dirs of a shard this process is about to (re)write are leftovers of a killed run: remove them."""
    for stale in Path(folder).glob(f".tmp-{shard_name(index)}-*"):
        shutil.rmtree(stale, ignore_errors=True)


def check_shard(path: Path, full: bool = True) -> dict:
    """The shard's meta, or a UserError naming the corrupt shard and the fix. `full` re-hashes the arrow files."""
    fix = f"delete {path} and rerun the same command to regenerate it (or overwrite=true to start the folder over)"
    meta_path = path / SHARD_META
    try:
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f"corrupt trace shard {path} (missing or unreadable {SHARD_META}); {fix}") from None
    for name, info in files.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != info["bytes"] or (full and sha256_file(f) != info["sha256"]):
            raise UserError(f"corrupt trace shard {path} ({name} is missing or differs from its checksum); {fix}")
    return meta


def existing_shards(folder: Path, full: bool = True) -> dict[int, dict]:
    """{shard index: meta} for every visible shard in the folder, each checked (corrupt → UserError)."""
    out = {}
    for path in sorted(Path(folder).glob("shard-*")):
        if path.is_dir():
            out[int(path.name.split("-")[1])] = check_shard(path, full=full)
    return out


def shard_stats(folder: Path, shards: dict[int, dict]) -> dict:
    """Rows and acceptance statistics over the given shards (from their metas; older shards are read back)."""
    from datasets import load_from_disk

    rows, acc, match, prompts = 0, 0.0, 0.0, 0
    for index in sorted(shards):
        meta = shards[index]
        if "sum_acceptance" in meta:
            rows += int(meta["rows"])
            acc += float(meta["sum_acceptance"])
            match += float(meta["greedy_matches"])
            prompts += len(meta.get("prompt_ids", []))
            continue
        ds = load_from_disk(str(Path(folder) / shard_name(index))).with_format("numpy", columns=["tvd", "draft_token", "target_token"])
        if ds.num_rows:
            cols = ds[:]
            acc += float((1.0 - cols["tvd"].astype(np.float64)).sum())
            match += float((cols["draft_token"] == cols["target_token"]).sum())
        rows += ds.num_rows
        prompts += len(shards[index].get("prompt_ids", []))
    return {
        "rows": rows,
        "prompts": prompts,
        "mean_acceptance": acc / rows if rows else float("nan"),
        "greedy_match_rate": match / rows if rows else float("nan"),
    }


def finalize(folder: Path, manifest: dict, shards: dict[int, dict]) -> dict:
    """Mark a folder complete (all planned shards present): add rows and stats to its manifest, atomically."""
    stats = shard_stats(folder, shards)
    manifest = dict(manifest, complete=True, **stats)
    manifest["shard_rows"] = {shard_name(i): shards[i]["rows"] for i in sorted(shards)}
    kinds: dict[str, int] = {}
    for meta in shards.values():
        for kind, n in (meta.get("kind_rows") or {}).items():
            kinds[kind] = kinds.get(kind, 0) + int(n)
    manifest["kind_rows"] = kinds  # interleaved: rows per context kind (prompts are split in equal shares)
    write_json_atomic(Path(folder) / MANIFEST, manifest)
    return manifest


def missing_shards(manifest: dict, shards: dict[int, dict]) -> list[int]:
    return [i for i in range(int(manifest["num_shards_planned"])) if i not in shards]


def verify(folder: Path) -> dict:
    """Check a (possibly multi-job) trace folder is complete and intact, then finalize its manifest (merge step)."""
    folder = Path(folder)
    manifest, shards = complete_shards(folder, full=True, no_manifest=f"no traces at {folder} (no {MANIFEST}); run python "
                                       "-m data_gen with the same settings first",
                                       fix="rerun the data_gen jobs (same command, all shard_id values) to finish them")
    return finalize(folder, manifest, shards)


def complete_shards(folder: Path, full: bool, no_manifest: str, fix: str) -> tuple[dict, dict[int, dict]]:
    """(manifest, shards) of a folder whose planned shards are all there; otherwise one line naming what is missing
    and `fix`."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise UserError(no_manifest)
    shards = existing_shards(folder, full=full)
    missing = missing_shards(manifest, shards)
    if missing:
        names = ", ".join(shard_name(i) for i in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise UserError(f"traces at {folder} are incomplete: {len(missing)} of {manifest['num_shards_planned']} shards "
                        f"missing ({names}); {fix}")
    return manifest, shards


def load_traces(folder: Path | str):
    """(datasets.Dataset of all rows in shard order, manifest) for a complete trace folder; UserError otherwise."""
    from datasets import concatenate_datasets, load_from_disk

    folder = Path(folder)
    manifest, shards = complete_shards(folder, full=False, no_manifest=f"no traces at {folder}; generate them with "
                                       "python -m data_gen (train/eval do it via the same settings)",
                                       fix="rerun python -m data_gen with the same settings to finish them")
    parts = []
    for index in sorted(shards):
        try:
            parts.append(load_from_disk(str(folder / shard_name(index))))
        except Exception as err:  # noqa: BLE001 — any read failure means a damaged shard
            raise UserError(
                f"corrupt trace shard {folder / shard_name(index)} ({type(err).__name__}); delete it and rerun python -m data_gen"
            ) from None
    ds = concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if not manifest.get("complete"):
        manifest = dict(manifest, complete=True, rows=ds.num_rows)
    return ds, manifest

