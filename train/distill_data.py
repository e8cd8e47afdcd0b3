"""`python -m train.distill_data`: the draft's distillation data at scale — the target's own responses to prompts from
every domain we decode, greedy and sampled, with the teacher's top-k probabilities cached as they are generated.

Why a job of its own: agreement of the shipped draft is limited by its data (534 sequences, mostly code), and at
~100-200 generated tokens/s on a 2-core CPU two million positions take hours, more than one session. So the job is
sharded and resumable under data_gen's manifest contract (`data_gen.store`: one manifest with the config hash,
shards that appear only when complete, checksums, a mismatched folder refused in one line, `shard_id/num_shards`
fan-out), and every finished shard's token ids are also exported (`seq_dir`, a few MB for millions of positions, meant
to be committed). A machine that has the ids but not the cache rebuilds the top-k with one teacher-forced pass per
prompt (`teacher_topk`).

Phases (all resumable):
1. generated prompts (`gen_prompts`): the target writes new tasks from train-split seeds (self-instruct) and German
   versions of WikiText-2 train sentences (for Spec-Bench's "Translate German to English:"); rows are appended to
   `gen_prompts.path` (committed) batch by batch, and a rerun continues from the last row.
2. responses: every prompt (train.distill_prompts + phase 1), rendered through the chat template, answered once per
   `responses.temperatures` entry (0 = greedy, 1 = the target's own distribution), batched with a KV cache;
   `train.batch_gen.respond` keeps the teacher's top-k of the raw logits at each new token. Each shard's generation
   seconds go in its shard.json.
3. with `features.cache=true`, right after each shard: the target's hidden states at an EAGLE-3 draft's three layers
   (`features.layers`, null: models.eagle3's choice) over every sequence, one teacher-forced pass per batch of them,
   stored beside the shard (train.feature_cache, bf16, atomic; the manifest records layers, dtype, bytes per position
   and per shard positions and seconds). `python -m train.eagle data.features=cached` trains on them with no target
   pass. A rerun adds the feature files its shards lack, so a corpus made without a cache can gain one.
   `gen_prompts.kinds` (e.g. [coding]) keeps phase 1 to some self-instruct kinds: a code corpus (conf/corpus/).

`python -m train.distill data.source=distill_data` (conf/distill.yaml) trains on the folder this writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from data_gen import store
from models.cost import machine
from models.lm import cache_kw
from models.pair import Pair, eos_ids, load_pair
from train import batch_gen
from train import distill_prompts as dp
from train import feature_cache as fc
from train.distill_store import SEQ_COLUMNS, export_seqs, load_items, read_seqs, write_shard  # noqa: F401 (the
# corpus's storage lives in train.distill_store; its callers (train.distill, vocab_subset, bench) import it from here)
from utils.cli import UserError, hydra_entry
from utils.files import write_text_atomic

log = logging.getLogger(__name__)
CODE_VERSION = "distill-data-2"  # 2: train.batch_gen (shared prefill, own sampling stream)


# --------------------------------------------------------------------------------------------------- generation


def generate(pair: Pair, prompts: list[list[int]], temperature: float, max_new_tokens: int, topk: int,
             seed: int) -> list[dict]:
    """The target's continuations of tokenized `prompts` at one temperature: per prompt {cont (ids up to and
    including the first EOS), vals, idx: (len(cont), topk)} — the teacher's top-k before each continuation token."""
    return [r[0] for r in respond(pair, prompts, [temperature], max_new_tokens, topk, seed)]


def respond(pair: Pair, prompts: list[list[int]], temperatures: list[float], max_new_tokens: int, topk: int,
            seed: int) -> list[list[dict]]:
    """`pair.target`'s continuations at every temperature (train.batch_gen.respond, the one batched generator);
    a pair-like view may carry a `logit_mask` (the on-policy student restricted to its vocabulary subset)."""
    return batch_gen.respond(pair.target, prompts, list(temperatures), max_new_tokens, topk, seed, pair.vocab_size,
                             eos_ids(pair.target, pair.tokenizer), getattr(pair, "logit_mask", None))


