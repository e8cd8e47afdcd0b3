"""Stop heads: draft features → acceptance logit, and the checkpoint bundle decode/eval load.

Three architectures behind one interface (`StopHead`: raw features in, logit out, normalisation inside):
- `disco`: DISCO's shallow 2-layer FFN on [top-10 probs, entropy, position in round] (dim 12).
- `sprinter`: SPRINTER's single linear layer (+ sigmoid) on the draft's last hidden state.
- `specdecpp`: SpecDec++'s prediction head, residual blocks x + SiLU(W_i x + b_i) (independent weights per block)
  then a linear readout, on the draft hidden state.

`train` saves a Lightning checkpoint whose `specstop` entry holds everything decode needs (feature spec, label
scheme, threshold, pair id, tokenizer hash, architecture); `load_head(path)` rebuilds a `HeadBundle` from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from models.features import FeatureSpec
from utils.cli import UserError

CKPT_KEY = "specstop"
KIND_FEATURES = {"disco": "disco", "sprinter": "hidden", "specdecpp": "hidden"}


class DiscoFFN(nn.Module):
    """DISCO: Linear(dim, hidden) → ReLU → Linear(hidden, 1)."""

    def __init__(self, in_dim: int, hidden: int = 64, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


class SprinterLinear(nn.Module):
    """SPRINTER: one linear layer on the hidden state (the sigmoid is applied by `HeadBundle.prob`)."""

    def __init__(self, in_dim: int):
        super().__init__()
        self.linear = nn.Linear(in_dim, 1)

    def forward(self, x):
        return self.linear(x).squeeze(-1)


class ResBlock(nn.Module):
    """x + SiLU(W x + b); zero-initialised W so a fresh stack starts as the identity."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


class SpecDecPPHead(nn.Module):
    """SpecDec++: `num_blocks` ResBlocks (independent weights) then Linear(dim, 1)."""

    def __init__(self, in_dim: int, num_blocks: int = 3):
        super().__init__()
        self.blocks = nn.Sequential(*[ResBlock(in_dim) for _ in range(num_blocks)])
        self.out = nn.Linear(in_dim, 1)

    def forward(self, x):
        return self.out(self.blocks(x)).squeeze(-1)


ARCHS = {"disco": DiscoFFN, "sprinter": SprinterLinear, "specdecpp": SpecDecPPHead}


