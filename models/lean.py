"""A lean batch-1 forward for Llama-architecture models: transformers' numbers with fewer calls.

**Why** (issue 15). At batch 1 a small model's step is mostly dispatch, not arithmetic: a draft step of the default
pair (4 layers, int8 weights) spent ~1.4 of ~3.5 ms in its products, 0.5 ms in one-row bf16 attention, and the rest
in the small ops and the module code transformers runs around them (keyword plumbing, mask building, the rotary
module, cache bookkeeping). `LeanLlama` runs the same ops on the same tensors in the same order — so its hidden
states are transformers' *bit for bit* in float32 (tests/test_lean.py checks every step of a decode with rollbacks)
— but calls them directly: cos/sin read from a table instead of recomputed per step, keys and values written into a
preallocated cache instead of concatenated, the causal mask built only when a call has several rows after a cache.
One departure, in bf16 only: a one-row attention runs in the packed-heads form that avoids torch's slow grouped
bf16 row (see `hidden`), which rounds some rows differently. Int8 layers' q/k/v and gate/up run as one stacked int8
product each, with q and k rotated as one tensor (the same bits). `python -m bench.lean_forward` on a 2-core AMD
EPYC, bf16: draft step 4.67 → 2.73 ms, target step 34.2 → 27.1 ms (transformers' forward → this one;
results/bench/lean_forward.md).

It applies to models whose config says they are plain Llama blocks (`supports`); anything else keeps transformers'
forward (`models.lm.LM` decides). The weights are the model's own modules (packed, int8 or reduced-vocabulary heads
included), so nothing is copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from models.lm_head import Int8Linear

# configs whose decoder layer is exactly Llama's (RMSNorm → attention with RoPE → RMSNorm → gated SiLU MLP)
SUPPORTED_MODEL_TYPES = ("llama",)


def supports(model) -> bool:
    """Whether `model` is a plain Llama decoder this module computes exactly as transformers does."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    rope = getattr(cfg, "rope_parameters", None) or {}
    base = getattr(model, "model", None)
    return (
        base is not None
        and hasattr(base, "layers")
        and rope.get("rope_type", "default") == "default"
        and not getattr(cfg, "attention_bias", False)
        and not getattr(cfg, "mlp_bias", False)
        and getattr(cfg, "hidden_act", None) == "silu"
        and getattr(cfg, "_attn_implementation", "sdpa") == "sdpa"
        and getattr(cfg, "pretraining_tp", 1) == 1
        and float(getattr(base.rotary_emb, "attention_scaling", 1.0)) == 1.0
    )