@torch.inference_mode()
def teacher_topk(pair: Pair, seqs: list[dict], topk: int, batch_size: int) -> list[dict]:
    """Top-k of the target teacher-forced on stored sequences (ids, start): the rebuild path for exported shards.

    As generation did, the responses to one prompt (one per temperature) share one prefill of the prompt, and the
    LM head runs on response positions only: a full pass per row cost a 2-core CPU more (~160 s a shard) than
    generating the shard had (~100 s)."""
    out: list[dict | None] = [None] * len(seqs)
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(seqs):
        groups.setdefault(tuple(s["ids"][: int(s["start"])]), []).append(i)
    for prompt, members in groups.items():
        for b in range(0, len(members), batch_size):
            part = members[b : b + batch_size]
            for i, dist in zip(part, _response_dists(pair, list(prompt), [seqs[i] for i in part])):
                v, idx = dist.topk(topk, dim=-1)
                out[i] = {**seqs[i], "vals": v.to(torch.float16).cpu(), "idx": idx.to(torch.int32).cpu()}
    return out


def _response_dists(pair: Pair, prompt: list[int], rows: list[dict]) -> list[torch.Tensor]:
    """The target's distribution before each response token of `rows` (all continuing `prompt`): (n_r, vocab)."""
    dev, n_prompt, model = pair.device, len(prompt), pair.target
    last, cache = batch_gen.prefill(model, prompt, dev)
    first = last[None, : pair.vocab_size].float()
    conts = [list(r["ids"][n_prompt:]) for r in rows]
    width = max(len(c) for c in conts) - 1  # the last token of a response predicts nothing we keep
    if width == 0:
        return [torch.softmax(first, -1) for _ in rows]
    cache.batch_repeat_interleave(len(rows))
    ids = torch.full((len(rows), width), pair.tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.ones(len(rows), n_prompt + width, dtype=torch.long)
    for r, c in enumerate(conts):
        ids[r, : len(c) - 1] = torch.as_tensor(c[:-1])
        mask[r, n_prompt + len(c) - 1 :] = 0  # right padding: it only follows the positions that are kept
    logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), **cache_kw(model, cache), use_cache=True).logits
    return [torch.softmax(torch.cat([first, logits[r, : len(c) - 1, : pair.vocab_size].float()]), -1)
            for r, c in enumerate(conts)]


# ----------------------------------------------------------------------------------------- phase 1: prompts


def _gen_requests(cfg: DictConfig) -> list[dict]:
    """Every planned generated-prompt request, in order: self-instruct tasks, then English→German sentences."""
    g = cfg.gen_prompts
    seeds, kinds = dp.self_instruct_seeds(), g.get("kinds")
    if kinds is not None:  # e.g. [coding]: a code corpus; the ids name the kinds, so no file of other kinds matches
        unknown = sorted(set(kinds) - set(seeds))
        if unknown:
            raise UserError(f"gen_prompts.kinds {unknown} unknown; known: {', '.join(sorted(seeds))}")
        seeds = {k: seeds[k] for k in kinds}
    tag = "" if kinds is None else "-".join(sorted(kinds)) + "-"
    reqs = []
    for i in range(int(g.self_instruct)):
        kind, ask, prime = dp.self_instruct_request(i, seeds, int(cfg.seed))
        reqs.append({"id": f"si-{tag}{i}", "source": f"self_instruct_{kind}", "request": ask, "prime": prime,
                     "temperature": 1.0})
    first = int(g.get("translations_from", 0))  # a top-up set translates sentences the main set did not
    for j, s in enumerate(dp.english_sentences(first + int(g.translations))[first:], first):  # ids name the sentence
        reqs.append({"id": f"tr-{j}", "source": "translation", "request": dp.translation_request(s), "prime": "",
                     "temperature": 0.7})
    return reqs


