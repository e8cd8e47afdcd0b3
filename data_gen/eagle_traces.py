"""EAGLE-3 traces (issue 53). `trace=eagle_chain`: for every start position of the target's greedy continuation,
the chain the EAGLE-3 draft drafts from there, one row per drafting step. `trace=eagle_tree`: the candidate tree it
grows at every position, one row per node, as trace=tree's (`eagle_tree_batch`).

A student's q at a position does not depend on where its round began (its state is the text), so a target_ar trace
holds one row per position. EAGLE-3's does: step j of a round reads the draft's own outputs of steps 0..j−1 as
features, so the row of position t + j drafted by a round that began at t is its own row. Rounds begin anywhere, so
every start t gets the chain a round beginning there drafts: steps j = 0 .. K − 1 (`trace.steps`), each fed the
target's token y_{t+j−1} (a step is reached only when the ones before it were accepted, and under greedy an accepted
token is the target's; past a round's first rejection the decoder's later steps read the rejected token instead,
the one approximation a replay keeps, as on the student's traces). One training-time-test pass of the draft
(models.eagle3.forward_steps, tested equal to drafting) gives all of them: step j's row P + t − 2 (P prompt tokens)
is the round-at-t chain's j-th token.

Columns: those of target_ar rows (position = t + j, the drafted token's place in the continuation, and its q, p
statistics) plus `start` (t) and `step` (j); the rows of one start are in step order, starts in order. With
`store_hidden`, `draft_hidden` is [the layer's output at the step ‖ the fused target feature the round began
from (the last verified position's)]: what only this draft offers a stop head, and what the EAGLE-3 drafter hands a
head at decode time (decode.eagle3, DraftStep.hidden).
"""

from __future__ import annotations

import numpy as np
import torch

from data_gen.traces import Item, position_stats, rollout
from models.distributions import greedy_ids


def weights_path(t):
    """The trace config's EAGLE-3 weights (`trace.weights`; relative paths under the repository)."""
    from pathlib import Path

    from models.student import REPO_ROOT

    path = Path(str(t.get("weights")))
    return path if path.is_absolute() else REPO_ROOT / path


def load_eagle(pair, t):
    """The trace config's EAGLE-3 draft on the pair's target, in float32 (traces are statistics, not timings)."""
    from models.eagle3 import Eagle3

    return Eagle3.load(weights_path(t), pair.target).float().eval()


@torch.no_grad()
def _features(pair, seq: list[int], layers) -> torch.Tensor:
    """The target's hidden states (T, 3, H) at `layers` over one sequence (models.eagle3.target_features, what the
    draft was trained on)."""
    from models.eagle3 import target_features

    return target_features(pair.target, torch.tensor([seq]), None, layers)[0]


@torch.no_grad()
def eagle_rows(pair, draft, it: Item, cont: list[int], p_logits: torch.Tensor, t) -> dict[str, np.ndarray]:
    """One item's rows (module docstring): starts t = 0 .. n − 1, steps j < min(K, n − t)."""
    steps, k, store = int(t.get("steps", 8)), int(t.get("topk", 10)), bool(t.get("store_hidden", True))
    seq, P, n = it.prefix + cont, len(it.prefix), len(cont)
    feats = _features(pair, seq, draft.cfg.layers).to(next(draft.parameters()).device)
    outs = draft.forward_steps(torch.tensor([seq], device=feats.device), feats[None], steps)
    fused = draft.fuse(feats)
    cols: dict[str, list] = {}
    for j, out in enumerate(outs):
        if j >= n:  # a continuation shorter than the steps: no start drafts this far
            break
        starts = torch.arange(0, n - j)
        rows = P + starts - 2  # the row of forward_steps that drafts y_{t+j} at step j of a round begun at t
        keep = rows >= 0
        starts, rows = starts[keep], rows[keep]
        z = draft.logits(out[0, rows]).float()
        q_logits = z.new_full((len(rows), pair.vocab_size), float("-inf")).index_copy_(1, draft.ids, z)
        stats = position_stats(q_logits, p_logits[starts + j].float().to(z.device), greedy_ids(q_logits),
                               0.0, 1.0, k)
        part = {name: v.float().cpu().numpy() if v.is_floating_point() else v.cpu().numpy()
                for name, v in stats.items()}
        part["start"], part["step"] = starts.numpy().astype(np.int32), np.full(len(rows), j, dtype=np.int32)
        if store:
            part["draft_hidden"] = torch.cat([out[0, rows], fused[rows]], -1).float().cpu().numpy().astype(np.float16)
        for name, v in part.items():
            cols.setdefault(name, []).append(v)
    merged = {name: np.concatenate(v) for name, v in cols.items()}
    order = np.lexsort((merged["step"], merged["start"]))  # starts in order, each start's steps in order
    merged = {name: v[order] for name, v in merged.items()}
    merged["position"] = (merged["start"] + merged["step"]).astype(np.int32)
    return merged


def eagle_batch(pair, items: list[Item], t) -> list[dict]:
    """Rows of a batch of items (one dict of columns per item): the target's greedy continuations (batched, as
    target_ar's), then each item's chains."""
    draft = load_eagle(pair, t)
    roll = rollout(pair, items, t, step_draft=False)
    results = []
    for i, it in enumerate(items):
        cont = roll.tokens[i]
        cols = eagle_rows(pair, draft, it, cont, roll.target_logits[i, : len(cont)], t)
        cols["prompt_id"], cols["split"], cols["kind"], cols["n"] = it.prompt_id, it.split, it.kind, len(cols["step"])
        cols["continuation"] = cont
        cols["context_token"] = np.asarray(cont, dtype=np.int32)[cols["position"]]
        cols["prompt_tokens"] = list(it.prefix)
        results.append(cols)
    return results


def eagle_tree_batch(pair, items: list[Item], t) -> list[dict]:
    """`eagle_tree` rows: trace=tree's walk (data_gen.traces.tree_batch) with EAGLE-3 as the draft — decode's tree
    adapter (models.eagle3_pair.TreeDraft) holding the item's fused target features, so the committed tokens are fed with their true
    features and each node with its parent's output, as Eagle3Tree grows trees."""
    from data_gen.traces import tree_batch
    from models.eagle3_pair import TreeDraft

    draft = load_eagle(pair, t)
    adapter = TreeDraft(draft, int(pair.vocab_size))

    def walker(it: Item, y: list[int]):
        seq = it.prefix + y
        adapter.feats = draft.fuse(_features(pair, seq, draft.cfg.layers).to(draft.ids.device))
        return adapter, 1

    return tree_batch(pair, items, t, walker)
