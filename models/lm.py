"""A causal LM called step by step with a KV cache — the one way the speculative loop, the target-only baseline and
the cost profile call a model, so what the profile times is what decoding runs."""

from __future__ import annotations

import bisect
import functools
import inspect
import time
from collections.abc import Mapping, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from models.lean import LeanCache, LeanLlama, supports
from utils.cli import UserError


@functools.lru_cache(maxsize=None)
def _cache_name(cls) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kw(model, cache) -> dict:
    """The KV-cache keyword of `model.forward`: transformers renamed `past_key_values` to `cache` (the old name
    warns on every run and goes in 5.40); older 5.x releases know only the old one."""
    return {_cache_name(type(model)): cache}


class LM:
    """A causal LM called with a KV cache, returning logits (sliced to the pair vocab) and last hidden states.

    Uses the base model + output embedding directly (hidden = the final-norm output that produces the logits, as
    models.features defines it) so the LM head runs only on the positions asked for. Models that post-process logits
    (softcapping, logit scales) go through the full forward instead. With `lean` a plain Llama model runs
    models.lean's forward (transformers' numbers, bit for bit in float32; fewer calls) with its own cache.
    """

    def __init__(self, model, vocab_size: int, lean: bool = False):
        self.model = model
        self.vocab = vocab_size
        cfg = model.config
        self.plain = (
            hasattr(model, "base_model")
            and model.get_output_embeddings() is not None
            and not getattr(cfg, "final_logit_softcapping", None)
            and not getattr(cfg, "logit_scale", None)
        )
        self.base = model.base_model if self.plain else None
        self.head = model.get_output_embeddings() if self.plain else None
        # the token ids a reduced-vocabulary draft can give mass to (models.lm_head.SubsetHead), None for a full head:
        # q is exactly 0 elsewhere, so the loop reads its features on this support (DraftStep.support)
        ids = getattr(model.get_output_embeddings(), "ids", None)
        self.support = ids if isinstance(ids, torch.Tensor) else None
        self.device = next(model.parameters()).device
        self.lean = LeanLlama(model) if lean and self.plain and supports(model) else None  # ~1 ms to build
        self.tree_refusal = _tree_refusal(cfg)
        # transformers hands a 4D mask to attention as is: sdpa takes booleans, eager adds it to the scores
        self.additive_mask = getattr(cfg, "_attn_implementation", None) == "eager"

    @classmethod
    def of(cls, pair, role: str) -> "LM":
        """The pair's `role` model ("draft" or "target") with the forward `pair.forward` resolved to for it (an object
        without `forwards`: transformers')."""
        return cls(getattr(pair, role), pair.vocab_size, lean=getattr(pair, "forwards", {}).get(role) == "lean")

    def new_cache(self):
        """A DynamicCache, or a models.lean.LeanCache for the lean forward: both `crop(-m)` the last m positions."""
        return self.lean.new_cache() if self.lean else DynamicCache(config=self.model.config)

    def __call__(self, ids: list[int], cache, last: int, positions: torch.Tensor | Sequence[int] | None = None,
                 mask: torch.Tensor | None = None, layers: Sequence[int] = ()):
        """Run `ids` after the cache; logits (last, V) and hidden (last, d) of the final `last` positions (0 = none).

        A token-tree call gives `positions` (n,) — each new token's rotary position — and `mask` (n, cache_len + n)
        bool — True where a new token attends to a cache position or a new token (`tree_attention` builds both). The
        new tokens' keys/values still go to cache positions cache_len .. cache_len + n - 1; `keep` then compacts the
        accepted path. Both None (the default): exactly the chain call, bit for bit.

        `layers`: a third value, the hidden states of those layers at all n new positions, (len(layers), n, d), indexed
        as transformers' `hidden_states` (0 the embeddings, i the output of decoder layer i, the last the final-norm
        output) on both forwards — what a draft reading the target's features (EAGLE-3) needs from a verification.
        A call that asks for none computes and returns what it did before."""
        x = torch.tensor([ids], device=self.device)
        positions, mask = self._tree_args(len(ids), cache, positions, mask)
        tree = {} if mask is None else {"position_ids": positions[None], "attention_mask": self._hf_mask(mask)}
        taps = None
        if self.plain:
            if self.lean:
                h = self.lean.hidden(x[0], cache, positions, mask, layers)
                h, taps = (h[0][0], h[1]) if layers else (h[0], None)
                taps = taps and [taps[i][0] for i in layers]
            else:
                out = self.base(input_ids=x, **cache_kw(self.base, cache), use_cache=True, **tree,
                                output_hidden_states=bool(layers))
                h = out.last_hidden_state[0]
                taps = [out.hidden_states[i][0] for i in layers] if layers else None
            logits = None if last == 0 else self.head(h[-last:])[..., : self.vocab]
            result = (logits, None if last == 0 else h[-last:])
        else:
            out = self.model(input_ids=x, **cache_kw(self.model, cache), use_cache=True, output_hidden_states=True,
                             logits_to_keep=max(last, 1), **tree)
            taps = [out.hidden_states[i][0] for i in layers] if layers else None
            result = (None, None) if last == 0 else (out.logits[0, -last:, : self.vocab],
                                                     out.hidden_states[-1][0, -last:])
        return (*result, torch.stack(taps)) if layers else result

    def _tree_args(self, n: int, cache, positions, mask) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """positions and mask on the model's device, checked against the call (a wrong shape would otherwise surface
        as a broadcast error deep in attention, or silently attend to the wrong keys)."""
        if positions is None and mask is None:
            return None, None
        if positions is None or mask is None:
            raise ValueError("a tree call gives both positions and mask")
        if self.tree_refusal:
            raise UserError(self.tree_refusal)
        positions = torch.as_tensor(positions, dtype=torch.long, device=self.device).reshape(-1)
        mask = torch.as_tensor(mask, device=self.device)
        end = cache.get_seq_length() + n
        if positions.shape[0] != n or tuple(mask.shape) != (n, end) or mask.dtype != torch.bool:
            raise ValueError(f"a tree call of {n} tokens after {end - n} cached needs positions ({n},) and a bool "
                             f"mask ({n}, {end}), got {tuple(positions.shape)} and {mask.dtype} {tuple(mask.shape)}")
        start = end - n
        if (torch.equal(positions, torch.arange(start, end, device=self.device))
                and torch.equal(mask, torch.ones(n, end, dtype=torch.bool, device=self.device).tril(start))):
            return None, None  # a chain appended to the cache (a tree's spine level, a chain-shaped tree): run it plain
        return positions, mask

    def _hf_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """A tree mask as transformers' attention takes it: (1, 1, n, end), boolean for sdpa, additive for eager (0 or
        the dtype's minimum, as transformers' own eager masks)."""
        if not self.additive_mask:
            return mask[None, None]
        dtype = self.model.dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)[
            None, None]

    def keep(self, cache, idx: torch.Tensor | Sequence[int]) -> None:
        """Keep only cache positions `idx` (sorted, distinct), moved to 0 .. len(idx) - 1 in order: after a token-tree
        round, the prefix [0, prefix_len) and the accepted path's nodes. Keys carry their rotary position,
        which stays right because a root path's nodes sit at consecutive positions (`tree_attention`). Entries
        already in place stay put (a prefix range is a crop); only the moved tail is copied, in place."""
        idx = idx.tolist() if isinstance(idx, torch.Tensor) else list(idx)
        m, length = len(idx), cache.get_seq_length()
        if m and (idx[0] < 0 or idx[-1] >= length):
            raise ValueError(f"keep: positions {idx[0]}..{idx[-1]} outside the cache's {length}")
        # idx[j] - j never decreases for sorted distinct positions, so the entries in place are a prefix
        start = bisect.bisect_left(range(m), True, key=lambda j: idx[j] != j)
        tail = idx[start:]
        if tail and tail[0] <= start or any(b <= a for a, b in zip(tail, tail[1:])):
            raise ValueError("keep: positions must be sorted and distinct")
        if not tail:
            if m < length:
                cache.crop(m - length)
            return
        src = torch.tensor(tail, device=self.device)
        if isinstance(cache, LeanCache):
            cache.compact(start, src)
            return
        for layer in cache.layers:
            if type(layer) is not DynamicLayer:
                raise NotImplementedError(f"keep moves entries of full-attention DynamicLayers only, not "
                                          f"{type(layer).__name__}")
            if layer.is_initialized:
                for name in ("keys", "values"):
                    t = getattr(layer, name)
                    t[:, :, start:m] = t[:, :, src]
                    setattr(layer, name, t[:, :, :m])


