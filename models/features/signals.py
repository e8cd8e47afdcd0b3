"""What a stop policy sees after one drafted token (`DraftStep`: q, its top-k and entropy, the hidden state, the
context) and what the last verification told (`VerifyStats`), with the one rule for which positions a verification
summarises (`compared`), shared by decode's loop, the replay and the trace columns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.distributions import on_support, support_entropy, support_topk
from models.features.layout import DEFAULT_TOPK


def disco_vector(topk: torch.Tensor, ent: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """DISCO's input: [top-k probs (k), entropy, position in round] as float32, shape (..., k + 2)."""
    return torch.cat([topk.float(), ent.float().unsqueeze(-1), position.float().unsqueeze(-1)], dim=-1)


def compared(drafted, accepted):
    """How many drafted positions a verification compared p with q at: up to and including the first rejection
    (all `drafted` when every one was accepted). Ints or numpy arrays alike."""
    import numpy as np

    return np.minimum(accepted + 1, drafted)


def all_accepted(drafted, accepted):
    """Whether a round kept everything it drafted (a round that drafted nothing did not). Ints or arrays alike."""
    return (drafted > 0) & (accepted == drafted)


@dataclass(frozen=True)
class VerifyStats:
    """What the last verification told (disco_plus `verify` group), computed by the loop only for policies that ask.

    target_entropy / target_margin: H_p and top-1 − top-2 of p at the last verified position (the one that produced
    the correction or bonus token the new round drafts after); drafted / accepted: the round's k and n; mean_tvd:
    mean TVD(p, q) over the round's drafted positions up to and including its first rejection.
    """

    target_entropy: float
    target_margin: float
    drafted: int
    accepted: int
    mean_tvd: float

    @classmethod
    def of(cls, target_entropy, target_margin, tvds, drafted: int, accepted: int) -> VerifyStats:
        """A round's statistics from H_p and the margin at its last verified position and the TVDs at its
        `compared` positions (a tensor or array): decode's loop and the replay read the same numbers this way."""
        mean = float(tvds.mean()) if len(tvds) else 0.0
        return cls(float(target_entropy), float(target_margin), int(drafted), int(accepted), mean)

    def values(self) -> list[float]:
        """The VERIFY columns in order (no verification yet: layout.NO_VERIFY)."""
        full = float(all_accepted(self.drafted, self.accepted))
        return [self.target_entropy, self.target_margin, float(self.accepted), full, self.mean_tvd]


@dataclass
class DraftStep:
    """What a stop policy sees after one drafted token (batch 1): q, its features, the hidden state, positions.

    `context` (prompt + committed output, the loop's own list: read it, never change it) and `verify` (the last
    verification's `VerifyStats`) are filled only for policies with `needs_context` / `needs_verify_stats`, so the
    others pay nothing; the tokens drafted earlier in the round are the policy's to remember.
    """

    probs: torch.Tensor  # (V,) float32 draft distribution the token was drafted from
    token: int
    hidden: torch.Tensor | None  # (d,) last hidden state that produced the logits
    position_in_round: int  # 0 for the first drafted token of a round
    position: int  # index of this token in the generated continuation
    _topk: torch.Tensor | None = None
    _entropy: torch.Tensor | None = None
    context: list[int] | None = None
    verify: VerifyStats | None = None
    # ids outside which probs is exactly 0 (a reduced-vocabulary draft, models.lm.LM.support): top-k and entropy
    # read only these — the same values (zeros add nothing), a sixth of the work on an 8k-of-49k FR-Spec draft
    support: torch.Tensor | None = None
    _on_support: torch.Tensor | None = None  # probs on the support, gathered once for top-k and entropy

    def _mass(self) -> torch.Tensor:
        if self._on_support is None:
            self._on_support = on_support(self.probs, self.support)
        return self._on_support

    def on_support(self) -> torch.Tensor:
        """q on `support` (all of q without one): what `logit_stats` compares the target's p with."""
        return self._mass()

    def topk(self, k: int = DEFAULT_TOPK) -> torch.Tensor:
        if self._topk is None or self._topk.shape[-1] != k:
            self._topk = support_topk(self.probs, k, self.support, self._mass())
        return self._topk

    @property
    def entropy(self) -> torch.Tensor:
        if self._entropy is None:
            self._entropy = support_entropy(self.probs, mass=self._mass())
        return self._entropy

    def disco(self, k: int = DEFAULT_TOPK) -> torch.Tensor:
        return disco_vector(self.topk(k), self.entropy, torch.tensor(float(self.position_in_round)))

