"""The trace contracts train, eval and decode share, apart from how traces are stored (data_gen.store).

A stage that reads traces needs to agree with data_gen on a few things that are not storage: which splits a head
trains, calibrates and is tested on, the per-split config (so it finds the folder data_gen wrote), trace columns as
arrays, which traces a head checkpoint was trained on, and whether a checkpoint can read a trace folder. They live
here, below the stages, so no stage imports another stage (or storage internals) for them. Label schemes, the other
half of the contract, are data_gen.labels; the features a head reads are models.features.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict

from data_gen.store import trace_folder
from utils.cli import UserError

HEAD_SPLITS = ("train", "validation", "test")  # the trace splits a head trains, calibrates and is tested on


def split_cfg(cfg: DictConfig, split: str) -> DictConfig:
    """The config data_gen sees for one split: `split_limits.<split>` (when set) replaces `limit`."""
    limit = (cfg.get("split_limits") or {}).get(split)
    if limit is None:
        return cfg
    out = cfg.copy()
    with open_dict(out):
        out.limit = int(limit)
    return out


def trace_columns(ds, names) -> dict[str, np.ndarray]:
    """Columns of a `datasets.Dataset` (or a dict) as numpy arrays; list columns become (N, k) arrays."""
    import pyarrow as pa

    if isinstance(ds, dict):
        return {n: np.asarray(ds[n]) for n in names if n in ds}
    if getattr(ds, "_indices", None) is not None:  # a selected/shuffled view: materialise it once
        ds = ds.flatten_indices()
    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    out = {}
    for name in names:
        if name not in ds.column_names:
            continue
        col = table.column(name).combine_chunks()
        t = col.type
        ragged = False
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            import pyarrow.compute as pc

            lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False) if len(col) else np.zeros(0)
            ragged = len(lengths) > 0 and lengths.min() != lengths.max()
        if ragged:  # variable length (prompt_tokens): one int64 array per row
            arr = np.empty(len(col), dtype=object)
            arr[:] = [np.asarray(v, dtype=np.int64) for v in col.to_pylist()]
            out[name] = arr
        elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            flat = col.flatten().to_numpy(zero_copy_only=False)
            out[name] = flat.reshape(len(col), -1) if len(col) else flat.reshape(0, 0)
        else:
            out[name] = col.to_numpy(zero_copy_only=False)
    return out


def training_config(ckpt: Path) -> DictConfig | None:
    """The training run's composed config (`<run dir>/.hydra/config.yaml`, the ckpt sits in <run dir>/checkpoints)."""
    for parent in list(ckpt.resolve().parents)[:3]:
        path = parent / ".hydra" / "config.yaml"
        if path.is_file():
            return OmegaConf.load(path)
    return None


def default_trace_folder(ckpt: Path, raw: dict, split: str, trace_root) -> Path:
    """The `split` traces the checkpoint was trained from: the checkpoint's own record, else its run's config."""
    recorded = (raw.get("specstop") or {}).get("traces") or {}
    if isinstance(recorded, dict) and recorded.get(split):
        return Path(recorded[split])
    tcfg = training_config(ckpt)
    if tcfg is None:
        raise UserError(
            f"cannot tell which traces {ckpt} was trained on (no .hydra/config.yaml in its run dir); pass traces=DIR"
        )
    explicit = (tcfg.get("trace_dirs") or {}).get(split)
    if explicit:
        return Path(str(explicit))
    scfg = split_cfg(tcfg, split)
    if trace_root:
        scfg = scfg.copy()
        with open_dict(scfg):
            scfg.trace_root = str(trace_root)
    return trace_folder(scfg, split)


def check_compatible(bundle, manifest: dict, folder: Path, names: list[str]) -> None:
    """Refuse traces from another pair, tokenizer or feature spec than the checkpoint's, in one line."""
    pid, tok = str(manifest.get("pair_id")), str(manifest.get("tokenizer_hash"))
    if pid != bundle.pair_id or tok != bundle.tokenizer_hash:
        raise UserError(
            f"checkpoint {bundle.path} was trained on pair {bundle.pair_id} (tokenizer {bundle.tokenizer_hash}) but the "
            f"traces {folder} come from pair {pid} (tokenizer {tok}); pass traces= made with pair={bundle.pair_id}"
        )
    spec = bundle.spec
    from models.features.spec import needed_columns

    # what the kind reads comes from its declared columns; top-k and hidden states get their own messages below
    lack = [c for c in needed_columns(spec) if c not in names and c not in ("draft_topk", "draft_hidden")]
    if lack:
        raise UserError(
            f"checkpoint {bundle.path} reads {spec.kind} features needing trace column(s) {lack} that the traces "
            f"{folder} lack (made before these features existed?); regenerate them with python -m data_gen ... overwrite=true"
        )
    if spec.reads_probs:
        have = int(manifest.get("topk", spec.k))
        if have < spec.k or "draft_topk" not in names:
            raise UserError(f"checkpoint {bundle.path} reads top-{spec.k} probabilities but the traces {folder} store top-{have}")
    if spec.reads_hidden:
        d = int(manifest.get("hidden_size", 0) or 0)
        if d != spec.d or "draft_hidden" not in names:
            what = "no hidden states" if d == 0 or "draft_hidden" not in names else f"hidden states of size {d}"
            raise UserError(
                f"checkpoint {bundle.path} reads draft hidden states of size {spec.d} but the traces {folder} have {what}; "
                "pass traces= made by the same pair with trace.store_hidden=true"
            )
