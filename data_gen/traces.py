"""Trace generation: batched rollouts with KV caches, then per-position draft/target statistics (one row each).

The rows each trace kind (data_gen.kinds) makes. Two chain kinds (DESIGN.md "Trace kinds"):
- `target_ar` (DISCO): the target generates the continuation (greedy, or sampled with a per-prompt seed). p at every
  generated position comes from the generation steps themselves (the logits the target produced that token from;
  `p_source: teacher_forced` recomputes them in one batched pass instead, equal within fp error — tested), and ONE
  batched teacher-forced draft pass over prompt + continuation gives q (and the draft's last hidden state).
  The drafted token is argmax q (greedy) or x ~ q (sampling).
- `interleaved` (SPRINTER): each prompt gets one of four context kinds in equal shares — `prompt` (original text:
  the reference continuation, or the prompt's own tail when there is none), `draft` (the draft's completion),
  `target` (the target's completion), `mixed` (each token from draft or target at random). One joint rollout steps
  both models on the shared context, so q, the draft's hidden state and p are known at every position without
  extra passes; then the draft samples x ~ q at each position and p(x) is read off.

A third kind, `tree` (issue 30, token trees): the target's greedy continuation y as `target_ar` makes it, then the
draft walks along y with one KV cache and at every `stride`-th position grows a bounded candidate tree
(models.tree.TopkExpander, EAGLE-2's expansion) before the tree's entries are dropped again (`LM.keep`). One row per
node (`tree_batch`), with the node-head columns of models.tree.node_columns (the verify and copy groups too, from the
rollout's target logits and the context along y); what a tree builder would pick from it is replayed by
eval.tree_replay.

Batch invariance: prompts are left-padded with an attention mask and explicit position ids, and every random draw
comes from a generator seeded by (trace seed, prompt id), consumed the same way whatever the batch — so batch size,
shard split and resume never change a row (up to fp rounding of batched matmuls).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from data_gen.tree_format import TREE_COLUMNS
from models.distributions import draft_probs, entropy, greedy_ids, top2_margin, topk_probs, tvd
from models.lm import cache_kw



@dataclass
class Item:
    """One prompt to trace: its token ids after rendering/truncation and, for `prompt` contexts, forced tokens."""

    prompt_id: str
    split: str
    kind: str  # target_ar | prompt | draft | target | mixed
    prefix: list[int]
    forced: list[int] | None = None
    meta: dict = field(default_factory=dict)


def prompt_generator(seed: int, prompt_id: str, purpose: str) -> torch.Generator:
    """A CPU generator seeded by (seed, prompt, purpose): the same draws for a prompt whatever batch/shard it is in."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{purpose}".encode()).digest()
    gen = torch.Generator()
    gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return gen


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens drawn from rows of `probs` (N, V) with given uniforms u (N,): the first index whose CDF exceeds u."""
    cdf = probs.float().cumsum(-1)
    u = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def _left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, position ids) for left-padded sequences; positions count real tokens only."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), pos.to(device)


def _forward(model, ids, mask, pos, cache=None):
    """Last hidden states (after the final norm) of a causal LM; the LM head is applied by the caller where needed."""
    decoder = model.get_decoder()
    out = decoder(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kw(decoder, cache), use_cache=cache is not None)
    return out.last_hidden_state


def _head(model, hidden: torch.Tensor, vocab: int) -> torch.Tensor:
    return model.get_output_embeddings()(hidden)[..., :vocab]


@dataclass
class Rollout:
    tokens: list[list[int]]  # continuation per row (ends with EOS when one was produced)
    target_logits: torch.Tensor | None  # (B, steps, V) logits the target produced each continuation token from
    draft_logits: torch.Tensor | None  # (B, steps, V) same for the draft (joint rollouts only)
    draft_hidden: torch.Tensor | None  # (B, steps, d)


def _choose(items: list[Item], step: int, t_list: list[int], d_list: list[int] | None, u: torch.Tensor,
            mix_share: float, pad_id: int) -> list[int]:
    """The token each row's context gets at `step`: forced (prompt), the draft's (draft, mixed with probability
    `mix_share`) or the target's."""
    chosen = []
    for i, it in enumerate(items):
        if it.kind == "prompt":
            chosen.append(it.forced[step] if step < len(it.forced) else pad_id)
        elif it.kind == "draft" or (it.kind == "mixed" and float(u[i, 0]) < mix_share):
            chosen.append(d_list[i])
        else:
            chosen.append(t_list[i])
    return chosen


