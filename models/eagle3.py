"""The EAGLE-3 draft (Li et al. 2025, arXiv 2503.01840): one decoder layer that reads the target's own features.

A step at position t reads the embedding of token x_t (the target's, frozen) and a feature h: the target's hidden
states at a low, a middle and a high layer at position t − 1 (transformers' `hidden_states` indices `layers`),
concatenated and fused by a linear layer (`fc`). The layer normalises both, attends from their concatenation (2H
wide, so q/k/v project 2H → heads) with rotary positions, adds the fused feature as the residual, and runs the
MLP; its output `o_t` goes through the final norm (initialised from the target's) and a reduced-vocabulary head (the
FR-Spec subset the student uses: `ids` maps its rows to target ids) to score x_{t+1}. Drafting feeds the layer its
own output in place of the target's feature beyond the first step: step j+1 reads (x̂_{t+j+1}, o_{t+j}).

`forward_steps` is training-time test (TTT): step 0 runs every position with the target's features; step j runs
every position again with step j−1's outputs as features and the tokens shifted by j, each query attending to the
true-feature keys up to its start and to its own chain's keys of steps 1..j — what drafting j tokens ahead sees.
`step` is drafting: a KV cache of positions (true-feature ones and the current chain's), cropped on rollback.
Weights are saved as the trainable tensors only (`state`, safetensors with a json config); the embedding is the
target's.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from utils.cli import UserError


@dataclass(frozen=True)
class Eagle3Config:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: tuple[int, int, int]  # target hidden_states indices fused (low, middle, high)
    vocab: int  # the target's vocabulary (the head's ids index it)
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def of_target(cls, target, layers=None) -> Eagle3Config:
        """The target's shapes; `layers` default to EAGLE-3's (2, L // 2, L − 3) of its L decoder layers."""
        c = target.config
        n = int(c.num_hidden_layers)
        chosen = tuple(int(i) for i in layers) if layers else (2, n // 2, n - 3)
        if len(chosen) != 3 or not all(0 <= i <= n for i in chosen):
            raise UserError(f"eagle3 layers must be 3 indices of the target's hidden states 0..{n}, got {layers}")
        hd = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        rope = getattr(c, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
        return cls(int(c.hidden_size), int(c.num_attention_heads), int(c.num_key_value_heads), hd,
                   int(c.intermediate_size), chosen, int(c.vocab_size), float(c.rms_norm_eps), theta)


@torch.no_grad()
def target_features(target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layers, last: bool = False):
    """The target's hidden states (transformers' `hidden_states` indices `layers`) stacked (B, T, 3, H) in float32
    for a right-padded batch (attention_mask 1 on real tokens; None: no padding), on the target's device; with
    `last`, also its final-norm output (B, T, H) in the target's dtype, for its head. The one definition of an
    EAGLE-3 draft's input features: training on the fly (train.eagle_module), the feature cache beside the
    distillation corpus (train.feature_cache) and the draft's traces (data_gen.eagle_traces) all call it, so a draft
    reads in each what it was trained on; decoding taps the same numbers from its KV-cached target calls
    (models.lm.target_pass, tested equal). Rows past a row's length hold padding's features (the caller masks them)."""
    dev = next(target.parameters()).device
    mask = None if attention_mask is None else attention_mask.to(dev)
    out = target.model(input_ids=input_ids.to(dev), attention_mask=mask, output_hidden_states=True)
    feats = torch.stack([out.hidden_states[int(i)] for i in layers], -2).float()
    return (feats, out.last_hidden_state) if last else feats


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Llama's rotate-half form) of x (..., n, head_dim) at integer positions (n,)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)
    return _rotate(x, emb.cos().to(x.dtype), emb.sin().to(x.dtype))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class Eagle3(nn.Module):
    def __init__(self, cfg: Eagle3Config, ids: torch.Tensor):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.cfg = cfg
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.in_norm, self.hid_norm = RMSNorm(h, cfg.rms_eps), RMSNorm(h, cfg.rms_eps)
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.post_norm, self.norm = RMSNorm(h, cfg.rms_eps), RMSNorm(h, cfg.rms_eps)
        self.gate = nn.Linear(h, cfg.intermediate, bias=False)
        self.up = nn.Linear(h, cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, h, bias=False)
        ids = torch.as_tensor(ids, dtype=torch.long).sort().values
        self.register_buffer("ids", ids)
        self.head = nn.Linear(h, len(ids), bias=False)
        self.embed: nn.Embedding | None = None  # the target's (frozen, not saved): `attach`

    # -- building ---------------------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target, ids, layers=None) -> Eagle3:
        """A fresh draft for `target`: final norm and head rows copied from the target's, the rest initialised."""
        model = cls(Eagle3Config.of_target(target, layers), ids)
        with torch.no_grad():
            model.norm.weight.copy_(target.model.norm.weight.float())
            model.head.weight.copy_(target.lm_head.weight.float()[model.ids])
        return model.attach(target)

    def attach(self, target) -> Eagle3:
        """Use the target's token embedding (shared, frozen)."""
        object.__setattr__(self, "embed", target.get_input_embeddings())  # not a submodule: not saved, not trained
        return self

    # -- one pass of the layer ---------------------------------------------------------------------------------------
    def fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features (…, 3, H) → the fused feature (…, H)."""
        return self._products()["fc"](feats.reshape(*feats.shape[:-2], 3 * self.cfg.hidden))

    def qkv(self, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor):
        """q (…, heads, n, hd), k, v (…, kv_heads, n, hd) of tokens (…, n) with features h (…, n, H)."""
        cfg = self.cfg
        e = self.embed(tokens).to(h.dtype)
        x = torch.cat([self.in_norm(e), self.hid_norm(h)], -1)
        lead = x.shape[:-2]

        def split(t, n):
            return t.view(*lead, x.shape[-2], n, cfg.head_dim).transpose(-3, -2)

        q = rope(split(self.q_proj(x), cfg.heads), positions, cfg.rope_theta)
        k = rope(split(self.k_proj(x), cfg.kv_heads), positions, cfg.rope_theta)
        return q, k, split(self.v_proj(x), cfg.kv_heads)

    def finish(self, attn: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The layer's output from the attention (…, heads, n, hd) and the residual feature h (…, n, H)."""
        a = attn.transpose(-3, -2).reshape(*h.shape[:-1], -1)
        x = h + self.o_proj(a)
        y = self.post_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Scores over the subset (…, len(ids)) of the layer's output."""
        return self._products()["head"](self.norm(out))

    def _expand(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(self.cfg.heads // self.cfg.kv_heads, dim=-3)

    # -- drafting ---------------------------------------------------------------------------------------------------
    def new_cache(self, capacity: int = 512) -> Eagle3Cache:
        p = self.q_proj.weight
        return Eagle3Cache(self.cfg.kv_heads, self.cfg.head_dim, p.dtype, p.device, capacity)

    def prepare(self, linear: str = "torch", int8: bool = False, float_rows: int | None = None) -> Eagle3:
        """Products for drafting (inference only; training keeps the modules): q/k/v and gate/up as one stacked
        product each (each output is its own row's product, so the same numbers in one call instead of three and
        two), every product packed for oneDNN (`linear="packed"`, models.lm_head) or int8 (`int8`, bf16 on CPU:
        what `pair.draft.quantize=int8` does for the student). Not saved: `save` writes the modules."""
        from models.lm_head import INT8_FLOAT_ROWS, Int8Linear, PackedLinear, int8_kernel_is_fast

        def product(*mods):
            w = torch.cat([m.weight.detach() for m in mods]) if len(mods) > 1 else mods[0].weight.detach()
            if int8 and int8_kernel_is_fast(w.dtype, w.device):
                return Int8Linear(w, None, float_rows or INT8_FLOAT_ROWS)
            if linear == "packed":
                return PackedLinear(nn.Parameter(w, requires_grad=False))
            return functools.partial(F.linear, weight=w)

        object.__setattr__(self, "_lean", {  # not submodules: not in the state_dict
            "fc": product(self.fc), "qkv": product(self.q_proj, self.k_proj, self.v_proj), "o": product(self.o_proj),
            "gate_up": product(self.gate, self.up), "down": product(self.down), "head": product(self.head)})
        return self

    def _products(self) -> dict:
        """The drafting products (`prepare`), else the modules themselves (training, and a draft not prepared)."""
        ops = self.__dict__.get("_lean") or self.__dict__.get("_plain")
        if ops is None:
            cat = lambda *ms: lambda x: torch.cat([m(x) for m in ms], -1)  # noqa: E731
            ops = self.__dict__["_plain"] = {
                "fc": self.fc, "qkv": cat(self.q_proj, self.k_proj, self.v_proj), "o": self.o_proj,
                "gate_up": cat(self.gate, self.up), "down": self.down, "head": self.head}
        return ops

    def _rope_table(self, end: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions [0, end) (as `rope` computes them), kept in a table that doubles when outgrown."""
        have = self.__dict__.get("_rope")
        if have is None or have[0].shape[0] < end or have[0].dtype != dtype:
            n = max(end, 2 * (0 if have is None else have[0].shape[0]), 1024)
            d = self.cfg.head_dim
            inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
            ang = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv[None]
            emb = torch.cat([ang, ang], -1)
            have = (emb.cos().to(dtype), emb.sin().to(dtype))
            self.__dict__["_rope"] = have
        return have

    def step(self, tokens: torch.Tensor, h: torch.Tensor, cache: Eagle3Cache, positions: torch.Tensor | None = None,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run n new positions (tokens (n,), features (n, H)) after the cache; returns the outputs (n, H). Causal
        after the cache, or a token tree's call: rotary `positions` (n,) and `mask` (n, cache + n) bool (models.lm
        .tree_attention), both or neither. Keys and values are written into the preallocated cache."""
        cfg, ops = self.cfg, self._products()
        n, start = len(tokens), cache.length
        end = start + n
        cache.reserve(end)
        cos, sin = self._rope_table(end, h.dtype, h.device)
        idx = slice(start, end) if positions is None else positions
        cos, sin = cos[idx], sin[idx]
        e = F.embedding(tokens, self.embed.weight).to(h.dtype)
        y = ops["qkv"](torch.cat([self.in_norm(e), self.hid_norm(h)], -1))
        qw, kw = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        qk = _rotate(y[:, : qw + kw].view(n, -1, cfg.head_dim).transpose(0, 1), cos, sin)
        cache.k[:, start:end] = qk[cfg.heads :]
        cache.v[:, start:end] = y[:, qw + kw :].view(n, -1, cfg.head_dim).transpose(0, 1)
        keys, values = cache.k[:, :end], cache.v[:, :end]
        cache.length = end
        groups = cfg.heads // cfg.kv_heads
        if n == 1 and mask is None:  # one row: each kv head's query heads as the rows of one query (no mask needed)
            a = F.scaled_dot_product_attention(qk[: cfg.heads].reshape(cfg.kv_heads, groups, cfg.head_dim), keys,
                                               values).reshape(cfg.heads, 1, cfg.head_dim)
        else:
            if mask is None:
                mask = torch.ones(n, end, dtype=torch.bool, device=h.device).tril(start)
            a = F.scaled_dot_product_attention(qk[: cfg.heads], keys, values, attn_mask=mask, enable_gqa=groups > 1)
        x = h + ops["o"](a.transpose(0, 1).reshape(n, -1))
        gate, up = ops["gate_up"](self.post_norm(x)).chunk(2, -1)
        return x + ops["down"](F.silu(gate) * up)

    # -- training-time test -----------------------------------------------------------------------------------------
    def forward_steps(self, tokens: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The layer's outputs (B, T − 1, H) of each TTT step: step j's row i (`logits` of it) scores token
        i + j + 2 of `tokens` (B, T), having read tokens i + 1 .. i + j + 1 and the target's features at i (feats
        (B, T, 3, H) or fused (B, T, H)); rows past the sequence are garbage, for the caller to mask. The head runs
        only where the caller asks (it is most of a step's cost)."""
        B, T = tokens.shape
        h = self.fuse(feats) if feats.dim() == 4 else feats
        h = h[:, : T - 1]
        scale = 1.0 / math.sqrt(self.cfg.head_dim)
        causal = torch.ones(T - 1, T - 1, dtype=torch.bool, device=h.device).tril()
        keys, out = [], []
        for j in range(steps):
            toks = F.pad(tokens[:, 1 + j :], (0, j))[:, : T - 1]  # token i + 1 + j at row i
            pos = torch.arange(1 + j, T + j, device=h.device)
            q, k, v = self.qkv(toks, h, pos)
            k, v = self._expand(k), self._expand(v)
            if j == 0:
                k0, v0 = k, v
            keys.append((k, v))
            s0 = (q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
            diag = torch.stack([(q * kk).sum(-1) * scale for kk, _ in keys[1:]], -1) if j else None
            w = torch.softmax(s0 if diag is None else torch.cat([s0, diag], -1), -1)
            attn = w[..., : T - 1] @ v0
            for s, (_, vv) in enumerate(keys[1:]):
                attn = attn + w[..., T - 1 + s, None] * vv
            h = self.finish(attn, h)
            out.append(h)
        return out

    # -- storage ----------------------------------------------------------------------------------------------------
    def save(self, path: Path, info: dict) -> Path:
        from safetensors.torch import save_file

        tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items() if k != "ids"}
        tensors["ids"] = self.ids.to(torch.int64)
        meta = {"eagle3_config": json.dumps(asdict(self.cfg)), "info": json.dumps(info)}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: Path, target) -> Eagle3:
        """A saved draft on `target` (refused in one line when the shapes or vocabulary do not match)."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise UserError(f"EAGLE-3 weights {path} not found; train them with python -m train.eagle")
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if "eagle3_config" not in meta:
            raise UserError(f"{path} is not an EAGLE-3 draft (no eagle3_config in its metadata)")
        raw = json.loads(meta["eagle3_config"])
        cfg = Eagle3Config(**{**raw, "layers": tuple(raw["layers"])})
        want = Eagle3Config.of_target(target, cfg.layers)
        if (cfg.hidden, cfg.vocab) != (want.hidden, want.vocab):
            raise UserError(f"{path} drafts for a target of hidden size {cfg.hidden} and vocabulary {cfg.vocab}; "
                            f"this pair's target has {want.hidden} and {want.vocab}")
        model = cls(cfg, tensors.pop("ids"))
        model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
        return model.attach(target)


class Eagle3Cache:
    """The draft's keys and values in preallocated buffers (kv_heads, capacity, head_dim), `length` positions valid;
    grows by doubling; `crop(n)` keeps the first n (a rollback moves no data)."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 512):
        self.k = torch.empty(kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def reserve(self, n: int) -> None:
        cap = self.k.shape[1]
        if n <= cap:
            return
        while cap < n:
            cap *= 2
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = old.new_empty(old.shape[0], cap, old.shape[2])
            grown[:, : self.length] = old[:, : self.length]
            setattr(self, name, grown)

    def get_seq_length(self) -> int:  # the name models.tree reads
        return self.length

    def crop(self, n: int) -> None:
        self.length = min(self.length, n)