class StopHead(nn.Module):
    """Raw features (..., dim) → acceptance logit (...): (x − mean) / std, then the architecture.

    mean/std are buffers fitted on the training split, so they travel with the weights in every checkpoint.
    """

    def __init__(self, kind: str, in_dim: int, arch: dict | None = None):
        super().__init__()
        if kind not in ARCHS:
            raise UserError(f"unknown head kind '{kind}'; known: {', '.join(ARCHS)}")
        self.kind = kind
        self.net = ARCHS[kind](in_dim, **dict(arch or {}))
        self.register_buffer("mean", torch.zeros(in_dim))
        self.register_buffer("std", torch.ones(in_dim))

    def set_normalization(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Fit on the training features; constant columns keep std 1 (they carry no signal)."""
        std = torch.where(std > 1e-6, std, torch.ones_like(std))
        self.mean.copy_(mean.float())
        self.std.copy_(std.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x.float() - self.mean) / self.std)


def build_head(kind: str, spec: FeatureSpec, arch: dict | None = None) -> StopHead:
    """A fresh head for a kind; refuses a feature spec the kind cannot read."""
    want = KIND_FEATURES.get(kind)
    if want is None:
        raise UserError(f"unknown head kind '{kind}'; known: {', '.join(ARCHS)}")
    if spec.kind != want:
        raise UserError(f"head kind '{kind}' reads '{want}' features, not '{spec.kind}'")
    if spec.dim <= 0:
        raise UserError(f"head kind '{kind}' needs hidden states; regenerate traces with trace.store_hidden=true")
    return StopHead(kind, spec.dim, arch)


@dataclass
class HeadBundle:
    """A trained head with what decode/eval need to use it safely (see module docstring)."""

    head: StopHead
    kind: str
    spec: FeatureSpec
    labels: dict
    threshold: float
    pair_id: str
    tokenizer_hash: str
    arch: dict = field(default_factory=dict)
    path: str | None = None

    @torch.no_grad()
    def prob(self, x: torch.Tensor) -> torch.Tensor:
        """Acceptance probability from RAW features (..., spec.dim); normalisation happens inside the head."""
        x = torch.as_tensor(x)
        if x.shape[-1] != self.spec.dim:
            raise UserError(f"head expects features of size {self.spec.dim} ({self.spec.kind}), got {x.shape[-1]}")
        return torch.sigmoid(self.head(x.to(self.head.mean.device)))

    @torch.no_grad()
    def scorer(self):
        """A function raw features (spec.dim,) → P(accept) as a float, for one drafted token at a time in decode.

        Same numbers as `prob` (a test checks), fewer ops: for the heads that start with a linear layer (DISCO,
        SPRINTER) the (x − mean) / std normalisation is folded into that layer and the layers run as bare tensor ops,
        because walking the module tree cost ~30 µs per drafted token against ~8 for the folded form. Build it after
        moving the head to its device; it reads a snapshot of the weights.
        """
        net, mean, std = self.head.net, self.head.mean, self.head.std
        first = net.net[0] if isinstance(net, DiscoFFN) else net.linear if isinstance(net, SprinterLinear) else None
        if first is None:
            return lambda x: float(self.prob(x))
        w1 = (first.weight / std).detach().clone()
        b1 = (first.bias - w1 @ mean).detach().clone()
        if isinstance(net, SprinterLinear):
            w, b = w1[0], b1
            return lambda x: float(torch.sigmoid(torch.dot(w, x) + b))
        last = net.net[-1]
        w2, b2 = last.weight[0].detach().clone(), last.bias.detach().clone()
        return lambda x: float(torch.sigmoid(torch.dot(w2, torch.relu(torch.addmv(b1, w1, x))) + b2))

    def check_pair(self, pair) -> None:
        """Refuse a pair this head was not trained for (pair id, tokenizer, draft hidden size)."""
        where = f" ({self.path})" if self.path else ""
        if pair.pair_id != self.pair_id or pair.tokenizer_hash != self.tokenizer_hash:
            raise UserError(
                f"head{where} was trained on pair {self.pair_id} (tokenizer {self.tokenizer_hash}) but this run uses "
                f"pair {pair.pair_id} (tokenizer {pair.tokenizer_hash}); train a head for this pair or pick its pair="
            )
        if self.spec.kind == "hidden":
            d = int(pair.draft.config.hidden_size)
            if d != self.spec.d:
                raise UserError(
                    f"head{where} reads draft hidden states of size {self.spec.d} but pair {pair.pair_id}'s draft has {d}"
                )

    def meta(self) -> dict:
        """What the checkpoint stores under `specstop` (also the bundle's description)."""
        return {
            "kind": self.kind,
            "spec": self.spec.to_dict(),
            "labels": dict(self.labels),
            "threshold": float(self.threshold),
            "pair_id": self.pair_id,
            "tokenizer_hash": self.tokenizer_hash,
            "arch": dict(self.arch),
        }


def load_head(path: str | Path, map_location: str | torch.device = "cpu") -> HeadBundle:
    """Rebuild a `HeadBundle` from a `python -m train` checkpoint (UserError when missing or not a head)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"head checkpoint {path} not found; train one with `python -m train +experiment=...`")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user mistake
        raise UserError(f"{path} is not a readable checkpoint ({type(err).__name__}); pass a head .ckpt from train") from None
    meta = ckpt.get(CKPT_KEY) if isinstance(ckpt, dict) else None
    if not meta:
        raise UserError(f"{path} is not a stop-head checkpoint (no '{CKPT_KEY}' entry); pass a .ckpt written by train")
    spec = FeatureSpec(**meta["spec"])
    head = StopHead(meta["kind"], spec.dim, meta.get("arch"))
    state = {k[len("head."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("head.")}
    head.load_state_dict(state)
    head.eval()
    return HeadBundle(
        head=head,
        kind=meta["kind"],
        spec=spec,
        labels=dict(meta["labels"]),
        threshold=float(meta["threshold"]),
        pair_id=str(meta["pair_id"]),
        tokenizer_hash=str(meta["tokenizer_hash"]),
        arch=dict(meta.get("arch") or {}),
        path=str(path),
    )
