"""Token trees in the one speculative loop: the draft proposes branches, the target verifies them in one pass.

A round (the `tree` drafter, decode.lm_drafters.StudentTree, which runs a policy with `tree = True`; verified by
decode.drafter.TreeProposal):
1. the draft runs on its pending tokens; its distribution there is the root's;
2. (models.tree.grow) the builder (decode.tree_builders, chosen like a stop policy) adds children under nodes
   whose distribution is known, and names the new nodes the draft should run on next (one tree-attention call per
   level: each node sees the prefix and its ancestors, at position prefix + depth), until it adds none or reaches
   its depth;
3. the builder selects the nodes to verify (closed under ancestors);
4. the target runs the pending token(s) and the selected nodes in one tree-attention call;
5. the walk accepts a root path (below), and both KV caches keep exactly the prefix and the accepted path
   (`models.lm.LM.keep`; the target's in TreeProposal.verify, the draft's in `commit_draft`); the draft re-runs the
   accepted nodes it had not run on, next round.

Acceptance. Greedy: from the root, follow the child whose token is the target's argmax; the first node without such
a child gives the target's token. Sampling: SpecInfer's multi-step speculative sampling (Miao et al. 2024, Alg. 2;
arXiv 2305.09781): at a node with target distribution p, try its children in order; child x proposed from q_x is
accepted with probability min(1, r(x) / q_x(x)), where r starts as p; on rejection r ← norm(max(0, r − q_x)); when
every child is rejected the token is drawn from r. Our builders propose deterministic children (the top ranks of
the draft's distribution), so q_x is the point mass on x: a child is accepted with probability r(x), and a rejection
removes x from r. Each step is one exact rejection-sampling step, so the emitted token is distributed as p (the
tests check it by χ² against target-only sampling).
"""

from __future__ import annotations

import time

import torch

from decode.verify import residual
from models.distributions import draft_probs, greedy_ids, verification_stats
from models.lm import target_pass, tree_attention
from models.tree import Tree
from models.tree import grow as grow_tree


def grow(draft, dcache, d_pending: list[int], builder, s, budget: int, res, context=None,
         verify: tuple | None = None) -> tuple[Tree, int, list[int]]:
    """Steps 1-3 (models.tree.grow to no deeper than the `budget` of tokens left, then the builder's selection);
    draft and selection time go to `res`. Returns the tree, the prefix length and the selected nodes. `context` /
    `verify`: the root's context index and last verification numbers, for builders whose node head reads them."""
    ts = time.perf_counter()
    tree, prefix_len, calls = grow_tree(draft, dcache, d_pending, builder, 0.0 if s.greedy else s.temperature, s.top_p,
                                        max_depth=budget, context=context, verify=verify)
    res.draft_calls += calls
    tp = time.perf_counter()
    res.draft_s += tp - ts - tree.policy_s  # the builder's work inside the growth is policy time
    selected = sorted(builder.select(tree))
    res.policy_s += time.perf_counter() - tp + tree.policy_s
    return tree, prefix_len, selected


def greedy_walk(tree: Tree, nodes: list[int], argmax: dict[int, int]) -> tuple[list[int], int]:
    """The longest root path whose every token is the target's argmax after its parent; (path, target's next)."""
    kids = tree.children(nodes)
    path, cur = [], -1
    while True:
        want = argmax[cur]
        nxt = next((c for c in kids.get(cur, []) if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        cur = nxt


def sample_walk(tree: Tree, nodes: list[int], p: dict[int, torch.Tensor], generator) -> tuple[list[int], int]:
    """SpecInfer's multi-step speculative sampling over point-mass children (module docstring): lossless."""
    kids = tree.children(nodes)
    path, cur = [], -1
    while True:
        r = p[cur]
        accepted = None
        for c in kids.get(cur, []):
            x = tree.tokens[c]
            if float(torch.rand((), generator=generator)) < float(r[x]):
                accepted = c
                break
            point = torch.zeros_like(r)
            point[x] = 1.0
            r = residual(r, point)
        if accepted is None:
            return path, int(torch.multinomial(r, 1, generator=generator))
        path.append(accepted)
        cur = accepted


def verify(target, tcache, t_pending: list[int], tree: Tree, nodes: list[int], s, res, layers=()):
    """Step 4 and the walk: (the accepted path as tree node ids, the token after it, the target's logits (V,) it
    came from — what the next round's node heads read as the last verification, `root_stats` —, each path node's
    row among `nodes`, the pass's logits, and the hidden states at `layers` or None). The target cache keeps the
    pending tokens and every node's entry at `tree.tpos`; decode.drafter.TreeProposal cuts it to the path."""
    start = tcache.get_seq_length()
    prefix_len, n = start + len(t_pending), len(nodes)
    positions, mask = tree_attention(tree.parents, nodes, prefix_len, start, None, target.device)
    logits, taps = target_pass(target, t_pending + [tree.tokens[i] for i in nodes], tcache, n + 1, layers,
                                positions=positions, mask=mask)
    res.target_calls += 1
    at = {-1: 0, **{node: j + 1 for j, node in enumerate(nodes)}}  # row of each node's next-token logits
    if s.greedy:
        ids = greedy_ids(logits).tolist()
        path, nxt = greedy_walk(tree, nodes, {node: ids[r] for node, r in at.items()})
    else:
        path, nxt = sample_walk(tree, nodes, {node: draft_probs(logits[r], s.temperature, s.top_p)
                                              for node, r in at.items()}, s.generator)
    tree.tpos.update({node: prefix_len + j for j, node in enumerate(nodes)})
    return path, nxt, logits[at[path[-1]] if path else 0], [at[i] - 1 for i in path], logits, taps


def root_stats(z: torch.Tensor, s) -> tuple[float, float]:
    """(H_p, top-1 − top-2 of p) of the target distribution at logits z (V,), as the chain's VerifyStats computes
    them (decode.loop._verify_stats: softmax of the logits under greedy verification, p at the sampling temperature
    and top-p otherwise): the `verify` node group (models.tree.Tree.verify) of the next round's tree."""
    p = None if s.greedy else draft_probs(z, s.temperature, s.top_p).unsqueeze(0)
    ent, margin, _ = verification_stats(z.unsqueeze(0), p, [], 0)
    return float(ent), float(margin)


def commit_draft(draft, dcache, tree: Tree, prefix_len: int, path: list[int], nxt: int) -> list[int]:
    """The draft cache keeps the prefix and the accepted path's nodes it ran on; returns the draft's pending tokens
    (the path's nodes it has not run on, then the target's token)."""
    ran = 0  # the draft ran on a prefix of the path (it runs a node only after the node's parent)
    while ran < len(path) and path[ran] in tree.dpos:
        ran += 1
    draft.keep(dcache, list(range(prefix_len)) + [tree.dpos[i] for i in path[:ran]])
    return [tree.tokens[i] for i in path[ran:]] + [nxt]
