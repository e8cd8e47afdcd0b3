"""Stop heads: draft features → acceptance logit, and the checkpoint bundle decode/eval load.

Head families behind one interface (`StopHead`: raw features in, logit out, normalisation inside); a family is
`conf/model/<kind>.yaml`, whose `arch._target_` names its network class, and the class declares what differs between
families (`features`: the feature kind it reads; `raw_input`, `inert_constant_columns`, `cumulative`, `verifier`,
`arch_for`, `fast_scorer`), so nothing here compares kind names and a new family is one class + one yaml:
- `disco`: DISCO's shallow 2-layer FFN on [top-10 probs, entropy, position in round] (dim 12).
- `sprinter`: SPRINTER's single linear layer (+ sigmoid) on the draft's last hidden state.
- `specdecpp`: SpecDec++'s prediction head, residual blocks x + SiLU(W_i x + b_i) (independent weights per block)
  then a linear readout, on the draft hidden state.
- `c2t` / `tree_node` / `tree_node_plus`: the DISCO network on a token-tree node's row (models.features.nodes' node
  kinds), predicting whether the node is on the path greedy verification accepts (labels=on_path); decode's tree
  builders score nodes.
- `disco_plus`: logit = a·logit(max q) + FFN(features) on the disco_plus features (models.features.chain), token ids
  through hashed embeddings. The FFN's output layer starts at zero and a at 1, so a fresh head *is* the max-q
  score and training moves away from it only where the extra features pay.

Calibration: `HeadBundle.calibration` = {temperature T, bias b} maps a logit z to sigmoid(z / T + b); train fits it on
validation (models.calibration.fit_calibration: temperature scaling, plus a bias under `calibration=platt` — pos_weight
and the train/test acceptance shift move the base rate, which a temperature alone cannot fix) and decode/eval apply it.

`train` saves a Lightning checkpoint whose `specstop` entry holds everything decode needs (feature spec, label
scheme, threshold, pair id, tokenizer hash, architecture); `load_head(path)` rebuilds a `HeadBundle` from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from models.features.spec import FeatureSpec
from utils.cli import UserError

CKPT_KEY = "specstop"


class HeadNet(nn.Module):
    """A head family's network: (normalised) features → logit. Class attributes say how StopHead and decode treat it."""

    features = ""  # the feature kind it reads (models.features.kind.FeatureKind.name)
    raw_input = False  # forward(xn, x): also gets the raw features (not only the normalised ones)
    inert_constant_columns = False  # a column constant in training enters as 0 (std = inf) rather than std = 1
    cumulative = False  # its policy stops when 1 − Π P(accept) over the round exceeds the threshold (SpecDec++)
    verifier = False  # it decides approximate verification (SPRINTER): eval adds the SPRINTER theory report

    @classmethod
    def arch_for(cls, spec: FeatureSpec, arch: dict) -> dict:
        """The constructor's keyword arguments for a spec (the family may add what the spec decides)."""
        return arch

    def fast_scorer(self, mean, std, t: float, c: float):
        """Raw features (dim,) → calibrated P(accept) as bare tensor ops (HeadBundle.scorer); None: use the module."""
        return None

    def fast_rows(self, mean, std, t: float, c: float):
        """Raw feature rows (n, dim) float32 numpy → calibrated P (n,) in numpy (HeadBundle.row_scorer); None: use the
        module."""
        return None


class DiscoFFN(HeadNet):
    """DISCO: Linear(dim, hidden) → ReLU → Linear(hidden, 1)."""

    features = "disco"

    def __init__(self, in_dim: int, hidden: int = 64, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)

    def _folded(self, mean, std, t, c):
        """(w1, b1, w2, b2): the first layer with the normalisation folded in, the last with the calibration."""
        w1, b1 = _fold(self.net[0], mean, std)
        last = self.net[-1]
        return w1, b1, (last.weight[0] / t).detach().clone(), (last.bias / t + c).detach().clone()

    def fast_scorer(self, mean, std, t, c):
        w1, b1, w2, b2 = self._folded(mean, std, t, c)
        return lambda x: float(torch.sigmoid(torch.dot(w2, torch.relu(torch.addmv(b1, w1, x))) + b2))

    def fast_rows(self, mean, std, t, c):
        import numpy as np
        from scipy.special import expit  # the sigmoid without exp's overflow at very negative logits

        w1, b1, w2, b2 = (v.cpu().numpy() for v in self._folded(mean, std, t, c))
        w1, b2 = np.ascontiguousarray(w1.T), float(b2[0])

        def rows(x):
            return expit(np.maximum(x @ w1 + b1, 0.0) @ w2 + b2)

        return rows


