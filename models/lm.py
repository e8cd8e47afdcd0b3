"""A causal LM called step by step with a KV cache — the one way the speculative loop, the target-only baseline and
the cost profile call a model, so what the profile times is what decoding runs."""

from __future__ import annotations

import functools
import inspect
import time

import torch
from transformers import DynamicCache

from models.lean import LeanLlama, supports


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

    @classmethod
    def of(cls, pair, role: str) -> "LM":
        """The pair's `role` model ("draft" or "target") with the forward `pair.forward` resolved to for it (an object
        without `forwards`: transformers')."""
        return cls(getattr(pair, role), pair.vocab_size, lean=getattr(pair, "forwards", {}).get(role) == "lean")

    def new_cache(self):
        """A DynamicCache, or a models.lean.LeanCache for the lean forward: both `crop(-m)` the last m positions."""
        return self.lean.new_cache() if self.lean else DynamicCache(config=self.model.config)

    def __call__(self, ids: list[int], cache, last: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run `ids` after the cache; logits (last, V) and hidden (last, d) of the final `last` positions (0 = none)."""
        x = torch.tensor([ids], device=self.device)
        if self.plain:
            if self.lean:
                h = self.lean.hidden(x[0], cache)[0]
            else:
                h = self.base(input_ids=x, **cache_kw(self.base, cache), use_cache=True).last_hidden_state[0]
            if last == 0:
                return None, None
            h = h[-last:]
            return self.head(h)[..., : self.vocab], h
        out = self.model(input_ids=x, **cache_kw(self.model, cache), use_cache=True, output_hidden_states=True,
                         logits_to_keep=max(last, 1))
        if last == 0:
            return None, None
        return out.logits[0, -last:, : self.vocab], out.hidden_states[-1][0, -last:]


class Clock:
    """perf_counter that synchronises CUDA first, so timed regions on GPU measure finished work."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()
