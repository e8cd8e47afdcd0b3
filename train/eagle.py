"""`python -m train.eagle`: train the EAGLE-3 draft of a pair's target (models.eagle3) with training-time test.

    python -m train.eagle [pair=smollm2_135m] [train.max_steps=N] [train.ttt_steps=3] [name=RUN] [logger=wandb]
    python -m train.eagle pair=qwen_coder_1.5b_eagle3 data.features=cached data.min_positions=300000 \\
        'data.cache_dirs=[traces/distill/qwen_coder_1.5b_eagle3-responses]'

Data: the target's own responses that `python -m train.distill_data` made and committed as token ids
(`data.folders`, data/distill/responses*/: greedy and T = 1 answers to code, chat, QA, summarisation, translation and
maths prompts, never a test prompt), each sequence's response positions the training targets. By default
(`data.features=on_the_fly`) the target runs on every batch: its hidden states at the draft's three layers are the
features, its softmax the soft labels. With `data.features=cached` the sequences come from `data.cache_dirs`, corpora
that `python -m train.distill_data features.cache=true` made with the target's features stored beside each shard
(train.feature_cache): no target pass at all, the soft labels the teacher's top-k the corpus keeps (`data.topk` of
it; the tail beyond it gets no mass). A cache made at other layers than the draft reads, or by another target, is
refused in one line. This is how a target too slow to run every epoch (1.5B on a CPU) gets its draft. A fixed share
of prompts (`data.heldout_pct`, by a hash of the prompt id, so every answer to a prompt sits on one side) is held out
for the agreement table.

Training: AdamW with warmup and cosine decay, `train.ttt_steps` TTT steps (models.eagle3.forward_steps), Lightning
with a checkpoint every `train.ckpt_minutes` under logs/eagle/<name>/; a rerun with the same name resumes it (the
batch order is a function of the seed and the epoch, and a resumed epoch skips the batches it already did). At the
end the draft is saved to `out` (safetensors; metadata: the command, data, steps and the held-out top-1 agreement per
drafting step 1..5 per domain), with the same numbers in `<out>.train.json`.
"""

from __future__ import annotations

import json
import random
import sys
import time
import zlib
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from utils.cli import UserError, hydra_entry


def domain_of(source: str, domains: dict) -> str:
    """A response's domain (conf/eagle.yaml `data.domains`: source-name prefix → domain), else its source."""
    for prefix, dom in domains.items():
        if source.startswith(prefix):
            return str(dom)
    return source


def load_sequences(cfg: DictConfig) -> list[dict]:
    """Every committed response sequence of `data.folders` (token ids with their response start)."""
    import pyarrow.parquet as pq

    from models.student import REPO_ROOT

    items, domains = [], dict(cfg.data.domains or {})
    for folder in cfg.data.folders:
        path = Path(str(folder))
        path = path if path.is_absolute() else REPO_ROOT / path
        files = sorted(path.glob("shard-*.parquet"))
        if not files:
            raise UserError(f"data.folders: {path} holds no shard-*.parquet; make it with python -m train.distill_data")
        for f in files:
            t = pq.read_table(f).to_pydict()
            for ids, start, src, pid in zip(t["ids"], t["start"], t["source"], t["prompt_id"]):
                if len(ids) - int(start) > 0:
                    items.append({"ids": ids[: int(cfg.data.max_len)], "start": int(start), "source": src,
                                  "prompt_id": pid, "domain": domain_of(src, domains)})
    return [it for it in items if it["start"] < len(it["ids"])]


FEATURES = ("on_the_fly", "cached")


def _repo_path(folder) -> Path:
    from models.student import REPO_ROOT

    path = Path(str(folder))
    return path if path.is_absolute() else REPO_ROOT / path


