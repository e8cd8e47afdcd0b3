"""Fast linear products for decoding on CPU, and a reduced-vocabulary draft head (FR-Spec).

**Why a product of our own** (issue 15). At batch 1 a decoding step multiplies 1 to K+1 rows by every weight matrix.
On the CPUs we measured, torch's `F.linear` is slow there in both dtypes, for two reasons `bench/head_gemm.py` shows:
- float32 goes to MKL's sgemm, which runs 2-3 rows as if each were its own matrix-vector product (the 49,152 x 576
  LM head: 10 / 22 / 33 ms for n = 1 / 2 / 3 on a 2-core AMD EPYC; a 1536 x 576 MLP product 70 / 135 / 199 us), so
  verifying K tokens cost 1.6-2.0 target steps in float32;
- bfloat16 goes to oneDNN, which reorders the weight into its blocked layout on *every* call (about half the time).
`PackedLinear` reorders each weight once (`torch.ops.mkldnn._reorder_linear_weight`, the path torch's inductor
takes for frozen CPU linears) and multiplies with oneDNN: the head takes 3.1-5.4 ms for n = 1..9 in float32 (F.linear
10-35 ms) and 2.3-3.1 ms in bf16 (F.linear 3.6-5.8), results/bench/head_gemm.md. It is the same product bit for bit
as `F.linear` in bf16; float32 differs from MKL's in the last bits (~1e-6 relative) and gives the same bits for a
row alone or in a batch, so a K-token verification sees the numbers K single steps would. `pair.linear=auto` packs on CPU when torch has oneDNN; `torch` keeps torch's own product. Both the
target-only baseline and speculative decoding run the same modules, so every method pays the same.

**Int8 draft weights** (`pair.draft.quantize=int8`, issue 15). At batch 1 a draft step streams every weight from
memory once: the default draft's 4 layers and 8k-row head are ~38 MB in bf16, more than this CPU's 32 MB L3, and a
bf16 draft step spent 2.7 of its 4.9 ms in products. `Int8Linear` keeps int8 weights with one scale per output row
(half the bytes) and multiplies with torch's weight-only int8 kernel, where that is fast (bf16 on CPU; float32 and
CUDA keep the float weights, as int8 saves nothing there). Only the draft is quantized: its q changes
(it is a different draft, with its own traces and heads), the target and so verification do not, so decoding stays
exactly lossless.

**FR-Spec** (arXiv 2502.14856): the draft scores only the N most frequent tokens. `SubsetHead` keeps those N rows of
the output matrix and returns full-width logits with −inf elsewhere, so q is a proper distribution on the subset
(exactly 0 outside it): softmax, top-k, entropy, sampling and exact verification need no change, and verification
stays lossless in greedy and sampling because the target still scores the whole vocabulary.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import torch

from utils.cli import UserError

LINEARS = ("auto", "packed", "torch")


def packed_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (CPU builds from PyPI do)."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")


def packed_bf16_available() -> bool:
    """Whether oneDNN can pack bf16 weights on this CPU (it needs avx512bw/vl/dq or avx_ne_convert; some AMD EPYC
    VMs lack them and the reorder raises)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else False


def resolve_linear(name: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """`auto`: `packed` on CPU when oneDNN is there (for bf16: when it can pack bf16 here), else `torch` (CUDA's own
    GEMMs have no such cliff)."""
    if name not in LINEARS:
        raise UserError(f"pair.linear must be one of {', '.join(LINEARS)}, got '{name}'")
    usable = device.type == "cpu" and packed_available() and (dtype != torch.bfloat16 or packed_bf16_available())
    if name == "packed" and not usable:
        raise UserError("pair.linear=packed needs a CPU device and a torch build with oneDNN "
                        "(torch.backends.mkldnn), and for bf16 a CPU oneDNN can pack bf16 on; use pair.linear=auto "
                        "or pair.linear=torch")
    return "torch" if name == "torch" else ("packed" if usable else "torch")


class PackedLinear(torch.nn.Module):
    """A Linear whose weight oneDNN reorders once; same parameters (and state_dict keys) as the Linear it replaces.

    Inference only: with autograd recording (a weight that requires grad, grad enabled) it is plain `F.linear`, and
    the packed copy is rebuilt when the weight changes in place (an optimizer step, `load_state_dict`), so training
    a packed model stays correct. Weights stay shared, so tied embeddings stay tied."""

    def __init__(self, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        self._packed, self._version = None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)) or w.dtype != x.dtype:
            return torch.nn.functional.linear(x, w, self.bias)
        version = None if w.is_inference() else w._version  # inference tensors keep no version counter
        if self._packed is None or self._version != version:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._version = version
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [None], "")

    def __getstate__(self):
        # oneDNN's packed copy is an opaque tensor that deepcopy and pickle cannot read (train.distill copies packed
        # target layers into its student); a copy repacks on its first call
        return {**self.__dict__, "_packed": None, "_version": None}


