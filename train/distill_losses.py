"""Distillation losses: the student's per-position divergence from the teacher, whose distribution is known on its
top-k tokens plus one bucket for the rest of the vocabulary (`buckets`). One `DistillLoss` class per divergence,
named by `train.loss=NAME` and found as conf/distill_loss/<name>.yaml (its `_target_`), so adding a loss is one
class plus one yaml. DistillSpec's choices (Zhou et al. 2024): forward KL, total variation, Jensen-Shannon."""

from __future__ import annotations

import math

import torch


def buckets(logits: torch.Tensor, vals: torch.Tensor, idx: torch.Tensor):
    """(p, log q) on k + 1 buckets — the teacher's kept tokens and one bucket for the rest of the vocabulary.

    An index of -1 marks a teacher token the student cannot emit (outside an FR-Spec subset): its mass joins the
    rest bucket, where q has what the student gives the tokens not kept.
    """
    logq = torch.log_softmax(logits.float(), -1)
    ok = idx >= 0
    lq = logq.gather(-1, idx.clamp_min(0).long()).masked_fill(~ok, -math.inf)
    p = vals.float().masked_fill(~ok, 0.0)
    p_rest = (1 - p.sum(-1, keepdim=True)).clamp_min(0)
    q_rest = (1 - lq.exp().sum(-1, keepdim=True)).clamp_min(1e-8)
    return torch.cat([p, p_rest], -1), torch.cat([lq, q_rest.log()], -1)


def _kl(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Σ p (log p − log q) over buckets, 0·log 0 = 0."""
    return (p * (p.clamp_min(1e-12).log() - logq.clamp_min(-1e4))).sum(-1)


def topk_kl(logits: torch.Tensor, vals: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL(p||q) with p known on k tokens + the rest mass: (KL, cross-entropy), both (N,).

    CE = -Σ_k p_i log q_i - p_rest log q_rest, where q_rest = 1 - Σ_k q_i; KL = CE - H(p) with the same grouping.
    """
    p, logq = buckets(logits, vals, idx)
    ce = -(p * logq.clamp_min(-1e4)).sum(-1)
    return _kl(p, logq), ce


class DistillLoss:
    """`loss(logits (N, V), teacher vals (N, k), teacher ids (N, k)) -> (N,)` per-position divergence."""

    def __init__(self, name: str | None = None):
        self.name = name

    def __call__(self, logits: torch.Tensor, vals: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self.divergence(*buckets(logits, vals, idx))

    def divergence(self, p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class ForwardKL(DistillLoss):
    """KL(p||q): mode-covering."""

    def divergence(self, p, logq):
        return _kl(p, logq)


class TotalVariation(DistillLoss):
    """½Σ|p − q|: what 1 − acceptance measures under exact sampling."""

    def divergence(self, p, logq):
        return 0.5 * (p - logq.exp()).abs().sum(-1)


class JensenShannon(DistillLoss):
    """½KL(p||m) + ½KL(q||m), m = (p + q)/2."""

    def divergence(self, p, logq):
        q = logq.exp()
        m_log = (0.5 * (p + q)).clamp_min(1e-12).log()
        return 0.5 * (p * (p.clamp_min(1e-12).log() - m_log)).sum(-1) + 0.5 * (q * (logq.clamp_min(-1e4) - m_log)).sum(-1)


def distill_loss(name: str) -> DistillLoss:
    """The loss `train.loss=NAME` names (conf/distill_loss/<name>.yaml on the config search path)."""
    from utils import discover

    return discover.build("distill_loss", {"name": name}, DistillLoss, what=f"train.loss={name}")