@torch.no_grad()
def rollout(pair, items: list[Item], trace_cfg, step_draft: bool) -> Rollout:
    """Generate every item's continuation with KV caches, batched (left padding + masks + explicit positions).

    The target always steps; the draft steps too when `step_draft` (interleaved: draft and mixed contexts need its
    tokens, and its q/hidden come for free). Finished rows keep stepping on padding until the batch is done; their
    extra tokens are dropped, and causal masking keeps them from touching other rows.
    """
    from transformers import DynamicCache

    vocab, device = pair.vocab_size, pair.device
    temperature, top_p = float(trace_cfg.get("temperature", 0.0)), float(trace_cfg.get("top_p", 1.0))
    max_new = int(trace_cfg.max_new_tokens)
    mix_share = float(trace_cfg.get("mix_draft_share", 0.5))
    seed = int(trace_cfg.get("seed", 0))
    stop = pair.eos_ids
    pad_id = pair.tokenizer.pad_token_id
    gens = [prompt_generator(seed, it.prompt_id, "rollout") for it in items]
    ids, mask, pos = _left_pad([it.prefix for it in items], pad_id, device)
    caches = {"t": DynamicCache(), "d": DynamicCache() if step_draft else None}
    t_hidden = _forward(pair.target, ids, mask, pos, caches["t"])[:, -1]
    d_hidden = _forward(pair.draft, ids, mask, pos, caches["d"])[:, -1] if step_draft else None
    next_pos = pos[:, -1] + 1
    B = len(items)
    tokens: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    t_steps, d_steps, h_steps = [], [], []
    for step in range(max_new):
        t_logits = _head(pair.target, t_hidden, vocab)
        t_steps.append(t_logits)
        u = torch.stack([torch.rand(3, generator=g) for g in gens])  # (B, 3): mix choice, target draw, draft draw
        if temperature > 0:
            t_tok = sample_inverse_cdf(draft_probs(t_logits, temperature, top_p), u[:, 1])
        else:
            t_tok = greedy_ids(t_logits)
        if step_draft:
            d_logits = _head(pair.draft, d_hidden, vocab)
            d_steps.append(d_logits)
            h_steps.append(d_hidden)
            if temperature > 0:
                d_tok = sample_inverse_cdf(draft_probs(d_logits, temperature, top_p), u[:, 2])
            else:
                d_tok = greedy_ids(d_logits)
        # one device sync per step, not one per row
        chosen = _choose(items, step, t_tok.tolist(), d_tok.tolist() if step_draft else None, u, mix_share, pad_id)
        for i, (it, tok) in enumerate(zip(items, chosen)):
            if not done[i]:
                tokens[i].append(tok)
                done[i] = tok in stop or (it.kind == "prompt" and len(tokens[i]) >= len(it.forced))
        if all(done) or step == max_new - 1:
            break
        feed = torch.tensor(chosen, dtype=torch.long, device=device).unsqueeze(-1)
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=-1)
        t_hidden = _forward(pair.target, feed, mask, next_pos.unsqueeze(-1), caches["t"])[:, -1]
        if step_draft:
            d_hidden = _forward(pair.draft, feed, mask, next_pos.unsqueeze(-1), caches["d"])[:, -1]
        next_pos = next_pos + 1
    stack = lambda xs: torch.stack(xs, dim=1) if xs else None  # noqa: E731
    return Rollout(tokens, stack(t_steps), stack(d_steps), stack(h_steps))


@torch.no_grad()
def teacher_forced(model, items: list[Item], conts: list[list[int]], pair, want_hidden: bool):
    """One batched pass over prefix + continuation: per row the (logits, hidden) that predict each continuation token."""
    seqs = [it.prefix + c for it, c in zip(items, conts)]
    ids, mask, pos = _left_pad(seqs, pair.tokenizer.pad_token_id, pair.device)
    hidden = _forward(model, ids, mask, pos)
    width = ids.shape[1]
    out = []
    for i, (it, c) in enumerate(zip(items, conts)):
        start = width - len(seqs[i]) + len(it.prefix) - 1  # the position whose output predicts c[0]
        h = hidden[i, start : start + len(c)]
        out.append((_head(model, h, pair.vocab_size), h if want_hidden else None))
    return out