def _finish_prompt(req: dict, output: str, guard: dp.TestGuard) -> str | None:
    if req["source"] == "translation":
        text = output.strip()
        ok = 5 <= len(text) <= 800 and not dp.degenerate(text)
        prompt = f"Translate German to English: {text}" if ok else None
    else:
        prompt = dp.clean_generated_task(output)
    return None if prompt is None or guard.leaks(prompt) else prompt


def make_generated_prompts(cfg: DictConfig, pair: Pair) -> list[dp.DistillPrompt]:
    """Phase 1: fill `gen_prompts.path` up to the planned requests (resuming after its last row)."""
    g = cfg.gen_prompts
    path = Path(str(g.path))
    done = dp.read_generated(path)
    reqs = _gen_requests(cfg)
    if [r["id"] for r in done] != [r["id"] for r in reqs[: len(done)]]:
        raise UserError(f"{path} was made from other requests than gen_prompts now plans; delete it or restore the "
                        "settings it was made with (its rows name their ids)")
    todo = reqs[len(done):]
    if todo:
        guard = dp.TestGuard()
        bs = int(g.batch_size)
        bar = tqdm(total=len(reqs), initial=len(done), desc="generated prompts", unit="prompt", dynamic_ncols=True,
                   disable=not cfg.progress)
        for b in range(0, len(todo), bs):
            chunk = todo[b : b + bs]
            for t in sorted({r["temperature"] for r in chunk}):
                part = [r for r in chunk if r["temperature"] == t]
                enc = [_encode(pair, r["request"], r["prime"]) for r in part]
                outs = generate(pair, enc, t, int(g.max_new_tokens), 1, int(cfg.seed) + len(done) + b)
                for r, o in zip(part, outs):
                    text = pair.tokenizer.decode(o["cont"], skip_special_tokens=True)
                    r["output"], r["prompt"] = text, _finish_prompt(r, text, guard)
            done += chunk
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in done))
            bar.update(len(chunk))
        bar.close()
    kept = dp.generated_prompts(path)
    print(f"generated prompts: {len(kept)} kept of {len(done)} in {path}", flush=True)
    return kept


# ------------------------------------------------------------------------------------------ phase 2: responses


def _encode(pair: Pair, text: str, prime: str = "") -> list[int]:
    """The prompt as decode renders it (chat template), plus `prime`: the start of the answer, if any."""
    from data_gen.prompts import Prompt, render

    return pair.tokenizer(render(Prompt("", "", text), pair.tokenizer, pair.chat_template) + prime,
                          add_special_tokens=False)["input_ids"]


def all_prompts(cfg: DictConfig, generated: list[dp.DistillPrompt]) -> list[dp.DistillPrompt]:
    """Built + generated prompts, shuffled once by `seed`, so every prefix of the shard plan mixes all domains."""
    prompts = dp.built_prompts(cfg) + generated
    random.Random(int(cfg.seed)).shuffle(prompts)
    return prompts[: int(cfg.limit)] if cfg.get("limit") is not None else prompts


def hash_payload(cfg: DictConfig) -> dict:
    """What decides the rows: the pair, the response settings and the shard plan (not threads, paths, progress)."""
    keep = ("responses", "topk", "prompts_per_shard", "max_prompt_tokens", "seed", "limit")
    target = OmegaConf.to_container(cfg.pair.target, resolve=True)  # the draft plays no part in these rows
    return {"pair": {"name": str(cfg.pair.name), "target": target}, "code_version": CODE_VERSION,
            **{k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
               for k in keep if k in cfg}}


def config_hash(cfg: DictConfig) -> str:
    return hashlib.sha256(json.dumps(hash_payload(cfg), sort_keys=True, default=str).encode()).hexdigest()[:12]


def folder_name(cfg: DictConfig) -> str:
    """`<pair>-responses[-lim<N>]`: readable and without the hash, so a run with other settings meets the folder of
    the first and is refused in one line instead of silently starting a second data set (data_gen's rule)."""
    return f"{cfg.pair.name}-responses" + (f"-lim{int(cfg.limit)}" if cfg.get("limit") is not None else "")