def load_cached(cfg: DictConfig) -> tuple[list[dict], list[tuple[Path, dict]]]:
    """Every finished shard's sequences of `data.cache_dirs` (train.distill_data corpora with features.cache=true)
    with their teacher top-k and feature offsets (train.feature_cache), and each folder's cache spec; refused in one
    line before the pair loads when a folder holds no cache or was made by another target (layers: `run`)."""
    from data_gen import store
    from train import feature_cache as fc

    dirs = list(cfg.data.get("cache_dirs") or [])
    if not dirs:
        raise UserError("data.features=cached needs data.cache_dirs: the folders python -m train.distill_data "
                        "features.cache=true wrote (traces/distill/<pair>-responses)")
    target = OmegaConf.to_container(cfg.pair.target, resolve=True)
    items, specs, domains, want_k = [], [], dict(cfg.data.domains or {}), cfg.data.get("topk")
    for folder in map(_repo_path, dirs):
        manifest = store.read_manifest(folder)
        spec = fc.check_cache(folder, manifest, target)
        if want_k is not None and int(want_k) > int(manifest["topk"]):
            raise UserError(f"data.topk={want_k} but {folder} caches the teacher's top-{manifest['topk']}; "
                            f"set data.topk to at most {manifest['topk']} (or null)")
        for index in sorted(store.existing_shards(folder, full=False)):
            for it in fc.cached_rows(folder, index, int(manifest["topk"])):
                items.append({**it, "ids": it["ids"][: int(cfg.data.max_len)],
                              "domain": domain_of(it["source"], domains)})
        specs.append((folder, spec))
    return [it for it in items if it["start"] < len(it["ids"])], specs


def load_data(cfg: DictConfig) -> tuple[list[dict], list[tuple[Path, dict]]]:
    """(sequences, cache specs) as `data.features` says: the committed ids of `data.folders` (the target runs on
    every batch) or the cached corpora of `data.cache_dirs`."""
    mode = str(cfg.data.get("features", "on_the_fly"))
    if mode not in FEATURES:
        raise UserError(f"data.features must be one of {', '.join(FEATURES)}, got '{mode}'")
    return load_cached(cfg) if mode == "cached" else (load_sequences(cfg), [])


def make_collate(cfg: DictConfig, pair):
    """Items → a batch: token ids alone (on the fly), or with the cached features and top-k."""
    from train.eagle_module import collate

    pad = pair.tokenizer.pad_token_id
    if str(cfg.data.get("features", "on_the_fly")) != "cached":
        return lambda b: collate(b, pad)
    from train.feature_cache import Features, collate_cached

    files, k = Features(), cfg.data.get("topk")
    return lambda b: collate_cached(b, pad, files, k)


def split(items: list[dict], pct: float) -> tuple[list[dict], list[dict]]:
    """(train, held out): a prompt's answers fall on one side, by a stable hash of its id."""
    held = [zlib.crc32(str(it["prompt_id"]).encode()) % 10000 < pct * 100 for it in items]
    return [it for it, h in zip(items, held) if not h], [it for it, h in zip(items, held) if h]


class ResumableBatches(torch.utils.data.Sampler):
    """Length-bucketed batches in an order fixed by (seed, epoch), where the epoch and the batches already done in
    it follow from the optimizer steps taken (`step_of`, the trainer's global step, read when an epoch's iterator
    is made): a resumed run goes on with the batch after the last one it trained on, in the order it was in."""

    def __init__(self, lengths: list[int], tokens: int, seed: int):
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        self.batches, cur, width = [], [], 0
        for i in order:
            width = max(width, lengths[i])
            if cur and width * (len(cur) + 1) > tokens:
                self.batches.append(cur)
                cur, width = [], lengths[i]
            cur.append(i)
        if cur:
            self.batches.append(cur)
        self.seed = seed
        self.step_of = lambda: 0

    def position(self) -> tuple[int, int]:
        """(epoch, batches of it already done)."""
        return divmod(int(self.step_of()), len(self.batches))

    def __iter__(self):
        epoch, skip = self.position()
        if skip:
            print(f"data: epoch {epoch}, from batch {skip} of {len(self.batches)}", flush=True)
        batches = list(self.batches)
        random.Random(self.seed * 1000003 + epoch).shuffle(batches)
        return iter(batches[skip:])

    def __len__(self):
        return len(self.batches) - self.position()[1]


def positions(items: list[dict]) -> int:
    return sum(len(it["ids"]) - it["start"] for it in items)