def position_stats(q_logits, p_logits, x, temperature: float, top_p: float, k: int) -> dict[str, np.ndarray]:
    """Per-position statistics for drafted tokens x (L,) given draft and target logits (L, V)."""
    q = draft_probs(q_logits, temperature, top_p)
    p = draft_probs(p_logits, temperature, top_p)
    idx = x.unsqueeze(-1)
    return {
        "draft_token": x.to(torch.int32),
        "target_token": p.argmax(-1).to(torch.int32),
        "q_draft": q.gather(-1, idx).squeeze(-1),
        "p_draft": p.gather(-1, idx).squeeze(-1),
        "tvd": tvd(p, q),
        "draft_entropy": entropy(q),
        "target_entropy": entropy(p),
        # top-1 minus top-2 probability of p: how sure the target was (a disco_plus verify feature, models.features)
        "target_margin": top2_margin(p),
        # H_{q,p} = −Σ q log p (nats): SVIP Fig. 3's ratio H_qp/H_q and the Pinsker bound via KL(q‖p) = H_qp − H_q
        "cross_entropy": -(q * torch.log(p.clamp_min(1e-30))).sum(-1),
        "draft_topk": topk_probs(q, k),
    }


@torch.no_grad()
def chain_batch(pair, items: list[Item], trace_cfg, joint: bool) -> list[dict[str, np.ndarray]]:
    """Rows (as column arrays, one dict per item, in position order) of a chain kind for a batch of items: `joint`
    (interleaved) steps draft and target together and samples x ~ q; otherwise (target_ar) one teacher-forced draft
    pass over the target's continuation gives q."""
    temperature, top_p = float(trace_cfg.get("temperature", 0.0)), float(trace_cfg.get("top_p", 1.0))
    k = int(trace_cfg.get("topk", 10))
    store_hidden = bool(trace_cfg.get("store_hidden", joint))
    seed = int(trace_cfg.get("seed", 0))
    roll = rollout(pair, items, trace_cfg, step_draft=joint)
    if joint:
        drafts = [(roll.draft_logits[i, : len(c)], roll.draft_hidden[i, : len(c)]) for i, c in enumerate(roll.tokens)]
    else:
        drafts = teacher_forced(pair.draft, items, roll.tokens, pair, want_hidden=store_hidden)
    if str(trace_cfg.get("p_source", "generation")) == "teacher_forced":
        targets = [lg for lg, _ in teacher_forced(pair.target, items, roll.tokens, pair, want_hidden=False)]
    else:
        targets = [roll.target_logits[i, : len(c)] for i, c in enumerate(roll.tokens)]
    results = []
    for i, it in enumerate(items):
        n = len(roll.tokens[i])
        q_logits, hidden = drafts[i]
        # x ~ q always for interleaved (SPRINTER); target_ar drafts greedily at T=0, else samples
        if joint or temperature > 0:
            u = torch.rand(n, generator=prompt_generator(seed, it.prompt_id, "draft_token"))
            x = sample_inverse_cdf(draft_probs(q_logits, temperature, top_p), u).to(q_logits.device)
        else:
            x = greedy_ids(q_logits)
        stats = position_stats(q_logits, targets[i], x, temperature, top_p, k)
        cols = {name: t.float().cpu().numpy() if t.is_floating_point() else t.cpu().numpy() for name, t in stats.items()}
        cols["position"] = np.arange(n, dtype=np.int32)
        if store_hidden:
            cols["draft_hidden"] = hidden.float().cpu().numpy().astype(np.float16)
        cols["prompt_id"], cols["split"], cols["kind"], cols["n"] = it.prompt_id, it.split, it.kind, n
        cols["continuation"] = roll.tokens[i]
        # the token the context actually got at each position (the target's for target_ar, the context kind's for
        # interleaved) and the prompt: copy features are computed from them at load time (models.features)
        cols["context_token"] = np.asarray(roll.tokens[i], dtype=np.int32)
        cols["prompt_tokens"] = list(it.prefix)
        results.append(cols)
    return results


