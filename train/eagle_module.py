"""EAGLE-3 training pieces: the target's own responses as batches, the target's features and distributions computed
on the fly (`target_pass`) or read from the corpus's cache (`cached_pass`, train.feature_cache), and the Lightning
module that trains the draft with training-time test (models.eagle3.forward_steps).

Loss of TTT step j at row i (the draft having read tokens up to i + j + 1, its own outputs as features beyond step
0): cross-entropy of the draft's subset distribution against the target's distribution for token i + j + 2 (the
target's softmax at position i + j + 1, read on the draft's subset: the mass outside it is out of the draft's reach
and constant), on response tokens only, weighted 0.8^j (EAGLE-3's step weights). Agreement: the draft's top token
equals the target's, per step — the greedy acceptance of the j-th drafted token given the j − 1 before it were right.
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from models.eagle3 import target_features


def collate(items: list[dict], pad_id: int) -> dict:
    """Right-padded token ids, their lengths, response starts and domains."""
    width = max(len(it["ids"]) for it in items)
    x = torch.full((len(items), width), pad_id, dtype=torch.long)
    for r, it in enumerate(items):
        x[r, : len(it["ids"])] = torch.as_tensor(it["ids"], dtype=torch.long)
    return {"x": x, "lengths": torch.tensor([len(it["ids"]) for it in items]),
            "starts": torch.tensor([int(it["start"]) for it in items]), "domains": [it["domain"] for it in items]}


@torch.no_grad()
def target_pass(target, layers, batch: dict, ids: torch.Tensor):
    """(features (B, T, 3, H) float32 at `layers`, the target's log-probabilities on the subset `ids` (B, T, S) and
    its top token (B, T)) of a right-padded batch. The target's head runs only at the positions whose next token is
    a response token (the labels), zeros elsewhere."""
    x, lengths, starts = batch["x"], batch["lengths"], batch["starts"]
    dev = target.device
    pos = torch.arange(x.shape[1])[None]
    att = (pos < lengths[:, None]).long()
    feats, last = target_features(target, x, att, layers, last=True)
    need = ((pos >= starts[:, None] - 1) & (pos < lengths[:, None] - 1)).to(dev)
    z = target.lm_head(last[need]).float()
    logp = torch.zeros(*x.shape, len(ids), device=dev)
    logp[need] = z.log_softmax(-1)[:, ids.to(dev)]
    top = torch.zeros(x.shape, dtype=torch.long, device=dev)
    top[need] = z.argmax(-1)
    return feats, logp, top


def cached_pass(batch: dict, ids: torch.Tensor):
    """target_pass's triple from a batch that carries the cache (train.feature_cache.collate_cached): its features,
    and the teacher's top-k read on the subset `ids` as log-probabilities (−inf off the top-k: the loss gives those
    tokens no mass, as the target's mass outside the subset gets none). Equal to target_pass's when k covers the
    vocabulary; with a smaller k the loss drops the teacher's tail beyond its top-k."""
    dev = ids.device
    vals, idx = batch["topk_vals"].to(dev).float(), batch["topk_idx"].to(dev).long()
    where = torch.full((max(int(ids.max()), int(idx.max())) + 1,), len(ids), dtype=torch.long, device=dev)
    where[ids] = torch.arange(len(ids), device=dev)
    p = vals.new_zeros(*vals.shape[:-1], len(ids) + 1).scatter_add_(-1, where[idx], vals)  # last column: off subset
    return batch["feats"].to(dev), p[..., :-1].log(), idx[..., 0]


def batch_labels(target, draft, batch: dict):
    """(features, log-probabilities on the draft's subset, top token) of a batch: from the cache when the batch
    carries it (data.features=cached), else the target's pass over it."""
    if "feats" in batch:
        return cached_pass(batch, draft.ids)
    return target_pass(target, draft.cfg.layers, batch, draft.ids)


def step_targets(lengths, starts, T: int, j: int) -> torch.Tensor:
    """(B, T − 1) mask of the rows whose TTT step j predicts a response token inside the sequence: token i + j + 2."""
    pred = torch.arange(T - 1)[None] + j + 2
    return (pred < lengths[:, None]) & (pred >= starts[:, None])


def ttt_losses(draft, batch: dict, feats, logp, top, steps: int, weight: float = 0.8):
    """(weighted loss, per-step agreement counts [(agree, n)]) of one batch (module docstring); the draft's head
    runs only on the rows that have a label."""
    x, T = batch["x"], batch["x"].shape[1]
    outs = draft.forward_steps(x.to(feats.device), feats, steps)
    total, norm, counts = 0.0, 0.0, []
    for j, h in enumerate(outs):
        m = step_targets(batch["lengths"], batch["starts"], T, j).to(h.device)
        if not m.any():
            counts.append((0, 0))
            continue
        tgt = F.pad(logp[:, j + 1 :], (0, 0, 0, j))[:, : T - 1]  # row i: position i + j + 1, for token i + j + 2
        want = F.pad(top[:, j + 1 :], (0, j))[:, : T - 1]
        z = draft.logits(h[m])
        ce = -(tgt[m].exp() * z.float().log_softmax(-1)).sum(-1).mean()
        total, norm = total + weight**j * ce, norm + weight**j
        counts.append((int((draft.ids[z.argmax(-1)] == want[m]).sum()), int(m.sum())))
    return total / max(norm, 1e-9), counts


class EagleModule(L.LightningModule):
    """The draft as a LightningModule; the frozen target is held outside the module (not saved, not trained)."""

    def __init__(self, draft, target, tcfg: DictConfig):
        super().__init__()
        self.draft, self.tcfg = draft, tcfg
        object.__setattr__(self, "target", target)

    def training_step(self, batch, _):
        feats, logp, top = batch_labels(self.target, self.draft, batch)
        loss, counts = ttt_losses(self.draft, batch, feats, logp, top, int(self.tcfg.ttt_steps))
        self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["x"]))
        for j, (a, n) in enumerate(counts[:3]):
            if n:
                self.log(f"train/agree_step{j + 1}", a / n, prog_bar=j == 0, batch_size=n)
        return loss

    def configure_optimizers(self):
        t = self.tcfg
        opt = torch.optim.AdamW([p for p in self.draft.parameters() if p.requires_grad], lr=float(t.lr),
                                weight_decay=float(t.weight_decay), betas=(0.9, 0.95))
        warm, total = int(t.warmup_steps), max(int(t.max_steps), 1)

        def factor(step):
            if step < warm:
                return (step + 1) / warm
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(total - warm, 1))))

        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, factor),
                                                   "interval": "step"}}


@torch.no_grad()
def agreement(draft, target, batches, steps: int = 5) -> dict:
    """Held-out top-1 agreement per drafting step 1..steps, per domain and pooled: {domain: [a_1, …]}."""
    sums: dict[str, list[list[int]]] = {}
    draft.eval()
    for batch in batches:
        feats, logp, top = batch_labels(target, draft, batch)
        for dom in set(batch["domains"]):
            rows = torch.tensor([d == dom for d in batch["domains"]])
            sub = {"x": batch["x"][rows], "lengths": batch["lengths"][rows], "starts": batch["starts"][rows]}
            _, counts = ttt_losses(draft, sub, feats[rows], logp[rows], top[rows], steps)
            for key in (dom, "all"):
                acc = sums.setdefault(key, [[0, 0] for _ in range(steps)])
                for j, (a, n) in enumerate(counts):
                    acc[j][0] += a
                    acc[j][1] += n
    draft.train()
    return {k: [round(a / n, 4) if n else None for a, n in v] for k, v in sorted(sums.items())}