class C2TFFN(DiscoFFN):
    """C2T (arXiv 2502.13652): the same 2-layer FFN on a candidate-tree node's [joint, parent entropy, depth]."""

    features = "c2t"


class TreeNodeFFN(DiscoFFN):
    """The richer node head: the same 2-layer FFN on `tree_node` rows (models.features.nodes.TreeNodeFeatures)."""

    features = "tree_node"


class TreeNodePlusFFN(DiscoFFN):
    """The same 2-layer FFN on `tree_node_plus` rows (tree_node's + the verify and copy node groups,
    models.features.nodes.TreeNodePlusFeatures)."""

    features = "tree_node_plus"


class SprinterLinear(HeadNet):
    """SPRINTER: one linear layer on the hidden state (the sigmoid is applied by `HeadBundle.prob`)."""

    features = "hidden"
    verifier = True

    def __init__(self, in_dim: int):
        super().__init__()
        self.linear = nn.Linear(in_dim, 1)

    def forward(self, x):
        return self.linear(x).squeeze(-1)

    def fast_scorer(self, mean, std, t, c):
        w1, b1 = _fold(self.linear, mean, std)
        w, b = w1[0] / t, b1 / t + c
        return lambda x: float(torch.sigmoid(torch.dot(w, x) + b))


def _fold(first: nn.Linear, mean, std):
    """A first linear layer with the (x − mean) / std normalisation folded in: (W / std, b − (W / std) · mean)."""
    w1 = (first.weight / std).detach().clone()
    return w1, (first.bias - w1 @ mean).detach().clone()


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


class SpecDecPPHead(HeadNet):
    """SpecDec++: `num_blocks` ResBlocks (independent weights) then Linear(dim, 1); stops on 1 − Π P(accept)."""

    features = "hidden"
    cumulative = True

    def __init__(self, in_dim: int, num_blocks: int = 3):
        super().__init__()
        self.blocks = nn.Sequential(*[ResBlock(in_dim) for _ in range(num_blocks)])
        self.out = nn.Linear(in_dim, 1)

    def forward(self, x):
        return self.out(self.blocks(x)).squeeze(-1)


class DiscoPlus(HeadNet):
    """logit = a·logit(max q) + FFN([normalised dense features, hashed token embeddings]); a=1, FFN output 0 at init.

    Takes (normalised x, raw x): max q (column 0) enters through its raw logit, token-id columns (`token_cols`) as
    integers hashed into `buckets` rows of one embedding table per column. A column constant in training is made
    inert: its features can take values at decode that training never showed (the all-accepted flag: always 0 on
    target_ar trace rounds), and an untrained first-layer weight would turn them into noise.
    """

    features = "disco_plus"
    raw_input = True
    inert_constant_columns = True

    @classmethod
    def arch_for(cls, spec, arch):
        return {**arch, "token_cols": spec.token_columns()}

    def __init__(self, in_dim: int, token_cols: list | None = None, hidden: int = 64, dropout: float = 0.0,
                 buckets: int = 4096, emb: int = 8):
        super().__init__()
        self.token_cols = [int(c) for c in (token_cols or [])]
        self.dense_cols = [i for i in range(in_dim) if i not in self.token_cols]
        self.buckets = int(buckets)
        self.embs = nn.ModuleList([nn.Embedding(self.buckets, emb) for _ in self.token_cols])
        width = len(self.dense_cols) + emb * len(self.token_cols)
        self.ffn = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 1))
        nn.init.zeros_(self.ffn[-1].weight)
        nn.init.zeros_(self.ffn[-1].bias)
        self.a = nn.Parameter(torch.ones(()))

    def forward(self, xn, x):
        maxq = x[..., 0].clamp(1e-6, 1 - 1e-6)
        parts = [xn[..., self.dense_cols]]
        for col, emb in zip(self.token_cols, self.embs):
            ids = x[..., col].long().clamp_min(0)
            parts.append(emb((ids * 2654435761) % self.buckets))  # Knuth's multiplicative hash
        return self.a * torch.logit(maxq) + self.ffn(torch.cat(parts, dim=-1)).squeeze(-1)

    def fast_scorer(self, mean, std, t, c):
        """Normalisation folded into the first layer's dense columns, each token column's embedding table
        pre-multiplied by its slice of that layer (one row read per id), calibration in the output."""
        lin1, lin2 = self.ffn[0], self.ffn[-1]
        # the token columns come last in FeatureSpec order, so the dense ones are usually a prefix: a view, no gather
        prefix = self.dense_cols == list(range(len(self.dense_cols)))
        dense = slice(0, len(self.dense_cols)) if prefix else torch.tensor(self.dense_cols, device=mean.device)
        nd, emb = len(self.dense_cols), (self.embs[0].embedding_dim if len(self.embs) else 0)
        wd = (lin1.weight[:, :nd] / std[dense]).detach().clone()
        bd = (lin1.bias - wd @ mean[dense]).detach().clone()
        tables = [(col, (e.weight @ lin1.weight[:, nd + i * emb : nd + (i + 1) * emb].T).detach().clone())
                  for i, (col, e) in enumerate(zip(self.token_cols, self.embs))]
        w2, b2 = (lin2.weight[0] / t).detach().clone(), float(lin2.bias / t + c)
        a, buckets = float(self.a / t), self.buckets

        def score(x):
            h = torch.addmv(bd, wd, x[dense])
            for col, table in tables:
                h = h + table[(max(int(x[col]), 0) * 2654435761) % buckets]
            q = min(max(float(x[0]), 1e-6), 1 - 1e-6)
            return 1.0 / (1.0 + math.exp(-(a * math.log(q / (1 - q)) + float(torch.dot(w2, torch.relu(h))) + b2)))

        return score


