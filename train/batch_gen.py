"""The one batched generator of the training stage: a model's continuations of many prompts at several temperatures,
with the model's top-k probabilities recorded before every new token.

Why not transformers' `generate`: the distillation data (train.distill_data) answers each prompt greedily and twice at
T = 1, ~2M positions on a 2-core CPU, and `generate` spends most of that time on work that makes no token:
- it prefills a prompt once per temperature, and prefills a padded batch, so short prompts pay for the longest;
- a batch runs until its longest row ends, finished rows still computed (responses end anywhere in 1..256 tokens);
- its cache re-concatenates every layer's keys and values at every step (a fifth of a batched CPU step).
Here each prompt is prefilled once, alone (no padding), and only its last position goes through the LM head; the rows
of all temperatures decode together as one left-padded batch; finished rows leave the batch and all-padding columns
are cut; the cache is a preallocated buffer written in place (`_BufferLayer`). `bench.distill_throughput` measures the
gain against the bare batched `generate` of the same responses.

Greedy rows are the model's argmax at every step (the tests compare them with `generate` and the top-k with a
teacher-forced pass); sampled rows draw from softmax(logits / T) with one seeded generator per call.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from models.lm import cache_kw


class _BufferLayer(DynamicLayer):
    """One layer's keys and values in a buffer with room for every token to come: a step writes its new token in
    place and hands attention a view, where DynamicLayer copies the whole cache by concatenation."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        super().__init__()
        b, h, n, d = keys.shape
        self.kbuf, self.vbuf = keys.new_empty(b, h, capacity, d), values.new_empty(b, h, capacity, d)
        self.kbuf[:, :, :n], self.vbuf[:, :, :n] = keys, values
        self.n, self.device, self.is_initialized = n, keys.device, True
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self.kbuf[:, :, : self.n], self.vbuf[:, :, : self.n]

    def update(self, key_states, value_states, *args, **kwargs):
        q = key_states.shape[-2]
        if self.n + q > self.kbuf.shape[-2]:
            raise RuntimeError(f"cache buffer full ({self.kbuf.shape[-2]} positions)")  # capacity is planned exactly
        self.kbuf[:, :, self.n : self.n + q], self.vbuf[:, :, self.n : self.n + q] = key_states, value_states
        self.n += q
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n

    def select(self, rows: torch.Tensor, drop_left: int) -> None:
        """Keep `rows` of the batch and forget the first `drop_left` columns (padding for every kept row)."""
        self.kbuf, self.vbuf = self.kbuf[rows, :, drop_left:], self.vbuf[rows, :, drop_left:]
        self.n -= drop_left
        self._views()


def prefill(model, prompt: list[int], device):
    """One prompt alone: its last position's logits and its transformers DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt], device=device), **cache_kw(model, cache), use_cache=True,
                logits_to_keep=1)
    return out.logits[0, -1], cache


def _prefill(model, prompt: list[int], device) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One prompt alone: its last position's logits and every layer's (keys, values)."""
    last, cache = prefill(model, prompt, device)
    return last, [(layer.keys, layer.values) for layer in cache.layers]


def _batch_cache(kvs: list[list[tuple[torch.Tensor, torch.Tensor]]], lengths: list[int], repeats: int,
                 capacity_extra: int) -> Cache:
    """The prompts' caches right-aligned in one left-padded batch, each row repeated `repeats` times in a row."""
    width = max(lengths)
    layers = []
    for layer in range(len(kvs[0])):
        k0 = kvs[0][layer][0]
        keys = k0.new_zeros(len(kvs), k0.shape[1], width, k0.shape[3])
        values = torch.zeros_like(keys)
        for r, n in enumerate(lengths):
            keys[r, :, width - n :], values[r, :, width - n :] = kvs[r][layer][0][0], kvs[r][layer][1][0]
        keys, values = keys.repeat_interleave(repeats, 0), values.repeat_interleave(repeats, 0)
        layers.append(_BufferLayer(keys, values, width + capacity_extra))
    return Cache(layers=layers)