def subset_ids(pair) -> torch.Tensor:
    """The draft's reduced vocabulary (FR-Spec): the pair's own for EAGLE-3 (`eagle3.vocab_subset` most frequent
    of `eagle3.vocab_freq`, a python -m train.vocab_subset file: the 1.5B pair, whose self-draft has the full
    151,936-token head, ~233M parameters in an EAGLE-3 head), else its draft's subset (the default pair: the
    student's 8,192), else the whole vocabulary."""
    from models.lm import LM

    own = pair.cfg.get("eagle3") or {}
    if own.get("vocab_subset"):
        from models.lm_head import read_frequencies, subset_ids as top_ids
        from models.pair import REPO_ROOT, eos_ids

        if not own.get("vocab_freq"):
            raise UserError("pair.eagle3.vocab_subset needs pair.eagle3.vocab_freq (python -m train.vocab_subset)")
        path = Path(str(own["vocab_freq"]))
        always = set(getattr(pair.tokenizer, "all_special_ids", []) or []) | eos_ids(pair.target, pair.tokenizer)
        return top_ids(read_frequencies(path if path.is_absolute() else REPO_ROOT / path), int(own["vocab_subset"]),
                       always, pair.vocab_size)
    support = LM.of(pair, "draft").support
    return support.cpu() if support is not None else torch.arange(pair.vocab_size)


def _fit(cfg: DictConfig, pair, draft, train: list[dict], run_dir: Path, collate):
    from lightning import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
    from datetime import timedelta

    from train.eagle_module import EagleModule
    from train.job import make_loggers

    t = cfg.train
    sampler = ResumableBatches([len(it["ids"]) for it in train], int(t.batch_tokens), int(cfg.seed))

    loader = torch.utils.data.DataLoader(train, batch_sampler=sampler, collate_fn=collate)
    ckpt = ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True, save_top_k=0,
                           train_time_interval=timedelta(minutes=float(t.ckpt_minutes)))
    from train.distill import stop_rules, train_precision

    last = run_dir / "checkpoints" / "last.ckpt"
    trainer = Trainer(accelerator="cuda" if pair.device.type == "cuda" else "cpu", devices=1,
                      precision=train_precision(t, pair), max_steps=int(t.max_steps),
                      gradient_clip_val=float(t.grad_clip), logger=make_loggers(cfg, run_dir),
                      callbacks=[ckpt, TQDMProgressBar(refresh_rate=10), *stop_rules(t.get("max_minutes"), last)],
                      log_every_n_steps=10,
                      num_sanity_val_steps=0, use_distributed_sampler=False, enable_model_summary=False,
                      reload_dataloaders_every_n_epochs=1, default_root_dir=str(run_dir))
    sampler.step_of = lambda: trainer.global_step  # restored from the checkpoint before the first epoch's iterator
    resume = last if last.is_file() and cfg.get("resume", True) else None
    claim_run_dir(run_dir, pair.pair_id, resume is not None)
    if resume is not None:
        print(f"resuming from {resume}", flush=True)
    trainer.fit(EagleModule(draft, pair.target, t), loader, ckpt_path=str(resume) if resume else None)
    if trainer.global_step < int(t.max_steps):  # stopped by the time budget: keep exactly where it stands
        trainer.save_checkpoint(str(last))
    return trainer


def claim_run_dir(run_dir: Path, pair_id: str, resuming: bool) -> None:
    """A run dir trains one pair's draft: a resume on another pair's checkpoint is refused in one line, before
    Lightning fails on its shapes (the default `name` is the same for every pair)."""
    owner = run_dir / "pair.txt"
    if resuming and owner.is_file() and owner.read_text().strip() != pair_id:
        raise UserError(f"{run_dir} holds a run of pair {owner.read_text().strip()}, not {pair_id}; pass "
                        f"name={pair_id} (a run dir of its own) or resume=false to start over there")
    run_dir.mkdir(parents=True, exist_ok=True)
    owner.write_text(pair_id + "\n")


