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
`models.student.load_student(target, path)` or a pair config `draft: {source: student, weights: PATH}`. The
batches and the Lightning module and callback live in train/distill_module.py, the losses in train/distill_losses.py,
the data in train/distill_corpus.py, the student in train/distill_student.py, its measurement in train/distill_eval.py.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from models.pair import Pair, load_pair
from models.student import decoder_parts, layer_subset, load_student
from train.distill_corpus import CODE_VERSION, build_data, weighted
from train.distill_eval import describe, print_table
from train.distill_student import make_student, save_student, student_subset, warm_start
from utils.cli import UserError, hydra_entry


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
    last = run_dir / "checkpoints" / "last.ckpt"
    trainer = Trainer(
        accelerator="cuda" if pair.device.type == "cuda" else "cpu", devices=1, precision=train_precision(tcfg, pair),
        max_steps=int(tcfg.max_steps), gradient_clip_val=float(tcfg.grad_clip),
        callbacks=[snaps, ckpt, *stop_rules(tcfg.get("max_minutes"), last)], logger=CSVLogger(str(run_dir), name="csv"),
        log_every_n_steps=10, num_sanity_val_steps=0, use_distributed_sampler=False, enable_model_summary=False,
        default_root_dir=str(run_dir))
    resume = last if last.is_file() and cfg.get("resume", True) else None
    if resume is not None:
        print(f"resuming from {resume}", flush=True)
    trainer.fit(module, loader, ckpt_path=str(resume) if resume else None)
    if trainer.global_step < int(tcfg.max_steps):  # stopped by the time budget: keep exactly where it stands
        trainer.save_checkpoint(str(last))
    return trainer, snaps, len(loader)


def stop_rules(minutes, last) -> list:
    """Callbacks for how a long run ends and keeps its place at `last` (a checkpoint path):
    - after `minutes` of this invocation (none for null), stop cleanly (the caller then saves). Not Lightning's
      `max_time`: its Timer restores the time of the runs before from the checkpoint, so a resumed run whose earlier
      parts used up the budget stopped at once instead of going on for `minutes`;
    - on SIGTERM (a kill from the shell or a scheduler), save after the batch in flight. Lightning ends a run on
      SIGTERM by raising SystemExit past the caller's own save, so without this only the last periodic checkpoint
      survived (up to `ckpt_minutes` of training lost)."""
    import time

    from lightning import Callback
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    class Stop(Callback):
        def on_train_start(self, trainer, module):
            self.end = time.monotonic() + 60.0 * float(minutes) if minutes else float("inf")

        def on_train_batch_end(self, trainer, *args):
            if time.monotonic() >= self.end:
                trainer.should_stop = True

        def on_exception(self, trainer, module, exception):
            if isinstance(exception, SIGTERMException):
                trainer.save_checkpoint(str(last))
                print(f"SIGTERM: saved step {trainer.global_step} to {last}; rerun the command to resume", flush=True)

    return [Stop()]


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

    data = {"train": train, "positions": n_train_tokens, "data_minutes": t_data / 60}
    return _train_and_save(cfg, pair, layers, run_dir, out, data, evaluate)


def _train_and_save(cfg: DictConfig, pair: Pair, layers: list[int], run_dir: Path, out: Path, data: dict,
                    evaluate) -> dict:
    """Fit the student from its start (a warm start or the target's layers), measure it before and after, and write
    the best snapshot to `out` with its metrics beside it; a run stopped by `train.max_minutes` says how to go on."""
    target, train = pair.target, data["train"]
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
               "steps": trainer.global_step, "train_minutes": t_train / 60, "data_minutes": data["data_minutes"],
               "train_sequences": len(train), "train_positions": data["positions"],
               "positions_seen": int(trainer.global_step * data["positions"] / max(batches, 1)),
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
