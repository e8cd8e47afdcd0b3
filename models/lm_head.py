"""The LM head at decode time: a fast product for the few rows a decoding step needs, and a reduced-vocabulary
draft head (FR-Spec).

**Why a product of our own.** At batch 1 a decoding step projects 1 to K+1 hidden states onto the vocabulary
(49,152 × 576 for SmolLM2: two thirds of a 4-layer draft step). In float32 on the CPUs we measured, torch's
`F.linear(h, W)` runs that shape as if each row were its own matrix-vector product — 11 / 22 / 33 ms for 1 / 2 / 3
rows on a 2-core AMD EPYC — while `W @ h.T` (the weight as the tall left operand) takes 4.5-6.5 ms for 2-4 rows,
and a single row padded to two costs the same. `bench/head_gemm.py` measures both on your machine
(→ bench/results/head_gemm.json). bf16 and CUDA keep `F.linear`, which has no such cliff there. Both the
target-only baseline and speculative decoding go through this one function, so every method pays the same.

**FR-Spec** (arXiv 2502.14856): the draft scores only the N most frequent tokens. `SubsetHead` keeps those N rows of
the output matrix and returns full-width logits with −inf elsewhere, so q is a proper distribution on the subset
(exactly 0 outside it): softmax, top-k, entropy, sampling and exact verification need no change, and verification
stays lossless in greedy and sampling because the target still scores the whole vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from utils.cli import UserError


FAST_FLOAT32 = True  # bench/head_gemm.py turns it off to time torch's own product ("before")


def project(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h (n, d) @ weight (V, d)ᵀ → (n, V), by the fastest form for this dtype and device (module docstring)."""
    if not FAST_FLOAT32 or weight.dtype != torch.float32 or weight.device.type != "cpu" or h.ndim != 2:
        return torch.nn.functional.linear(h, weight)
    if h.shape[0] == 1:  # a matrix-vector product is the slow path: pad to two rows
        return (weight @ torch.cat([h, h]).t())[:, :1].t().contiguous()
    return (weight @ h.t()).t().contiguous()


def head_logits(head: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Logits of an output head for hidden states h (n, d): a plain bias-free Linear goes through `project`."""
    if type(head) is torch.nn.Linear and head.bias is None:
        return project(h, head.weight)
    return head(h)


class SubsetHead(torch.nn.Module):
    """An output head that scores only `ids` (the draft's reduced vocabulary) and returns full-width logits, −inf
    outside the subset. `out_features` is the full vocabulary, as for the Linear it replaces."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor, vocab: int):
        super().__init__()
        ids = torch.as_tensor(ids, dtype=torch.long).sort().values
        self.register_buffer("ids", ids, persistent=False)
        self.weight = torch.nn.Parameter(weight.detach()[ids].clone(), requires_grad=False)
        self.out_features = int(vocab)
        self.in_features = int(weight.shape[1])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        z = project(flat, self.weight)
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