MIN_PACKED = 1 << 17  # weights smaller than this lose to F.linear: oneDNN's ~15 us fixed cost per call


def pack_linears(model: torch.nn.Module, min_elements: int = MIN_PACKED) -> int:
    """Replace every plain float32/bf16 CPU `nn.Linear` of at least `min_elements` weights in `model` by a
    `PackedLinear` sharing its parameters; returns how many. Smaller ones (SmolLM2's 192 x 576 k/v projections:
    9 us by F.linear, 22 packed, for one row in float32) keep torch's product."""
    n = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            w = child.weight
            if w.device.type == "cpu" and w.numel() >= min_elements and w.dtype in (torch.float32, torch.bfloat16):
                setattr(module, name, PackedLinear(child.weight, child.bias))
                n += 1
    return n


# Rows from which an Int8Linear multiplies by a bf16 copy of its dequantized weight (oneDNN, packed once) instead of
# torch's int8 kernel. The kernel streams half the bytes, which wins for the one-row steps int8 is for, but it is no
# GEMM: at the default draft's shapes it takes ~2x the bf16 product's time at 8 rows and ~2.7x at 64 and more (a
# prompt's prefill, a token tree's level, a teacher-forced trace pass). In the loop's own calls, where the weights
# come from memory rather than cache, the bf16 copy wins from 5 rows: the draft's prefill 1.9x faster, a level of
# 6-12 nodes 1.6-2.0 draft steps instead of 2.2-2.9 (results/bench/int8_rows.md, python -m bench.int8_rows).
# The default of `pair.draft.int8_float_rows`; null there keeps every call on the int8 kernel (the A/B).
INT8_FLOAT_ROWS = 5
NEVER = 1 << 62  # float_rows that no call reaches


def int8_float_rows(draft_cfg) -> int:
    """`pair.draft.int8_float_rows` as an Int8Linear switch: a positive row count (absent: INT8_FLOAT_ROWS), null:
    never (every call through the int8 kernel)."""
    if "int8_float_rows" not in draft_cfg:
        return INT8_FLOAT_ROWS
    rows = draft_cfg.get("int8_float_rows")
    if rows is None:
        return NEVER
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise UserError(f"draft.int8_float_rows must be a positive number of rows or null (never), got '{rows}'")
    return rows


class Int8Linear(torch.nn.Module):
    """A Linear with int8 weights and a per-output-row scale (symmetric, max-abs): y = x·(s ⊙ W_int8)ᵀ + b, through
    `aten._weight_int8pack_mm`, which reads the int8 weight directly. Inference only (buffers, no parameters).

    A bf16 CPU call of at least `float_rows` rows multiplies by bf16(s ⊙ W_int8) instead (made on first use, not
    saved): the same weights up to that one rounding, so a many-row pass and one-row steps of the same draft agree
    to bf16 resolution, as a K-row verification and K one-row steps of any bf16 model do."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, float_rows: int = INT8_FLOAT_ROWS):
        super().__init__()
        self.float_rows = int(float_rows)
        w = weight.detach().float()
        # the scale as stored (in the weight's dtype) is the one the ints are rounded against, so a bf16 scale's own
        # rounding adds no error: |W - s·W_int8| <= s/2 per row
        scale = (w.abs().amax(1).clamp_min(1e-30) / 127.0).to(weight.dtype)
        self.register_buffer("qweight", (w / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_features, self.in_features = weight.shape

    @classmethod
    def stacked(cls, parts: list["Int8Linear"]) -> "Int8Linear":
        """One Int8Linear whose output is `parts`' outputs side by side (bias-free parts of one input width): the same
        int8 rows and scales, so the same numbers — each output is its own row's product — in one kernel call
        instead of len(parts) (models.lean fuses q/k/v and gate/up this way)."""
        if any(p.bias is not None for p in parts) or len({p.in_features for p in parts}) != 1:
            raise ValueError("Int8Linear.stacked needs bias-free parts of one input width")
        fused = cls.__new__(cls)
        torch.nn.Module.__init__(fused)
        fused.register_buffer("qweight", torch.cat([p.qweight for p in parts]))
        fused.register_buffer("scale", torch.cat([p.scale for p in parts]))
        fused.register_buffer("bias", None)
        fused.float_rows = min(p.float_rows for p in parts)
        fused.out_features, fused.in_features = sum(p.out_features for p in parts), parts[0].in_features
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        if flat.shape[0] >= self.float_rows and flat.dtype == torch.bfloat16 and flat.device.type == "cpu":
            y = self._float_copy(flat.dtype)(flat)
        else:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale.to(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def _float_copy(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """The dequantized weight as a bias-free linear of `dtype`, packed for oneDNN where it can pack it; cached
        (a plain attribute, so not in the state_dict) until qweight or scale is replaced."""
        key = (dtype, id(self.qweight), id(self.scale))
        cached = self.__dict__.get("_float")
        if cached is None or cached[0] != key:
            w = torch.nn.Parameter((self.qweight.float() * self.scale.float()[:, None]).to(dtype), requires_grad=False)
            usable = packed_available() and (dtype != torch.bfloat16 or packed_bf16_available())
            lin = PackedLinear(w) if usable else functools.partial(torch.nn.functional.linear, weight=w)
            self.__dict__["_float"] = cached = (key, lin)
        return cached[1]

    def __getstate__(self):
        # the packed copy is an opaque oneDNN tensor (see PackedLinear); a deepcopy rebuilds it on first use
        return {k: v for k, v in self.__dict__.items() if k != "_float"}



def int8_kernel_is_fast(dtype: torch.dtype, device: torch.device) -> bool:
    """torch 2.13's CPU int8 product is vectorised for bf16 activations only: for one 1536 x 576 row product 30 µs in
    bf16 but 526 µs in float32 (F.linear 71 µs) on a 2-core AMD EPYC, so float32 would make the draft 4x slower;
    CUDA's float products are not memory-bound the same way at this size."""
    return device.type == "cpu" and dtype == torch.bfloat16