def _tree_refusal(cfg) -> str | None:
    """Why a model cannot run token-tree calls exactly (None: it can). A tree's 4D mask replaces the one transformers
    would build, so a sliding-window or local layer would lose its window (GPT-Neo's own local band counts cache
    slots, not positions), and only sdpa and eager attention take a user mask as given."""
    name = getattr(cfg, "model_type", None) or "this model"
    kinds = set(getattr(cfg, "layer_types", None) or ()) | set(getattr(cfg, "attention_layers", None) or ())
    windowed = bool(kinds - {"full_attention", "global"}) or bool(
        getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) is not False)
    if windowed:
        return f"token trees need full attention in every layer; {name} has sliding-window or local layers"
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"token trees need sdpa or eager attention; {name} runs {impl}"
    return None


def tree_attention(parents: Sequence[int], nodes: Sequence[int], prefix_len: int, cache_len: int,
                   cached: Mapping[int, int] | None = None,
                   device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, mask) of an `LM` call that runs tree `nodes` after a committed prefix of `prefix_len` tokens.

    `parents[i]`: tree node i's parent (-1: a child of the prefix's last token), always an earlier node. Node i sees
    the prefix, its ancestors and itself, at rotary position prefix_len + depth(i) (the prefix's children: depth 0) —
    where it would sit on its root path run as a chain, so its logits are that chain's. The call's tokens go to cache
    positions cache_len, cache_len + 1, ...; an ancestor is either one of them or a node an earlier call of the round
    ran, at cache position `cached[node]` (a draft growing the tree level by level). With cache_len < prefix_len the
    call first runs the prefix's last prefix_len - cache_len tokens (the pending committed ones, causally; then
    `cached` must be empty), then `nodes` (a target verifying the tree in one call). Order within a call is free: a
    call computes all its keys before attending. Returns positions (rows,) long and mask (rows, cache_len + rows)
    bool, rows = max(prefix_len - cache_len, 0) + len(nodes): the `positions` and `mask` of `LM.__call__`."""
    cached = dict(cached or {})
    pending = max(prefix_len - cache_len, 0)
    if pending and cached:
        raise ValueError("pending prefix tokens run before any tree node is cached")
    rows, first = pending + len(nodes), cache_len + pending
    where = {**cached, **{node: first + j for j, node in enumerate(nodes)}}
    positions, ri, ci = list(range(cache_len, prefix_len)), [], []
    for row, node in enumerate(nodes, start=pending):
        depth, a = -1, node
        while a >= 0:
            if a not in where:
                raise ValueError(f"tree node {node}'s ancestor {a} is neither cached nor in the call")
            if parents[a] >= a:
                raise ValueError(f"tree node {a}'s parent {parents[a]} is not -1 or an earlier node")
            ri.append(row)
            ci.append(where[a])
            depth, a = depth + 1, parents[a]
        positions.append(prefix_len + depth)
    # one tensor op per part, not one per entry (~3 us each: a 60-node tree has hundreds)
    mask = torch.zeros(rows, cache_len + rows, dtype=torch.bool)
    mask[:pending, : cache_len + pending] = torch.ones(pending, cache_len + pending, dtype=torch.bool).tril(cache_len)
    mask[pending:, :prefix_len] = True
    mask[ri, ci] = True
    return torch.tensor(positions, dtype=torch.long).to(device), mask.to(device)


def target_pass(lm: LM, ids: list[int], cache, last: int, layers=(), **kw):
    """A verification's call: (logits, the hidden states at `layers` or None when it names none)."""
    if layers:
        logits, _, taps = lm(ids, cache, last=last, layers=tuple(layers), **kw)
        return logits, taps
    logits, _ = lm(ids, cache, last=last, **kw)
    return logits, None


class Clock:
    """perf_counter that synchronises CUDA first, so timed regions on GPU measure finished work."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()