class LeanCache:
    """Keys and values of every layer in preallocated buffers (1, kv_heads, capacity, head_dim); `len` positions are
    valid. Grows by doubling; `crop(-m)` drops the last m positions (the speculative loop's rollback), as
    `DynamicCache.crop` does."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 512):
        self.k = [torch.empty(1, kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.empty_like(t) for t in self.k]
        self.len = 0

    def get_seq_length(self) -> int:
        return self.len

    def crop(self, max_length: int) -> None:
        self.len = self.len + max_length if max_length < 0 else min(self.len, max_length)

    def compact(self, start: int, src: torch.Tensor) -> None:
        """Move positions `src` (sorted, all >= start) to start, start+1, ... and keep nothing after them: the
        in-place half of `models.lm.LM.keep` (a token tree's accepted path after the prefix)."""
        end = start + src.shape[0]
        for buf in (self.k, self.v):
            for t in buf:
                t[:, :, start:end] = t[:, :, src]
        self.len = end

    def reserve(self, n: int) -> None:
        cap = self.k[0].shape[2]
        if n <= cap:
            return
        while cap < n:
            cap *= 2
        for buf in (self.k, self.v):
            for i, t in enumerate(buf):
                grown = t.new_empty(t.shape[0], t.shape[1], cap, t.shape[3])
                grown[:, :, : self.len] = t[:, :, : self.len]
                buf[i] = grown


class LeanLlama:
    """Batch-1 forward of a Llama model with a `LeanCache`: `hidden(ids, cache)` returns the final-norm hidden state
    of each new position (1, n, d), exactly as `model.model(...).last_hidden_state` would (a token-tree call with
    `positions` and `mask`: as it would given position_ids and that 4D mask)."""

    def __init__(self, model, pack_one_row: bool | None = None):
        base, cfg = model.model, model.config
        self.embed = base.embed_tokens.weight
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scale = self.head_dim ** -0.5
        self.layers = [
            (
                layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj), layer.self_attn.o_proj,
                _stacked(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                (layer.mlp.gate_proj, layer.mlp.up_proj), layer.mlp.down_proj,
                _stacked(layer.mlp.gate_proj, layer.mlp.up_proj),
            )
            for layer in base.layers
        ]
        self.qk_width = (self.heads + self.kv_heads) * self.head_dim
        self.norm = (base.norm.weight, base.norm.variance_epsilon)
        self.inv_freq = base.rotary_emb.inv_freq
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self._cos = self._sin = None
        # bf16 one-row attention through the packed-heads form (see `hidden`); None: in bf16, where it pays
        self.pack_one_row = self.dtype == torch.bfloat16 if pack_one_row is None else bool(pack_one_row)

    def new_cache(self, capacity: int = 512) -> LeanCache:
        return LeanCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device, capacity)

    def _rope(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of positions [0, end) as transformers' rotary module computes them (float32 products, then
        the model's dtype), kept in a table that doubles when outgrown."""
        if self._cos is None or self._cos.shape[0] < end:
            n = max(end, 2 * (0 if self._cos is None else self._cos.shape[0]), 1024)
            pos = torch.arange(n, device=self.device)
            freqs = pos[:, None].float() * self.inv_freq.to(device=self.device, dtype=torch.float)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        return self._cos, self._sin

    @staticmethod
    def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)

    def _rope_and_mask(self, start: int, end: int, positions: torch.Tensor | None, mask: torch.Tensor | None):
        """cos, sin (1, 1, n, d) and the sdpa mask of a call writing cache positions [start, end). Without `positions`
        and `mask`, as transformers' sdpa path: one row → no mask; a fresh cache → is_causal (None here); several rows
        after a cache → a boolean causal mask (lower-right aligned). A tree call (models.lm.tree_attention) gives
        both: cos/sin gathered at its rotary positions (each < end) and its mask as is."""
        cos, sin = self._rope(end)
        if positions is not None:
            return cos[positions][None, None], sin[positions][None, None], mask.reshape(1, 1, end - start, end)
        n = end - start
        if n > 1 and start > 0:
            mask = (torch.arange(end, device=self.device)[None, :]
                    <= torch.arange(start, end, device=self.device)[:, None])[None, None]
        return cos[start:end][None, None], sin[start:end][None, None], mask

    def hidden(self, ids: torch.Tensor, cache: LeanCache, positions: torch.Tensor | None = None,
               mask: torch.Tensor | None = None, layers: Sequence[int] = ()):
        """The final-norm output (1, n, d) of `ids` after the cache. `positions` (n,) long and `mask`
        (n, cache.len + n) bool (True = attend): a token-tree call (both or neither; see models.lm.LM.__call__).
        `layers`: also return {i: the hidden state (1, n, d) transformers' `hidden_states[i]` holds} — 0 the
        embeddings, i the output of decoder layer i, the last index the final-norm output — as a second value."""
        if (positions is None) != (mask is None):
            raise ValueError("a tree call gives both positions and mask")
        n = ids.shape[-1]
        start, end = cache.len, cache.len + n
        cache.reserve(end)
        cos, sin, mask = self._rope_and_mask(start, end, positions, mask)
        x = F.embedding(ids.view(1, n), self.embed)
        want = set(layers)
        taps = {0: x} if 0 in want else {}
        for i, params in enumerate(self.layers):
            x = self._layer(i, params, x, cache, start, end, cos, sin, mask)
            if i + 1 in want:
                taps[i + 1] = x
        cache.len = end
        out = self._rms(x, *self.norm)
        if not want:
            return out
        if len(self.layers) in want:  # transformers' last hidden state is the final norm's output
            taps[len(self.layers)] = out
        return out, taps

    def _layer(self, i: int, params, x, cache: LeanCache, start: int, end: int, cos, sin, mask):
        """Decoder layer i on x (1, n, d): attention over the cache (its keys and values written at start..end) and
        the MLP, each with its residual."""
        w_in, eps_in, qkv, o_proj, qkv_stacked, w_post, eps_post, gate_up, down, gate_up_stacked = params
        n, d, groups = x.shape[1], self.head_dim, self.heads // self.kv_heads
        residual = x
        h = self._rms(x, w_in, eps_in)
        if qkv_stacked is not None:  # one int8 product; q and k rotated as one tensor of their heads side by side
            y = qkv_stacked(h)
            qk = self._rotate(y[..., : self.qk_width].view(1, n, -1, d).transpose(1, 2), cos, sin)
            q, k = qk[:, : self.heads], qk[:, self.heads :]
            v = y[..., self.qk_width :].view(1, n, -1, d).transpose(1, 2)
        else:
            q, k, v = (proj(h).view(1, n, -1, d).transpose(1, 2) for proj in qkv)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        kb, vb = cache.k[i], cache.v[i]
        kb[:, :, start:end] = k
        vb[:, :, start:end] = v
        keys, values = kb[:, :, :end], vb[:, :, :end]
        if n == 1 and groups > 1 and (self.pack_one_row or mask is not None):
            # one row in bf16: each key/value head's query heads as the rows of one query (transformers'
            # pack_gqa). torch 2.13's CPU kernel runs a grouped bf16 row 4-5x slower (121 vs 28 us at 200
            # positions; float32 has no such cliff, 22 vs 27) and rounds some rows differently, so in bf16 this
            # is the one place where the numbers are not transformers' bit for bit (they differ at bf16
            # resolution, as a K-row verification already does from one-row steps). A one-row tree call packs
            # in any dtype: transformers packs a masked row, so these are its bits
            a = F.scaled_dot_product_attention(q.reshape(1, self.kv_heads, groups, self.head_dim), keys, values,
                                               attn_mask=mask, scale=self.scale).reshape(1, self.heads, 1, d)
        else:
            # several rows: grouped heads with the mask give the bits of transformers' repeated key/value heads
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None and n > 1,
                                               scale=self.scale, enable_gqa=groups > 1)
        x = residual + o_proj(a.transpose(1, 2).contiguous().reshape(1, n, -1).contiguous())
        residual = x
        h = self._rms(x, w_post, eps_post)
        if gate_up_stacked is not None:
            gate, up = gate_up_stacked(h).split(gate_up_stacked.out_features // 2, dim=-1)
        else:
            gate, up = (proj(h) for proj in gate_up)
        return residual + down(F.silu(gate) * up)


def _stacked(*linears) -> Int8Linear | None:
    """For int8 layers, one Int8Linear over their stacked rows (the same numbers, since each output is its own row's
    product, in one kernel call instead of two or three: with q and k rotated together, the default draft's step
    2.40 → 2.23 ms); None for any other kind, which keeps one call each."""
    if all(isinstance(m, Int8Linear) and m.bias is None for m in linears):
        return Int8Linear.stacked(list(linears))
    return None
