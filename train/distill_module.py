"""The distillation's training pieces: length-bucketed batches, and the Lightning module and
snapshot callback `train.distill` fits with (a module of its own so that importing train.distill, as
train.vocab_subset and bench/distill_metrics.py do, does not import Lightning)."""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from models.student import decoder_parts
from train.distill_losses import distill_loss


def subset_index(idx: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Teacher token ids → their rows in an FR-Spec subset head (`position[v]`: row of token v, -1 if absent)."""
    return position[idx.long()]


class LengthBatches(torch.utils.data.Sampler):
    """Batches of similar-length sequences (little padding), in a fresh random order every epoch. `rounds` (an item
    copy's index, from train.distill_corpus.weighted) sorts first, so a repeated item's copies land in different batches
    instead of side by side in one (same length) — each batch keeps batch_size distinct sequences."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int, rounds: list[int] | None = None):
        rounds = rounds or [0] * len(lengths)
        order = sorted(range(len(lengths)), key=lambda i: (rounds[i], lengths[i]))
        self.batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        self.rng = random.Random(seed)

    def __iter__(self):
        batches = list(self.batches)
        self.rng.shuffle(batches)
        return iter(batches)

    def __len__(self):
        return len(self.batches)


def collate(items: list[dict], pad_id: int) -> dict:
    """Right-padded inputs ids[:-1], and the teacher's top-k aligned to the positions that predict ids[start:]."""
    width = max(len(it["ids"]) for it in items) - 1
    k = items[0]["vals"].shape[-1]
    x = torch.full((len(items), width), pad_id, dtype=torch.long)
    att = torch.zeros_like(x)
    mask = torch.zeros((len(items), width), dtype=torch.bool)
    vals = torch.zeros((len(items), width, k), dtype=torch.float16)
    idx = torch.zeros((len(items), width, k), dtype=torch.int32)
    for r, it in enumerate(items):
        ids, s = it["ids"].long(), int(it["start"])
        n = len(ids) - 1
        x[r, :n], att[r, :n] = ids[:-1], 1
        mask[r, s - 1 : n] = True
        vals[r, s - 1 : n], idx[r, s - 1 : n] = it["vals"], it["idx"]
    return {"x": x, "att": att, "mask": mask, "vals": vals[mask], "idx": idx[mask],
            "prompts": [it["ids"][: int(it["start"])].tolist() for it in items]}


class DistillModule(L.LightningModule):
    """The student and its objective; the frozen shared embeddings/head are not optimised (nor checkpointed).

    With an FR-Spec subset (`subset`: the token ids the draft's head scores) the student is trained through that
    head: logits on the subset only, teacher tokens outside it counted in the rest bucket — the distribution the
    draft decodes with. The learning-rate schedule is in steps (warmup + cosine to `max_steps`), so a run resumed on
    another machine follows the same curve.
    """

    def __init__(self, student, vocab: int, tcfg: DictConfig, subset: torch.Tensor | None = None, teacher=None):
        super().__init__()
        self.student, self.vocab, self.tcfg = student, vocab, tcfg
        self.teacher = [teacher]  # a list: Lightning must neither move, train nor checkpoint the frozen target
        self.on_policy = float(tcfg.get("on_policy", 0.0))
        self.rng = random.Random(int(tcfg.get("seed", 0)))
        self.loss_name = str(tcfg.get("loss", "fkl"))
        self.loss = distill_loss(self.loss_name)  # conf/distill_loss/<name>.yaml; a bad name is one error line
        self.t0 = None
        self.strict_loading = False  # checkpoints hold only the trainable tensors
        if subset is not None:
            position = torch.full((vocab,), -1, dtype=torch.long)
            position[subset.long()] = torch.arange(len(subset))
            self.register_buffer("subset", subset.long(), persistent=False)
            self.register_buffer("position", position, persistent=False)
        else:
            self.subset = self.position = None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.student.lm_head.weight
        if self.subset is None:
            return F.linear(h, w)[:, : self.vocab]
        return F.linear(h, w[self.subset])

    @torch.no_grad()
    def student_batch(self, batch) -> dict:
        """DistillSpec's on-policy data: the student continues the batch's prompts (T = 1, its own head) and the
        teacher scores what it wrote — the sequences the draft will meet when it drafts."""
        from train.distill_data import generate, teacher_topk

        pair = self.teacher[0]
        k = batch["idx"].shape[-1]
        was = self.student.training
        self.student.eval()
        view = _StudentView(pair, self.student, self.subset)
        outs = generate(view, batch["prompts"], 1.0, int(self.tcfg.on_policy_tokens), 1, self.rng.randrange(2**31))
        self.student.train(was)
        seqs = [{"ids": p + o["cont"], "start": len(p)} for p, o in zip(batch["prompts"], outs) if o["cont"]]
        items = teacher_topk(pair, seqs, k, len(seqs))
        return collate([{**it, "ids": torch.as_tensor(it["ids"])} for it in items], pair.tokenizer.pad_token_id)

    def training_step(self, batch, _):
        if self.on_policy > 0 and self.rng.random() < self.on_policy:
            batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in self.student_batch(batch).items()}
        inner = decoder_parts(self.student)
        h = inner(input_ids=batch["x"], attention_mask=batch["att"]).last_hidden_state
        logits = self.logits(h[batch["mask"]])  # the head only where a loss is taken
        idx = batch["idx"] if self.position is None else subset_index(batch["idx"], self.position)
        per_pos = self.loss(logits, batch["vals"], idx)
        loss = per_pos.mean()
        if float(self.tcfg.ce_weight) > 0:
            top = idx[:, 0].long()
            keep = top >= 0
            loss = loss + float(self.tcfg.ce_weight) * F.cross_entropy(logits.float()[keep], top[keep])
        self.log(f"train/{self.loss_name}", per_pos.mean(), prog_bar=True)
        self.log("train/tokens", float(batch["mask"].sum()), reduce_fx="sum")
        return loss

    def on_train_start(self):
        self.t0 = time.time()

    def on_save_checkpoint(self, checkpoint):
        keep = {n for n, p in self.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}

    def progress(self, step: int) -> float:
        return min(step / max(int(self.tcfg.max_steps), 1), 1.0)

    def configure_optimizers(self):
        params = [p for p in self.student.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=float(self.tcfg.lr), weight_decay=float(self.tcfg.weight_decay),
                                betas=(0.9, 0.98))
        warm = int(self.tcfg.warmup_steps)

        def factor(step):
            if step < warm:
                return (step + 1) / warm
            return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * self.progress(step)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _StudentView:
    """The student dressed as a pair's target for `train.distill_data.generate` (which samples from `.target`),
    restricted to its FR-Spec subset when it has one (`logit_mask`: -inf outside the subset)."""

    def __init__(self, pair, student, subset):
        self.tokenizer, self.vocab_size, self.device, self.target = pair.tokenizer, pair.vocab_size, pair.device, student
        self.logit_mask = None if subset is None else (
            torch.full((pair.vocab_size,), float("-inf")).index_fill_(0, subset.cpu(), 0.0))


class Snapshots(L.Callback):
    """Every `val_every` steps (and at the end): held-out Σmin(p,q); write last and best student files."""

    def __init__(self, run_dir: Path, every: int, evaluate, save):
        self.run_dir, self.every, self.evaluate, self.save = run_dir, every, evaluate, save
        self.best, self.history = -1.0, []

    def state_dict(self):  # kept in the training checkpoint, so a resumed run knows its best snapshot
        return {"best": self.best, "history": self.history}

    def load_state_dict(self, state):
        self.best, self.history = float(state["best"]), list(state["history"])

    def check(self, trainer, module):
        step = trainer.global_step
        if self.history and self.history[-1]["step"] == step:
            return
        module.student.eval()
        bf16 = "bf16" in str(trainer.precision)
        with torch.autocast(module.device.type, dtype=torch.bfloat16, enabled=bf16):
            row = self.evaluate(module.student)
        module.student.train()
        row.update(step=step, minutes=(time.time() - module.t0) / 60 if module.t0 else 0.0)
        self.history.append(row)
        if trainer.logger is not None:  # straight to the logger: self.log is not allowed in on_train_end
            trainer.logger.log_metrics({f"val/{k}": float(v) for k, v in row.items()
                                        if isinstance(v, (int, float))}, step=step)
        self.save(module.student, self.run_dir / "student-last.safetensors", row)
        if row["heldout_sum_min"] > self.best:
            self.best = row["heldout_sum_min"]
            shutil.copyfile(self.run_dir / "student-last.safetensors", self.run_dir / "student-best.safetensors")
        print(f"\n[step {step}, {row['minutes']:.1f} min] held-out Σmin {row['heldout_sum_min']:.3f} "
              f"greedy {row['heldout_greedy_agree']:.3f} text {row['heldout_text_sum_min']:.3f}", flush=True)
        with open(self.run_dir / "history.json", "w") as fh:
            json.dump(self.history, fh, indent=1)

    def on_train_batch_end(self, trainer, module, *_):
        if self.every > 0 and trainer.global_step % self.every == 0:
            self.check(trainer, module)

    def on_train_end(self, trainer, module):
        self.check(trainer, module)
