"""Draft-side features: the one definition data_gen stores and decode computes, so a head sees the same inputs.

For a drafted position with draft logits z (and last hidden state h):
- the draft distribution q = softmax(z / T) for sampling at temperature T, softmax(z) for greedy (T = 0);
- DISCO: the top-k probabilities of q sorted descending (k = 10), the entropy H_q in nats, and the position of the
  token in its draft round (0 = first drafted token) — `disco_vector` stacks them;
- SPRINTER / SpecDec++: h itself, the last-layer hidden state that produced z (after the final norm).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DEFAULT_TOPK = 10


def draft_probs(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0) -> torch.Tensor:
    """q over the vocabulary, in float32. Greedy (T=0) reports the T=1 distribution; top-p truncates and renormalises."""
    logits = logits.float()
    if temperature and temperature > 0:
        logits = logits / temperature
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        probs = top_p_filter(probs, top_p)
    return probs


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose mass reaches top_p (always the top one), renormalised."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    sorted_p = torch.where(mass_before < top_p, sorted_p, torch.zeros_like(sorted_p))
    out = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return out / out.sum(-1, keepdim=True)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats along the last axis (0·log 0 = 0)."""
    return -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)


def tvd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Total variation distance ½Σ|p − q| along the last axis (1 − TVD is the exact-sampling acceptance rate)."""
    return 0.5 * (p - q).abs().sum(-1)


def topk_probs(probs: torch.Tensor, k: int = DEFAULT_TOPK, chunk: int = 256) -> torch.Tensor:
    """The k largest probabilities, sorted descending (the values of `probs.topk(k)`, bit for bit).

    Two-stage, because a full top-k over a 49k vocabulary was the largest cost of the DISCO policy per drafted token
    (~90 µs on one CPU core; this takes ~25): split the vocabulary into chunks, keep the k chunks with the largest
    maxima, take the top-k of those. Exact: an element outside those chunks has k larger chunk maxima above it, so it
    cannot be among the k largest. The tail that does not fill a chunk is always kept.
    """
    vocab = probs.shape[-1]
    n = vocab // chunk
    if n < 2 * k:
        return probs.topk(k, dim=-1).values
    lead = probs.shape[:-1]
    body = probs[..., : n * chunk].reshape(*lead, n, chunk)
    best = body.amax(-1).topk(k, dim=-1).indices
    cand = body.gather(-2, best.unsqueeze(-1).expand(*lead, k, chunk)).flatten(-2)
    if n * chunk < vocab:
        cand = torch.cat([cand, probs[..., n * chunk :]], dim=-1)
    return cand.topk(k, dim=-1).values


def disco_vector(topk: torch.Tensor, ent: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """DISCO's input: [top-k probs (k), entropy, position in round] as float32, shape (..., k + 2)."""
    return torch.cat([topk.float(), ent.float().unsqueeze(-1), position.float().unsqueeze(-1)], dim=-1)


@dataclass(frozen=True)
class FeatureSpec:
    """What a head reads; stored in its checkpoint and checked by decode/eval against the pair and traces.

    kind: `disco` (top-k + entropy + position) or `hidden` (the draft's last hidden state of size d).
    """

    kind: str
    k: int = DEFAULT_TOPK
    d: int = 0

    @property
    def dim(self) -> int:
        return self.k + 2 if self.kind == "disco" else self.d

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DraftStep:
    """What a stop policy sees after one drafted token (batch 1): q, its features, the hidden state, positions."""

    probs: torch.Tensor  # (V,) float32 draft distribution the token was drafted from
    token: int
    hidden: torch.Tensor | None  # (d,) last hidden state that produced the logits
    position_in_round: int  # 0 for the first drafted token of a round
    position: int  # index of this token in the generated continuation
    _topk: torch.Tensor | None = None
    _entropy: torch.Tensor | None = None

    def topk(self, k: int = DEFAULT_TOPK) -> torch.Tensor:
        if self._topk is None or self._topk.shape[-1] != k:
            self._topk = topk_probs(self.probs, k)
        return self._topk

    @property
    def entropy(self) -> torch.Tensor:
        if self._entropy is None:
            self._entropy = entropy(self.probs)
        return self._entropy

    def disco(self, k: int = DEFAULT_TOPK) -> torch.Tensor:
        return disco_vector(self.topk(k), self.entropy, torch.tensor(float(self.position_in_round)))


# ------------------------------------------------------------------------------------ trace columns → head inputs


def _np(x):
    import numpy as np

    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    arr = np.asarray(x)
    return arr if arr.flags.writeable or arr.dtype == object else arr.copy()


def continuation_starts(columns: dict):
    """Bool per trace row: the first row of a continuation (new prompt_id or kind, or the position not increasing)."""
    import numpy as np

    pos = _np(columns["position"]).astype(np.int64)
    starts = np.ones(len(pos), dtype=bool)
    if len(pos) > 1:
        same = pos[1:] > pos[:-1]
        for key in ("prompt_id", "kind"):
            if key in columns:
                col = _np(columns[key])
                same &= col[1:] == col[:-1]
        starts[1:] = ~same
    return starts


def trace_round_positions(columns: dict):
    """Position in the draft round for each trace row: rounds cut after each greedy mismatch (draft ≠ argmax p)."""
    import numpy as np

    accepted = _np(columns["draft_token"]) == _np(columns["target_token"])
    starts = continuation_starts(columns)
    # a row starts a round at a continuation start or right after a rejected row; position = rows since that start
    n = len(accepted)
    reset = np.zeros(n, dtype=bool)
    reset[0:1] = True
    reset[1:] = starts[1:] | ~accepted[:-1]
    idx = np.arange(n)
    last_reset = np.maximum.accumulate(np.where(reset, idx, 0))
    return idx - last_reset


def features_from_columns(columns: dict, spec: FeatureSpec) -> torch.Tensor:
    """Head input (N, spec.dim) float32 from trace columns (a dict of arrays), the same vector decode builds per step.

    disco: [draft_topk[:, :k], draft_entropy, position in round] (`disco_vector`; the round position comes from
    `trace_round_positions`); hidden: draft_hidden as float32.
    """
    if spec.kind == "disco":
        topk = torch.as_tensor(_np(columns["draft_topk"]), dtype=torch.float32)
        if topk.ndim != 2 or topk.shape[1] < spec.k:
            raise ValueError(f"draft_topk has shape {tuple(topk.shape)}; the feature spec needs k={spec.k}")
        ent = torch.as_tensor(_np(columns["draft_entropy"]), dtype=torch.float32)
        pos = torch.as_tensor(trace_round_positions(columns), dtype=torch.float32)
        return disco_vector(topk[:, : spec.k], ent, pos)
    if spec.kind == "hidden":
        hidden = torch.as_tensor(_np(columns["draft_hidden"])).float()
        if hidden.ndim != 2 or hidden.shape[1] != spec.d:
            raise ValueError(f"draft_hidden has shape {tuple(hidden.shape)}; the feature spec needs d={spec.d}")
        return hidden
    raise ValueError(f"unknown feature kind '{spec.kind}'")