def _choose(logits: torch.Tensor, temps: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Next token per row: argmax where the row's temperature is 0, else a draw from softmax(logits / T) by inverting
    its CDF at one uniform (torch.multinomial takes ~65 ms for 48 rows of a 49k vocabulary on this CPU, this ~5)."""
    greedy = logits.argmax(-1)
    sampled = temps > 0
    if not bool(sampled.any()):
        return greedy
    cdf = torch.softmax(logits[sampled].float() / temps[sampled, None], -1).double().cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=gen, dtype=torch.float64).to(cdf.device) * cdf[:, -1:]
    draw = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
    greedy[sampled] = draw
    return greedy


@torch.inference_mode()
def respond(model, prompts: list[list[int]], temperatures: list[float], max_new_tokens: int, topk: int, seed: int,
            vocab: int, eos: set[int], logit_mask: torch.Tensor | None = None, compact_every: float = 0.125
            ) -> list[list[dict]]:
    """`model`'s continuations of token-id `prompts`, one per temperature (0 = greedy): out[prompt][temperature] =
    {cont: ids up to and including the first EOS, vals, idx: (len(cont), topk) float16/int32}, the top-k of the
    softmax of the raw logits (first `vocab` columns, plus `logit_mask` if given: -inf outside a draft's subset)
    before each continuation token. Finished rows leave the batch once at least `compact_every` of it has finished."""
    device = next(model.parameters()).device
    nt = len(temperatures)
    gen = torch.Generator().manual_seed(int(seed))
    lasts, kvs = zip(*(_prefill(model, p, device) for p in prompts))
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    cache = _batch_cache(list(kvs), lengths, nt, max_new_tokens)
    mask = torch.zeros(len(prompts), width + max_new_tokens, dtype=torch.long, device=device)
    for r, n in enumerate(lengths):
        mask[r, width - n : width] = 1
    mask = mask.repeat_interleave(nt, 0)
    pos = torch.tensor(lengths, device=device).repeat_interleave(nt)  # position of the row's next token
    temps = torch.tensor(temperatures, dtype=torch.float32, device=device).repeat(len(prompts))
    rows = torch.arange(len(prompts) * nt, device=device)  # batch slot -> output row
    logits = torch.stack(lasts).repeat_interleave(nt, 0)
    conts = [[] for _ in range(len(prompts) * nt)]
    vals, idx = [[] for _ in conts], [[] for _ in conts]
    eos_t = torch.tensor(sorted(eos), device=device)
    done = torch.zeros(len(rows), dtype=torch.bool, device=device)
    col = width  # the mask column of the token about to be written
    for step in range(max_new_tokens):
        raw = logits[:, :vocab].float()
        if logit_mask is not None:
            raw = raw + logit_mask.to(raw.device)
        probs = torch.softmax(raw, -1)
        v, i = probs.topk(topk, -1)
        nxt = _choose(raw, temps, gen)
        v16, i32, nxt_l, done_l = v.to(torch.float16).cpu(), i.to(torch.int32).cpu(), nxt.tolist(), done.tolist()
        for s, r in enumerate(rows.tolist()):
            if not done_l[s]:
                conts[r].append(nxt_l[s]), vals[r].append(v16[s]), idx[r].append(i32[s])
        done |= torch.isin(nxt, eos_t)
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        if int(done.sum()) >= max(1, int(compact_every * len(rows))):
            keep = (~done).nonzero().squeeze(1)
            live = mask[keep, :col]
            drop = int((live.sum(0) > 0).int().argmax()) if live.numel() else 0
            for layer in cache.layers:
                layer.select(keep, drop)
            mask, pos, temps, rows, nxt, done = (mask[keep, drop:], pos[keep], temps[keep], rows[keep], nxt[keep],
                                                 done[keep])
            col -= drop
        mask[:, col] = 1
        out = model(input_ids=nxt[:, None], attention_mask=mask[:, : col + 1], position_ids=pos[:, None],
                    **cache_kw(model, cache), use_cache=True)
        logits, pos, col = out.logits[:, -1], pos + 1, col + 1
    return [[{"cont": conts[p * nt + t], "vals": _stack(vals[p * nt + t], topk, torch.float16),
              "idx": _stack(idx[p * nt + t], topk, torch.int32)} for t in range(nt)] for p in range(len(prompts))]


def _stack(parts: list[torch.Tensor], k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack(parts) if parts else torch.zeros(0, k, dtype=dtype)