def tree_rows(draft, prefix: list[int], y: list[int], expander, stride: int, k: int,
              root_stats: tuple[np.ndarray, np.ndarray] | None = None, skip: int = 0) -> dict[str, np.ndarray]:
    """One prompt's tree rows: the draft walks along y with one cache; at positions t = 0, stride, 2·stride, ... its
    pending tokens are y up to t (at t = 0 the prompt, less its first `skip` tokens: EAGLE-3's position i holds token
    i + 1), it grows a candidate tree there and the tree's cache entries are dropped. A node's
    columns (structure, q_token, joint, the DISCO features of the distribution it was drawn from, and the groups
    `verify` and `copy`) are models.tree.node_columns', the function decode's node heads read too: the tree at t
    carries its root context prompt + y[:t] (a ContextIndex kept along y) and, as `verify`, (H_p, top-2 margin) of
    the target distribution y[t − 1] came from — `root_stats` (entropy, margin) per position of y, (0, 0) at t = 0
    as before a decode's first verification. `on_path`: the node's root path is y[t : t + depth] (greedy
    verification accepts it)."""
    from models.features.context import ContextIndex
    from models.features.nodes import node_columns
    from models.tree import grow

    stored = [c for c in TREE_COLUMNS if c not in ("on_path", "length")]
    if root_stats is None:
        root_stats = (np.zeros(len(y), np.float32), np.zeros(len(y), np.float32))
    parts: list[dict] = []
    dcache, last = draft.new_cache(), 0
    index = ContextIndex(prefix)  # prompt + y[:last]
    for t in range(0, len(y), stride):
        pending = list(prefix[skip:]) if t == 0 else y[last:t]  # the cache holds prefix + y[:last]
        for tok in y[last:t]:
            index.push(int(tok))
        verify = (0.0, 0.0) if t == 0 else (float(root_stats[0][t - 1]), float(root_stats[1][t - 1]))
        tree, prefix_len, _ = grow(draft, dcache, pending, expander, context=index, verify=verify)
        draft.keep(dcache, list(range(prefix_len)))
        last = t
        cols = node_columns(tree, list(range(len(tree))), k, draft.support, ("verify", "copy"))
        on: list[bool] = []
        for par, tok, d in zip(tree.parents, tree.tokens, tree.depth):
            on.append((par < 0 or on[par]) and t + d - 1 < len(y) and tok == y[t + d - 1])
        n = len(tree)
        parts.append({"position": np.full(n, t, np.int32), **{c: cols[c] for c in stored},
                      "on_path": np.asarray(on, dtype=bool), "length": np.full(n, len(y), np.int32),
                      "draft_topk": cols["draft_topk"]})
    empty = {"draft_topk": np.zeros((0, k), np.float32), "on_path": np.zeros(0, bool)}
    empty.update({c: np.zeros(0, np.float32) for c in stored if c not in ("node", "parent", "depth", "rank", "token")})
    names = ("position", *TREE_COLUMNS, "draft_topk")
    return {name: np.concatenate([p[name] for p in parts]) if parts else empty.get(name, np.zeros(0, np.int32))
            for name in names}


@torch.no_grad()
def tree_batch(pair, items: list[Item], trace_cfg, walker=None) -> list[dict[str, np.ndarray]]:
    """`tree` rows for a batch of items: the target's greedy continuations in one batched rollout (as `target_ar`),
    then per prompt the draft's walk (`tree_rows`, batch 1: each position's tree has its own shape). `walker(item,
    y)` gives the draft that walks an item and the prompt tokens it skips (None: the pair's draft LM, none)."""
    from models.lm import LM
    from models.tree import TopkExpander

    roll = rollout(pair, items, trace_cfg, step_draft=False)
    if walker is None:
        draft = LM.of(pair, "draft")
        walker = lambda it, y: (draft, 0)  # noqa: E731
    expander = TopkExpander(int(trace_cfg.get("tree_topk", 4)), int(trace_cfg.get("tree_depth", 5)))
    stride, k = int(trace_cfg.get("stride", 1)), int(trace_cfg.get("topk", 10))
    results = []
    for i, (it, y) in enumerate(zip(items, roll.tokens)):
        # the target's distribution at each position of y, as generated (greedy: softmax of its logits), as
        # `position_stats` and decode's verification statistics read it: the tree at t + 1's verify group
        p = draft_probs(roll.target_logits[i, : len(y)], 0.0)
        stats = (entropy(p).float().cpu().numpy(), top2_margin(p).float().cpu().numpy())
        draft, skip = walker(it, list(y))
        cols = tree_rows(draft, it.prefix, list(y), expander, stride, k, stats, skip)
        cols["prompt_id"], cols["split"], cols["kind"], cols["n"] = it.prompt_id, it.split, "tree", len(cols["node"])
        results.append(cols)
    return results
