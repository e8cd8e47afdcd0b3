"""`pair.attention`: how a model's attention runs (transformers' `sdpa`, or `upcast`).

Why an option (bench/small_ops.py → bench/results/small_ops.md): on CPU, torch 2.13's bfloat16
`scaled_dot_product_attention` for a *single* query row is 4-7x slower than for two rows or than float32 (SmolLM2's
shapes, 256 cached positions: 147 µs vs 56 for two rows and 23 in float32). Every target-only step and every draft
step is a single row; a verification pass is not. So in bf16 the stock kernel makes target-only decoding ~8% slower
than it needs to be, and every bf16 speedup over it a little larger than against a tuned baseline.

`upcast` computes a single bf16 query row's attention in float32 on CPU (the same transformers function, inputs
cast up, output cast back); everything else is transformers' `sdpa` unchanged. It applies to both models, so
target-only and speculative decoding keep running the same modules. `sdpa` (the default) is what transformers runs,
so default numbers compare with transformers' own generate and assisted generation.
"""

from __future__ import annotations

import torch

from utils.cli import UserError

ATTENTIONS = ("sdpa", "upcast")
UPCAST = "specstop_upcast"  # the name it is registered under in transformers' AttentionInterface


def upcast_single_query(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, a single bf16 query row on CPU computed in float32."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[-2] == 1 and query.dtype == torch.bfloat16 and query.device.type == "cpu":
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)
        return out.to(query.dtype), weights
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def set_attention(model: torch.nn.Module, name: str) -> None:
    """Switch `model` to attention `name` (ATTENTIONS); `sdpa` leaves it as loaded."""
    if name not in ATTENTIONS:
        raise UserError(f"pair.attention must be one of {', '.join(ATTENTIONS)}, got '{name}'")
    if name == "sdpa":
        return
    from transformers import AttentionInterface

    AttentionInterface.register(UPCAST, upcast_single_query)
    model.set_attn_implementation(UPCAST)