def head_kinds() -> list[str]:
    """The head families: conf/model/*.yaml on the config search path."""
    from utils import discover

    return discover.names("model")


def head_family(kind: str, arch: dict | None = None) -> type[HeadNet]:
    """A head family's network class: `arch._target_` when given (a checkpoint records it), else the one
    conf/model/<kind>.yaml names (found by name on the config search path)."""
    from utils import discover

    target = (arch or {}).get("_target_")
    if target is None:
        cfg = discover.load("model", kind)
        if cfg is None:
            raise UserError(f"unknown head kind '{kind}'; known: {', '.join(head_kinds())}")
        target = (cfg.get("arch") or {}).get("_target_")
    return discover.target_class(target, HeadNet, f"head kind '{kind}' (conf/model/{kind}.yaml arch)")


class StopHead(nn.Module):
    """Raw features (..., dim) → acceptance logit (...): (x − mean) / std, then the family's network.

    mean/std are buffers fitted on the training split, so they travel with the weights in every checkpoint.
    """

    def __init__(self, kind: str, in_dim: int, arch: dict | None = None):
        super().__init__()
        from hydra.utils import instantiate

        arch = dict(arch or {})
        family = head_family(kind, arch)
        self.kind = kind
        # built from the family's yaml node (`arch`: `_target_` + keyword arguments); called outside instantiate so a
        # bad argument fails as the constructor's own error
        self.net = instantiate({**arch, "_target_": family}, _partial_=True, _convert_="all")(in_dim)
        self.register_buffer("mean", torch.zeros(in_dim))
        self.register_buffer("std", torch.ones(in_dim))

    def set_normalization(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        """Fit on the training features; constant columns keep std 1 (they carry no signal), or std = inf (input 0)
        for a family that declares `inert_constant_columns`."""
        fill = torch.full_like(std, math.inf) if self.net.inert_constant_columns else torch.ones_like(std)
        std = torch.where(std > 1e-6, std, fill)
        self.mean.copy_(mean.float())
        self.std.copy_(std.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.net.raw_input:
            return self.net((x - self.mean) / self.std, x)
        return self.net((x - self.mean) / self.std)


def build_head(kind: str, spec: FeatureSpec, arch: dict | None = None) -> StopHead:
    """A fresh head for a kind; refuses a feature spec the kind cannot read."""
    want = head_family(kind, arch).features
    if spec.kind != want:
        raise UserError(f"head kind '{kind}' reads '{want}' features, not '{spec.kind}'")
    if spec.dim <= 0:
        raise UserError(f"head kind '{kind}' needs hidden states; regenerate traces with trace.store_hidden=true")
    return StopHead(kind, spec.dim, head_arch(kind, spec, arch))


def head_arch(kind: str, spec: FeatureSpec, arch: dict | None) -> dict:
    """The architecture kwargs for a spec (`HeadNet.arch_for`: disco_plus adds its spec's token-id columns)."""
    arch = dict(arch or {})
    return head_family(kind, arch).arch_for(spec, arch)


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
    calibration: dict = field(default_factory=lambda: {"temperature": 1.0, "bias": 0.0, "mode": "none"})
    decode_rule: dict | None = None  # the stop rule train chose for speed on validation (eval.replay.speed_rule)
    drafter: str = "student"  # whose traces it was trained on (their manifest's `drafter`: decode.drafter's name)

    @torch.no_grad()
    def logit(self, x: torch.Tensor) -> torch.Tensor:
        """The head's raw (uncalibrated) logit from RAW features (..., spec.dim)."""
        x = torch.as_tensor(x)
        if x.shape[-1] != self.spec.dim:
            raise UserError(f"head expects features of size {self.spec.dim} ({self.spec.kind}), got {x.shape[-1]}")
        return self.head(x.to(self.head.mean.device))

    @torch.no_grad()
    def prob(self, x: torch.Tensor) -> torch.Tensor:
        """Calibrated acceptance probability from RAW features; normalisation happens inside the head."""
        t, b = float(self.calibration.get("temperature", 1.0)), float(self.calibration.get("bias", 0.0))
        return torch.sigmoid(self.logit(x) / t + b)

    @torch.no_grad()
    def prob_rows(self, x: torch.Tensor, chunk: int = 65536):
        """`prob` over many trace rows (eval, a node head's test report) in chunks of `chunk`, as float64 numpy."""
        import numpy as np

        return torch.cat([self.prob(part) for part in torch.split(x, chunk)]).cpu().numpy().astype(np.float64)

    @torch.no_grad()
    def scorer(self):
        """A function raw features (spec.dim,) → P(accept) as a float, for one drafted token at a time in decode.

        Same numbers as `prob` (a test checks), fewer ops (each family's `fast_scorer`): for the heads that start with a
        linear layer (DISCO, SPRINTER, disco_plus) the (x − mean) / std normalisation is folded into that layer and the
        layers run as bare tensor ops,
        because walking the module tree cost ~30 µs per drafted token against ~8 for the folded form. Build it after
        moving the head to its device; it reads a snapshot of the weights.
        """
        net, mean, std = self.head.net, self.head.mean, self.head.std
        # calibration sigmoid(z / T + c) folded into the last layer too
        t, c = float(self.calibration.get("temperature", 1.0)), float(self.calibration.get("bias", 0.0))
        fast = net.fast_scorer(mean, std, t, c)
        return fast if fast is not None else (lambda x: float(self.prob(x)))

    @torch.no_grad()
    def row_scorer(self):
        """A function raw feature rows (n, spec.dim) float32 numpy → P (n,) numpy: `prob` for the few rows of a tree
        level (decode's node heads score a handful of nodes per draft call). The same numbers to float32 rounding (a
        test checks); numpy, because on rows this small torch's per-op dispatch was most of the head's time (60–120 µs
        for a 16-node level against ~7 on a 2-core CPU)."""
        net, mean, std = self.head.net, self.head.mean, self.head.std
        t, c = float(self.calibration.get("temperature", 1.0)), float(self.calibration.get("bias", 0.0))
        fast = net.fast_rows(mean, std, t, c)
        return fast if fast is not None else (lambda x: self.prob(torch.from_numpy(x)).cpu().numpy())

    def check_pair(self, pair) -> None:
        """Refuse a pair this head was not trained for (pair id, tokenizer, draft hidden size)."""
        where = f" ({self.path})" if self.path else ""
        if pair.pair_id != self.pair_id or pair.tokenizer_hash != self.tokenizer_hash:
            raise UserError(
                f"head{where} was trained on pair {self.pair_id} (tokenizer {self.tokenizer_hash}) but this run uses "
                f"pair {pair.pair_id} (tokenizer {pair.tokenizer_hash}); train a head for this pair or pick its pair="
            )
        if self.spec.reads_hidden and self.drafter == "student":  # another drafter checks its own (decode.eagle3)
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
            "calibration": dict(self.calibration),
            "drafter": self.drafter,
        }


def update_head_meta(path: str | Path, **entries) -> None:
    """Set entries of a head checkpoint's metadata (what `load_head` reads), rewriting the file atomically."""
    from utils.files import atomic_write

    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    ckpt[CKPT_KEY].update(entries)
    atomic_write(Path(path), lambda tmp: torch.save(ckpt, tmp))


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
    head = StopHead(meta["kind"], spec.dim, head_arch(meta["kind"], spec, meta.get("arch")))
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
        calibration=dict(meta.get("calibration") or {"temperature": 1.0, "bias": 0.0, "mode": "none"}),
        decode_rule=meta.get("decode_rule"),
        drafter=str(meta.get("drafter", "student")),
    )