def heldout_batches(held: list[dict], cfg: DictConfig, collate) -> list[dict]:
    per = int(cfg.data.heldout_per_domain)
    by: dict[str, list[dict]] = {}
    for it in held:
        if len(by.setdefault(it["domain"], [])) < per:
            by[it["domain"]].append(it)
    rows = sorted((it for v in by.values() for it in v), key=lambda it: len(it["ids"]))
    size = max(1, int(cfg.train.batch_tokens) // max(len(rows[-1]["ids"]) if rows else 1, 1))
    return [collate(rows[i : i + size]) for i in range(0, len(rows), size)]


def warm_start(draft, path: Path, target) -> None:
    """Begin from a saved draft (`init=`): a longer run on a grown corpus keeps what the first one learned, with an
    optimizer and LR schedule of its own (a resume would skip the new data's first batches and restart the cosine
    mid-curve). The saved draft must read the same layers through the same reduced vocabulary."""
    from models.eagle3 import Eagle3

    if not path.is_file():
        raise UserError(f"init={path}: no such EAGLE-3 weights file; give a draft python -m train.eagle wrote")
    src = Eagle3.load(path, target)
    if tuple(src.cfg.layers) != tuple(draft.cfg.layers) or not torch.equal(src.ids.cpu(), draft.ids.cpu()):
        raise UserError(f"init={path} reads layers {list(src.cfg.layers)} through a {len(src.ids)}-token vocabulary; "
                        f"this run's draft reads {list(draft.cfg.layers)} through {len(draft.ids)}: give model.layers "
                        "and the pair's eagle3.vocab_freq it was trained with")
    draft.load_state_dict({k: v.to(draft.ids.device) for k, v in src.state_dict().items()})
    print(f"train.eagle: starting from {path}", flush=True)


def check_layers(folder: Path, spec: dict, draft) -> None:
    """A cache serves a draft only at the layers and hidden size it reads."""
    if list(spec["layers"]) != list(draft.cfg.layers) or int(spec["hidden"]) != draft.cfg.hidden:
        raise UserError(f"data.cache_dirs: {folder} caches the target's layers {spec['layers']} (hidden "
                        f"{spec['hidden']}), the draft reads {list(draft.cfg.layers)} (hidden {draft.cfg.hidden}); set "
                        f"model.layers={spec['layers']} or cache the draft's with train.distill_data features.layers=")


def run(cfg: DictConfig) -> dict:
    from models.eagle3 import Eagle3
    from models.pair import file_fingerprint, load_pair
    from train.eagle_module import agreement

    torch.manual_seed(int(cfg.seed))
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    items, caches = load_data(cfg)
    train, held = split(items, float(cfg.data.heldout_pct))
    n_pos = positions(train)
    print(f"train.eagle: {len(train)} sequences, {n_pos:,} response positions; {len(held)} held out", flush=True)
    if n_pos < int(cfg.data.min_positions):
        where = "data.cache_dirs" if cfg.data.features == "cached" else "data.folders"
        raise UserError(f"{where} give {n_pos:,} training positions (held-out prompts excluded), fewer than "
                        f"data.min_positions={cfg.data.min_positions}; add data there or lower data.min_positions")
    pair = load_pair(cfg.pair)
    for p in pair.target.parameters():
        p.requires_grad_(False)
    run_dir = Path(str(cfg.run_dir))
    draft = Eagle3.from_target(pair.target, subset_ids(pair), cfg.model.get("layers")).float().to(pair.device)
    if cfg.get("init"):
        warm_start(draft, Path(str(cfg.init)), pair.target)
    for folder, spec in caches:
        check_layers(folder, spec, draft)
    collate = make_collate(cfg, pair)
    t0 = time.time()
    trainer = _fit(cfg, pair, draft, train, run_dir, collate)
    agree = agreement(draft, pair.target, heldout_batches(held, cfg, collate), steps=int(cfg.eval_steps))
    info = {"command": "python -m train.eagle " + " ".join(sys.argv[1:]), "pair": pair.pair_id,
            "data": {"features": str(cfg.data.get("features", "on_the_fly")),
                     "folders": [str(f) for f in (cfg.data.cache_dirs if caches else cfg.data.folders)],  # as given
                     "sequences": len(train), "positions": n_pos, "heldout_sequences": len(held)},
            "init": str(cfg.init) if cfg.get("init") else None,
            "steps": int(trainer.global_step), "ttt_steps": int(cfg.train.ttt_steps),
            "layers": list(draft.cfg.layers), "vocab_subset": len(draft.ids), "train_minutes": (time.time() - t0) / 60,
            "heldout_top1_agreement_by_step": agree,
            "config": OmegaConf.to_container(cfg.train, resolve=True)}
    out = Path(str(cfg.out))
    draft.save(out, info)
    # the file's content fingerprint (decode rows record the same as `draft_weights`): eval.staleness tells which
    # draft made a result from this json even where the weights themselves are gitignored and not built
    out.with_suffix(".train.json").write_text(json.dumps({**info, "fingerprint": file_fingerprint(out)}, indent=1))
    print(json.dumps({"out": str(out), "heldout_top1_agreement_by_step": agree}, indent=1))
    return info


@hydra_entry("eagle")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