def quantize_linears(model: torch.nn.Module, keep: set[int] = frozenset(), only_where_fast: bool = True,
                     float_rows: int = INT8_FLOAT_ROWS) -> int:
    """Replace every `nn.Linear` / `PackedLinear` of `model` by an `Int8Linear` (switching to its bf16 copy from
    `float_rows` rows); returns how many. With
    `only_where_fast` (what `pair.draft.quantize=int8` does) layers whose dtype/device the int8 kernel is slow for
    (`int8_kernel_is_fast`: float32, CUDA) keep their float weights, because there int8 saves nothing. A Linear whose
    weight is in `keep` (ids of tensors another model shares, e.g. the target's) is refused, not quantized under it."""
    n = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, (torch.nn.Linear, PackedLinear)):
                continue
            if id(child.weight) in keep:
                raise UserError(f"draft.quantize=int8 would quantize '{name}', which the draft shares with the target; "
                                "use a draft with its own weights (source=student with vocab_subset, or hf) or "
                                "draft.quantize=null")
            if only_where_fast and not int8_kernel_is_fast(child.weight.dtype, child.weight.device):
                continue
            setattr(module, name, Int8Linear(child.weight, child.bias, float_rows))
            n += 1
    return n


class SubsetHead(torch.nn.Module):
    """An output head that scores only `ids` (the draft's reduced vocabulary) and returns full-width logits, −inf
    outside the subset. `out_features` is the full vocabulary, as for the Linear it replaces. The product is a child
    Linear (`proj`), so `pack_linears` packs it like any other."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor, vocab: int):
        super().__init__()
        ids = torch.as_tensor(ids, dtype=torch.long).sort().values
        self.register_buffer("ids", ids, persistent=False)
        self.proj = torch.nn.Linear(weight.shape[1], len(ids), bias=False, device=weight.device, dtype=weight.dtype)
        self.proj.weight = torch.nn.Parameter(weight.detach()[ids].clone(), requires_grad=False)
        self.out_features = int(vocab)
        self.in_features = int(weight.shape[1])

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.proj.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        z = self.proj(flat)
        out = z.new_full((flat.shape[0], self.out_features), float("-inf"))
        out.index_copy_(1, self.ids, z)
        return out.reshape(*h.shape[:-1], self.out_features)


def read_frequencies(path: Path) -> list[int]:
    """Token ids, most frequent first, from a file written by `python -m train.vocab_subset`."""
    if not path.is_file():
        raise UserError(f"draft.vocab_freq={path} not found; run `python -m train.vocab_subset` to make it")
    try:
        return [int(i) for i in json.loads(path.read_text())["ids_by_frequency"]]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{path} is not a token-frequency file from `python -m train.vocab_subset`") from None


def subset_ids(frequencies: list[int], n: int, always: set[int], vocab: int) -> torch.Tensor:
    """The n most frequent ids plus `always` (EOS and other special tokens the draft must be able to propose)."""
    if not 0 < n <= vocab:
        raise UserError(f"draft.vocab_subset={n} must be in 1..{vocab} (the vocabulary size), or null for the full head")
    keep = {i for i in frequencies[:n] if i < vocab} | {i for i in always if 0 <= i < vocab}
    return torch.tensor(sorted(keep), dtype=torch.long)
