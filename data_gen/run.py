"""Make, resume or reuse the traces of one (pair, dataset, trace kind, decoding settings, split).

`generate(cfg, split, pair)` is what `python -m data_gen` runs and what `python -m train` / `python -m eval` call.
It reads top-level keys with defaults into `Settings` (`batch_size`, `limit`, `shard_id`, `num_shards`, `overwrite`,
`prompts_per_shard`, `max_prompt_tokens`, `prompt_overflow`) so a config lacking some still works.

Plan: prompts are rendered and tokenized, over-long ones truncated/skipped/refused (and counted aloud), then cut into
fixed groups of `prompts_per_shard` in prompt order; group g is shard g, written by job `g % num_shards`. Every check
that can fail on user input runs before anything is written.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig
from tqdm import tqdm

from data_gen import store
from data_gen.kinds import trace_kind
from data_gen.prompts import load_prompts, render
from utils.cli import UserError

if TYPE_CHECKING:  # the real import waits until the cheap checks have passed (torch-heavy)
    from data_gen.traces import Item

OVERFLOW = ("truncate", "skip", "error")


@dataclass(frozen=True)
class Settings:
    """The top-level generation settings, read once with their defaults (so a config lacking some still works)."""

    batch_size: int = 8
    limit: int | None = None
    shard_id: int = 0
    num_shards: int = 1
    overwrite: bool = False
    prompts_per_shard: int = 16
    max_prompt_tokens: int | None = None
    prompt_overflow: str = "truncate"
    progress: bool = True


def settings(cfg: DictConfig) -> Settings:
    """Top-level generation settings with their defaults (validated)."""
    s = Settings(
        batch_size=int(cfg.get("batch_size", 8) or 8),
        limit=cfg.get("limit"),
        shard_id=int(cfg.get("shard_id", 0) or 0),
        num_shards=int(cfg.get("num_shards", 1) or 1),
        overwrite=bool(cfg.get("overwrite", False)),
        prompts_per_shard=int(cfg.get("prompts_per_shard", 16) or 16),
        max_prompt_tokens=cfg.get("max_prompt_tokens"),
        prompt_overflow=str(cfg.get("prompt_overflow", "truncate")),
        progress=bool(cfg.get("progress", True)),
    )
    if s.batch_size < 1 or s.prompts_per_shard < 1:
        raise UserError("batch_size and prompts_per_shard must be >= 1")
    if s.overwrite and s.num_shards > 1:
        raise UserError("overwrite=true with num_shards > 1 would let shard jobs delete each other's work; "
                        "delete the old trace folder once, then launch the jobs without overwrite")
    if not 0 <= s.shard_id < s.num_shards:
        raise UserError(f"shard_id={s.shard_id} must be in [0, num_shards={s.num_shards})")
    if s.prompt_overflow not in OVERFLOW:
        raise UserError(f"prompt_overflow={s.prompt_overflow} is not one of: {', '.join(OVERFLOW)}")
    kind = trace_kind(cfg.trace)  # unknown kind → one line
    if int(cfg.trace.max_new_tokens) < 1:
        raise UserError("trace.max_new_tokens must be >= 1")
    kind.check(cfg.trace)
    return s


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def prepare_items(cfg: DictConfig, pair, prompts, s: Settings) -> tuple[list[Item], str | None]:
    """Token ids per prompt, the over-long ones handled per `prompt_overflow`; returns (items, a note to print)."""
    t = cfg.trace
    max_new = int(t.max_new_tokens)
    context = getattr(pair.target.config, "max_position_embeddings", None)
    budget = int(s.max_prompt_tokens) if s.max_prompt_tokens is not None else None
    if context is not None:
        fit = int(context) - max_new
        if fit < 1:
            raise UserError(f"trace.max_new_tokens={max_new} leaves no room for a prompt in the model context of {context}")
        budget = fit if budget is None else min(budget, fit)
    from data_gen.traces import Item  # torch-heavy imports only once the cheap checks have passed

    tok = pair.tokenizer
    special = not pair.chat_template
    items, long_ids, empty = [], [], 0
    for p in prompts:
        ids = _encode(tok, render(p, tok, pair.chat_template), special)
        if not ids:
            empty += 1
            continue
        if budget is not None and len(ids) > budget:
            long_ids.append(p.prompt_id)
            if s.prompt_overflow == "skip":
                continue
            ids = ids[-budget:]  # keep the end: the chat template's generation prompt and the task text next to it
        items.append(Item(p.prompt_id, p.split, "target_ar", ids, meta={"reference": p.reference}))
    note_parts = []
    if long_ids:
        if s.prompt_overflow == "error":
            raise UserError(
                f"{len(long_ids)} of {len(prompts)} prompts are longer than {budget} tokens (model context {context} "
                f"minus max_new_tokens {max_new}; first: {long_ids[0]}); set prompt_overflow=truncate or skip, "
                "or lower trace.max_new_tokens"
            )
        verb = "truncated to their last" if s.prompt_overflow == "truncate" else "skipped (longer than"
        note_parts.append(
            f"{len(long_ids)} of {len(prompts)} prompts {verb} {budget} tokens{')' if verb.startswith('skipped') else ''} "
            f"(prompt_overflow={s.prompt_overflow})"
        )
    if empty:
        note_parts.append(f"{empty} empty prompts skipped")
    if not items:
        raise UserError(f"no prompts left to trace ({'; '.join(note_parts) or 'empty prompt set'}); check dataset/split/limit")
    trace_kind(t).prepare(items, lambda text: _encode(tok, text, False), max_new)
    return items, "; ".join(note_parts) or None


def _summary_line(folder: Path, m: dict, kind, seconds: float | None = None, positions: int | None = None) -> str:
    rate = f", {positions / seconds:.1f} positions/s over {seconds:.1f}s" if seconds and positions else ""
    if kind.tree:  # rows are candidate-tree nodes; `positions` counts nodes here
        rate = f", {positions / seconds:.1f} nodes/s over {seconds:.1f}s" if seconds and positions else ""
        return (f"traces {folder}: {m.get('rows')} tree nodes from {m.get('prompts')} prompts; on-path share "
                f"{m.get('mean_acceptance', float('nan')):.4f}{rate}")
    kinds = m.get("kind_rows") or {}
    if len(kinds) > 1:
        rate += " (rows per kind: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) + ")"
    return (
        f"traces {folder}: {m.get('rows')} rows from {m.get('prompts')} prompts; mean acceptance Σmin(p,q) = 1−TVD "
        f"{m.get('mean_acceptance', float('nan')):.4f}, greedy match rate {m.get('greedy_match_rate', float('nan')):.4f}{rate}"
    )


def generate(cfg: DictConfig, split: str, pair=None) -> Path:
    """Make, resume or reuse the traces for cfg.pair x cfg.dataset x cfg.trace x split; returns the trace folder.

    Idempotent: a complete folder with the same config hash is reused as is; a partial one is resumed; a different
    config is refused unless `overwrite=true`. With `num_shards > 1` this job writes only its shards; the folder is
    finalized by whichever job finishes last (or by `verify=true`).
    """
    s = settings(cfg)
    prompts = load_prompts(cfg.dataset, split, s.limit)  # unknown split / empty set → UserError, nothing written
    folder = store.trace_folder(cfg, split)
    chash, phash = store.config_hash(cfg), store.prompts_hash(prompts)
    manifest = store.read_manifest(folder)
    kind = trace_kind(cfg.trace)
    same = _same_folder(cfg, kind, folder, manifest, chash, phash, s.overwrite)
    if same and _reusable(folder, manifest):
        print(f"reusing complete {_summary_line(folder, manifest, kind)}", flush=True)
        return folder
    store.check_writable(folder.parent)
    resuming = same
    # a corrupt shard is named before the (slow) model load and before any write
    shards = store.existing_shards(folder, full=True) if resuming else {}
    if pair is None:
        from models.pair import load_pair

        pair = load_pair(cfg.pair)
    if str(pair.name) != str(cfg.pair.name):
        raise UserError(f"generate() got pair {pair.name} but cfg.pair is {cfg.pair.name}; pass the matching pair")
    items, note = prepare_items(cfg, pair, prompts, s)
    if note:
        print(f"note: {note}", flush=True)
    # dtype and linear: what pair.dtype / pair.linear = auto resolved to on this machine
    plan = Plan(folder, chash, math.ceil(len(items) / s.prompts_per_shard), str(pair.dtype).replace("torch.", ""),
                pair.linear, kind)
    if resuming:
        _check_resumable(plan, manifest, pair)
    else:
        manifest, shards = _start_folder(cfg, split, pair, s, plan, items, note, phash)
    mine = [g for g in range(plan.n_shards) if g % s.num_shards == s.shard_id]
    todo = [g for g in mine if g not in shards]
    if todo and len(todo) < len(mine):
        print(f"resuming {folder}: {len(mine) - len(todo)} of this job's {len(mine)} shards already done", flush=True)
    start = time.perf_counter()
    positions = _write_shards(pair, cfg.trace, folder, s, manifest, items, todo, desc=f"data_gen {split}")
    elapsed = time.perf_counter() - start
    shards = store.existing_shards(folder, full=False)  # other jobs may have written theirs meanwhile
    if store.missing_shards(manifest, shards):
        print(
            f"shard job {s.shard_id}/{s.num_shards} done: {len(shards)} of {plan.n_shards} shards present in {folder}; "
            "run the same command with verify=true once every job has finished",
            flush=True,
        )
        return folder
    manifest = store.finalize(folder, manifest, shards)
    print(_summary_line(folder, manifest, kind, elapsed if todo else None, positions), flush=True)
    return folder


def _same_folder(cfg: DictConfig, kind, folder: Path, manifest: dict | None, chash: str, phash: str,
                 overwrite: bool) -> bool:
    """Whether the folder's manifest is of this config and these prompts; one line when it is of others and
    `overwrite` is off."""
    if manifest is not None and manifest.get("config_hash") != chash and not overwrite:
        raise _other_config(folder, manifest, chash, kind)
    # folders from before the field have none: they are taken as made from today's files
    same_prompts = manifest is None or manifest.get("prompts_hash", phash) == phash
    if not same_prompts and not overwrite:
        raise UserError(f"traces at {folder} were made from other {cfg.dataset.name} prompts than data/ holds now "
                        f"(prompts hash {manifest['prompts_hash']} != {phash}); rerun with overwrite=true to regenerate")
    return manifest is not None and manifest.get("config_hash") == chash and same_prompts


@dataclass(frozen=True)
class Plan:
    """Where this job writes and what a manifest found there must agree with."""

    folder: Path
    config_hash: str
    n_shards: int  # groups of `prompts_per_shard` prompts
    dtype: str
    linear: str
    kind: object  # data_gen.kinds.TraceKind


def _other_config(folder: Path, manifest: dict, chash: str, kind) -> UserError:
    for key, now in kind.hash_extra().items():  # a kind's own format (tree traces: data_gen.tree_format)
        made = (manifest.get("config") or {}).get(key, 1)
        if manifest.get("trace_kind") == kind.name and made != now:
            return UserError(f"traces at {folder} are {kind.name} traces of format {made}, older than today's {now} "
                             f"({key}: new columns); rerun with overwrite=true to regenerate them")
    return UserError(
        f"traces at {folder} were made with another config (hash {manifest.get('config_hash')} != {chash}); "
        "rerun with overwrite=true to replace them, or pick another trace_root"
    )


def _reusable(folder: Path, manifest: dict) -> bool:
    """A complete folder (of this config and prompts: the caller checks) whose shards are all there (sizes only;
    anything off falls through to the resume path's full check)."""
    if not manifest.get("complete"):
        return False
    try:
        return not store.missing_shards(manifest, store.existing_shards(folder, full=False))
    except UserError:
        return False


def _new_manifest(cfg: DictConfig, split: str, pair, s: Settings, plan: Plan, items: list, note: str | None) -> dict:
    """The manifest of a folder this job starts: the config and everything a later reader checks against."""
    from models.profiling import get_profile

    kind = trace_kind(cfg.trace)
    return {
        "config_hash": plan.config_hash,
        "config": store.hash_payload(cfg),
        "pair_id": pair.pair_id,
        "drafter": kind.drafter(cfg.trace),  # whose draft the rows record (decode.drafter); none: the student's
        "tokenizer_hash": pair.tokenizer_hash,
        "dtype": plan.dtype,
        "linear": plan.linear,
        "code_version": store.code_version(),
        "trace_kind": str(cfg.trace.kind),
        "split": split,
        "topk": int(cfg.trace.get("topk", 10)),
        "hidden_size": kind.hidden_size(pair, cfg.trace) if kind.store_hidden(cfg.trace) else 0,
        "temperature": float(cfg.trace.get("temperature", 0.0)),
        "top_p": float(cfg.trace.get("top_p", 1.0)),
        **kind.manifest_extra(cfg.trace),  # tree traces: the candidate trees' bounds and the positions' spacing
        "max_new_tokens": int(cfg.trace.max_new_tokens),
        "vocab_size": pair.vocab_size,
        # what a draft step and a target pass cost on the machine that made these traces (models.cost)
        "cost_profile": kind.cost_profile(pair, get_profile(pair, cfg.get("profile")), cfg.trace).to_dict(),
        "prompts_per_shard": s.prompts_per_shard,
        "num_prompts": len(items),
        "num_shards_planned": plan.n_shards,
        "prompt_note": note,
        "complete": False,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _start_folder(cfg: DictConfig, split: str, pair, s: Settings, plan: Plan, items: list,
                  note: str | None, phash: str) -> tuple[dict, dict]:
    """Create the folder and its manifest (`overwrite=true` clears an old one); returns (manifest, shards present).
    Of several shard jobs started together exactly one writes the manifest; the others adopt and check the winner's."""
    folder = plan.folder
    if folder.exists() and s.overwrite:
        shutil.rmtree(folder)
    elif store.read_manifest(folder) is None and folder.exists():
        # no manifest yet (read again: a shard job that started with this one may have just written it); dot
        # entries are temp files of a job creating the manifest right now, anything else is someone else's
        leftovers = [p for p in folder.iterdir() if not p.name.startswith(".")]
        if leftovers:
            raise UserError(f"{folder} exists without a valid manifest; remove it or rerun with overwrite=true")
    folder.mkdir(parents=True, exist_ok=True)
    manifest = _new_manifest(cfg, split, pair, s, plan, items, note)
    manifest["prompts_hash"] = phash
    created = store.create_manifest(folder, manifest)
    if created is manifest:
        return manifest, {}
    _check_resumable(plan, created, pair)
    return created, store.existing_shards(folder, full=False)


def _write_shards(pair, trace: DictConfig, folder: Path, s: Settings, manifest: dict, items: list, todo: list[int],
                  desc: str) -> int:
    """Trace and write shard groups `todo` (each shard appears only when complete); returns the positions traced."""
    kind = trace_kind(trace)
    pps = s.prompts_per_shard
    positions, start = 0, time.perf_counter()
    bar = tqdm(total=sum(len(items[g * pps : (g + 1) * pps]) for g in todo), unit="prompt", desc=desc,
               disable=not s.progress, dynamic_ncols=True)
    for g in todo:
        group = items[g * pps : (g + 1) * pps]
        order = sorted(range(len(group)), key=lambda i: -len(group[i].prefix))  # similar lengths batch together
        rows: list[dict | None] = [None] * len(group)
        for b in range(0, len(order), s.batch_size):
            idx = order[b : b + s.batch_size]
            for i, r in zip(idx, kind.rows(pair, [group[i] for i in idx], trace)):
                rows[i] = r
                positions += r["n"]
            bar.update(len(idx))
            bar.set_postfix_str(f"{positions / max(time.perf_counter() - start, 1e-9):.1f} positions/s")
        store.remove_stale_tmp(folder, g)
        store.write_shard(folder, g, rows, manifest["topk"], manifest["hidden_size"],
                          {"config_hash": manifest["config_hash"]})
    bar.close()
    return positions


def _check_resumable(plan: Plan, manifest: dict, pair) -> None:
    """A manifest found in place (a resume, or another shard job's) must describe exactly this job's traces."""
    folder = plan.folder
    if manifest.get("config_hash") != plan.config_hash:
        raise _other_config(folder, manifest, plan.config_hash, plan.kind)
    if manifest.get("tokenizer_hash") != pair.tokenizer_hash:
        raise UserError(
            f"traces at {folder} were made with tokenizer {manifest.get('tokenizer_hash')} but pair {pair.name} now has "
            f"{pair.tokenizer_hash}; rerun with overwrite=true to regenerate them"
        )
    # settings `auto` resolves per machine (dtype by the CPU's bf16 flags, linear by oneDNN; float32 rounds differently
    # in the two products): a folder is continued only as it was started. Missing: folders from before the setting.
    for name, now, before in (("dtype", plan.dtype, plan.dtype), ("linear", plan.linear, "torch")):
        made = manifest.get(name, before)
        if made != now:
            raise UserError(
                f"traces at {folder} were started with pair.{name}={made} but this run resolves it to {now}; "
                f"pass pair.{name}={made} to resume them, or overwrite=true to regenerate"
            )
    if manifest.get("num_shards_planned") != plan.n_shards:
        raise UserError(f"{folder} plans {manifest.get('num_shards_planned')} shards but this run {plan.n_shards}; "
                        "rerun with overwrite=true")


def verify_cmd(cfg: DictConfig, split: str) -> Path:
    """`verify=true`: check the folder these settings name is complete and intact, merge its manifest, summarise."""
    folder = store.trace_folder(cfg, split)
    manifest = store.read_manifest(folder)
    if manifest is not None and manifest.get("config_hash") != store.config_hash(cfg):
        raise UserError(f"traces at {folder} were made with another config than this command's; check the overrides")
    manifest = store.verify(folder)
    print(f"verified {_summary_line(folder, manifest, trace_kind(cfg.trace))}", flush=True)
    return folder