def out_folder(cfg: DictConfig) -> Path:
    return Path(os.path.expanduser(str(cfg.out_root))) / folder_name(cfg)


def _plan(cfg: DictConfig, prompts: list[dp.DistillPrompt]) -> list[list[dp.DistillPrompt]]:
    pps = int(cfg.prompts_per_shard)
    return [prompts[i : i + pps] for i in range(0, len(prompts), pps)]


def _manifest(cfg: DictConfig, pair: Pair, n_shards: int, prompts: list[dp.DistillPrompt]) -> dict:
    return {"config_hash": config_hash(cfg), "config": hash_payload(cfg), "pair_id": pair.pair_id,
            "tokenizer_hash": pair.tokenizer_hash, "dtype": str(pair.dtype).replace("torch.", ""),
            "code_version": store.code_version(), "kind": "distill_responses", "topk": int(cfg.topk),
            "prompts_hash": hashlib.sha256("\n".join(p.prompt_id + "\t" + p.text for p in prompts).encode()).hexdigest()[:12],
            "num_prompts": len(prompts), "num_shards_planned": n_shards, "complete": False,
            "sources": dict(sorted({s: sum(p.source == s for p in prompts) for s in {p.source for p in prompts}}.items())),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _check(folder: Path, found: dict, want: dict, overwrite: bool) -> None:
    """A folder is continued only as it was started: same config, prompts, tokenizer and dtype."""
    # not the dtype: responses made in bf16 on one machine and float32 on the next are both the target's (each
    # shard records its own), and sessions move between CPUs with and without native bf16
    for key, what in (("config_hash", "another config"), ("prompts_hash", "other prompts"),
                      ("tokenizer_hash", "another tokenizer"), ("num_shards_planned", "another shard plan")):
        if found.get(key) != want[key] and not overwrite:
            raise UserError(f"distillation data at {folder} was made with {what} ({key} {found.get(key)} != "
                            f"{want[key]}); rerun with overwrite=true to regenerate, or pick another out_root")


def shard_rows(cfg: DictConfig, pair: Pair, group: list[dp.DistillPrompt], index: int) -> list[dict]:
    """Responses of one shard's prompts at every configured temperature (prompts too long are skipped)."""
    r = cfg.responses
    enc = [(p, _encode(pair, p.text)) for p in group]
    enc = [(p, e) for p, e in enc if len(e) <= int(cfg.max_prompt_tokens)]
    enc.sort(key=lambda pe: len(pe[1]))  # similar lengths batch together (less padding)
    rows, temps = [], [float(t) for t in r.temperatures]
    for b in range(0, len(enc), int(cfg.batch_size)):  # every temperature of a prompt shares its prefill
        chunk = enc[b : b + int(cfg.batch_size)]
        outs = respond(pair, [e for _, e in chunk], temps, int(r.max_new_tokens), int(cfg.topk),
                       int(cfg.seed) * 1_000_003 + index * 101 + b)
        for (p, e), per_temp in zip(chunk, outs):
            for temp, o in zip(temps, per_temp):
                if o["cont"]:
                    rows.append({"prompt_id": p.prompt_id, "source": p.source, "temperature": temp,
                                 "ids": e + o["cont"], "start": len(e), "vals": o["vals"], "idx": o["idx"]})
    return rows


def run(cfg: DictConfig) -> Path:
    """Both phases; returns the responses folder (complete when every planned shard is there)."""
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    if int(cfg.num_shards) < 1 or not 0 <= int(cfg.shard_id) < int(cfg.num_shards):
        raise UserError(f"shard_id={cfg.shard_id} must be in [0, num_shards={cfg.num_shards})")
    folder = out_folder(cfg)
    store.check_writable(folder.parent)
    pcfg = OmegaConf.create(OmegaConf.to_container(cfg.pair, resolve=True))
    pcfg.draft = OmegaConf.create({"source": "layer_subset", "layers": [0]})  # only the target runs here
    pair = load_pair(pcfg)
    spec = fc.spec_of(cfg.features, pair.target) if cfg.features.cache else None  # bad settings: before any work
    if cfg.gen_prompts.enabled and int(cfg.num_shards) > 1 and int(cfg.shard_id) != 0:
        done, planned = len(dp.read_generated(Path(str(cfg.gen_prompts.path)))), len(_gen_requests(cfg))
        if done < planned:  # one writer for the shared jsonl; the other shard jobs plan from its finished state
            raise UserError(f"{cfg.gen_prompts.path} has {done} of {planned} generated prompts; finish them first with "
                            "shard_id=0 (or num_shards=1), then start the other shard jobs")
    generated = make_generated_prompts(cfg, pair) if cfg.gen_prompts.enabled else []
    prompts = all_prompts(cfg, generated)
    groups = _plan(cfg, prompts)
    want = {**_manifest(cfg, pair, len(groups), prompts), **({"features": spec} if spec else {})}
    found = store.read_manifest(folder)
    if found is not None:
        _check(folder, found, want, bool(cfg.overwrite))
        if cfg.overwrite:
            shutil.rmtree(folder)
            found = None
    folder.mkdir(parents=True, exist_ok=True)
    manifest = store.create_manifest(folder, want) if found is None else found
    if spec is not None:
        manifest = fc.adopt(folder, manifest, spec)
    elif manifest.get("features"):  # its shards would lack features that train.eagle data.features=cached needs
        raise UserError(f"{folder} caches the target's features ({manifest['features']['layers']}); rerun with "
                        "features.cache=true so new shards get them too")
    seq_dir = Path(str(cfg.seq_dir)) / folder_name(cfg) if cfg.get("seq_dir") else None
    if seq_dir is not None:
        exported = store.read_manifest(seq_dir)
        if exported is not None and cfg.overwrite:
            shutil.rmtree(seq_dir)
        elif exported is not None:
            _check(seq_dir, exported, want, False)
        seq_dir.mkdir(parents=True, exist_ok=True)
        if exported is None or cfg.overwrite:  # a matching one stays as it is: its code_version is that of the run
            # that made the ids, and a rebuild rewriting it would churn a committed file
            store.write_json_atomic(seq_dir / store.MANIFEST,
                                    {k: v for k, v in want.items() if k not in ("created", "dtype", "features")})
    _fill(cfg, pair, folder, manifest, groups, seq_dir)
    return folder


def _fill(cfg, pair, folder: Path, manifest: dict, groups, seq_dir: Path | None) -> None:
    """Make this job's missing shards and, with features.cache, the feature files its shards lack (train
    .feature_cache: one teacher-forced pass per batch of a shard's sequences, right after the shard)."""
    shards = store.existing_shards(folder, full=False)
    alien = [store.shard_name(g) for g, m in shards.items() if m.get("config_hash") != manifest["config_hash"]]
    if alien:
        raise UserError(f"{folder} holds shards of another config ({', '.join(alien[:3])}); delete them or rerun "
                        "with overwrite=true")
    spec = manifest.get("features") if cfg.features.cache else None
    mine = [g for g in range(len(groups)) if g % int(cfg.num_shards) == int(cfg.shard_id)
            and (g not in shards or (spec is not None and not fc.has_features(folder, g)))]
    if cfg.get("max_shards") is not None:
        mine = mine[: int(cfg.max_shards)]
    positions = sum(int(m.get("positions", 0)) for m in shards.values())
    bar = tqdm(total=len(groups), initial=len(shards), desc="distillation responses", unit="shard",
               dynamic_ncols=True, disable=not cfg.progress)
    t0, made, featured = time.perf_counter(), 0, 0.0
    for g in mine:
        if g in shards:  # a finished shard without its feature file (a killed run, or a corpus gaining a cache)
            rows = fc.stored_rows(folder, g)
        else:
            meta, rows, new = _make_shard(cfg, pair, folder, manifest, groups[g], g, seq_dir, spec)
            positions, made = positions + meta["positions"], made + new
            bar.update(1)
        if spec is not None and not fc.has_features(folder, g):  # a rebuild wrote them with its top-k
            fmeta = fc.write_features(folder, g, rows, pair.target, spec, cfg.features, pair.tokenizer.pad_token_id,
                                      manifest["config_hash"])
            featured += float(fmeta["seconds"])
        elapsed = max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix_str(f"{positions / 1e6:.3f}M positions, {made / elapsed:.0f} generated/s"
                            + (f", feature pass {featured / elapsed:.0%} of the time" if spec is not None else ""))
    bar.close()
    _finish(folder, groups, positions, spec)


def _make_shard(cfg, pair, folder: Path, manifest: dict, group, g: int, seq_dir: Path | None, spec: dict | None):
    """Shard g generated (or rebuilt from its exported ids) and written: (its meta, rows, positions generated).
    A rebuild with a feature cache takes the top-k and the features from one pass of the target and writes both
    (the shard's gen_seconds is that pass, the feature file's seconds 0: no pass of its own, so bench.corpus_throughput
    leaves the shard out); two passes cost a 2-core CPU ~5 minutes a shard of the 1.5B corpus."""
    store.remove_stale_tmp(folder, g)
    t0 = time.perf_counter()
    seqs = read_seqs(seq_dir, g, manifest["config_hash"]) if seq_dir is not None else None
    tensors = None
    if seqs is not None and spec is not None:
        tensors, tops = fc.shard_features(pair.target, seqs, spec, int(cfg.features.batch_tokens),
                                          pair.tokenizer.pad_token_id, (int(cfg.topk), pair.vocab_size))
        rows = [{**s, "vals": v, "idx": i} for s, (v, i) in zip(seqs, tops)]
    elif seqs is not None:
        rows = teacher_topk(pair, seqs, int(cfg.topk), int(cfg.batch_size))
    else:
        rows = shard_rows(cfg, pair, group, g)
    meta = write_shard(folder, g, rows, {"config_hash": manifest["config_hash"], "rebuilt": seqs is not None,
                                         "dtype": str(pair.dtype).replace("torch.", ""), "machine": machine(),
                                         "threads": torch.get_num_threads(),
                                         "gen_seconds": round(time.perf_counter() - t0, 3)})
    if tensors is not None:
        fc.save_features(folder, g, rows, tensors, spec, manifest["config_hash"], 0.0)
    if seq_dir is not None and seqs is None:
        export_seqs(seq_dir, g, rows, manifest["config_hash"])
    return meta, rows, 0 if seqs is not None else meta["positions"]


def _finish(folder: Path, groups, positions: int, spec: dict | None) -> None:
    """The manifest brought up to date (read afresh: other shard jobs write it too): `complete` with the totals once
    every planned shard is there, and with a cache the per-shard throughput table (train.feature_cache)."""
    manifest = store.read_manifest(folder)
    shards = store.existing_shards(folder, full=False)
    done = not store.missing_shards(manifest, shards)
    update = {"feature_shards": fc.throughput(folder, shards)} if spec is not None else {}
    if done and not manifest.get("complete"):
        update.update(complete=True, positions=positions, rows=sum(int(m["rows"]) for m in shards.values()))
    if update:
        store.write_json_atomic(folder / store.MANIFEST, {**manifest, **update})
    print(f"{folder}: {len(shards)} of {len(groups)} shards, {positions} positions"
          + ("" if done else " (rerun the same command to continue)"), flush=True)
    if spec is not None:
        cached = [v["feature_positions"] for v in update["feature_shards"].values() if v["feature_positions"]]
        print(f"features: {len(cached)} shards cached, {sum(cached):,} positions x {spec['bytes_per_position']} B = "
              f"{sum(cached) * spec['bytes_per_position'] / 2**30:.2f} GiB", flush=True)


@hydra_entry("distill_data")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
