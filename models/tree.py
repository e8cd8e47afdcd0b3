"""A round's candidate token tree and its growth by the draft: one implementation for decode's tree builders and
data_gen's tree traces (which sit below decode).

The draft's distribution at the root (after its pending tokens) is known first; an *expander* (decode's tree
builders; data_gen's trace expansion) adds children under nodes whose distribution is known and names the new nodes
the draft runs on next, one tree-attention call per level (`models.lm.tree_attention`: each node sees the prefix and
its ancestors, at position prefix + depth). An expander answers `max_depth`, `children(tree, parent, level) ->
[(token, prob, rank)]` and `expand(tree, new_nodes, level) -> nodes to run`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from models.distributions import draft_probs, on_support, support_entropy, support_topk
from models.features.layout import DEFAULT_TOPK
from models.lm import tree_attention


@dataclass
class Tree:
    """The round's candidate tree. Node i: `tokens[i]`, `parents[i]` (−1: a child of the root, the last committed
    token), `depth[i]` (1 for the root's children), `joint[i]` (product of the draft's probabilities along its
    path), `rank[i]` (1-based rank of its token in its parent's distribution). `q[i]`: the draft's distribution
    after the node, once the draft has run on it (then `dpos[i]` is its position in the draft cache). `score[i]`: a
    trained node head's P(node on the accepted path), for the nodes scored so far (decode.learned_trees' builders;
    the replay fills it from the trace). `context`: a models.features.context.ContextIndex of the root's context
    (prompt + committed continuation) and `verify`: (H_p, top-2 margin of p) of the target distribution the last
    committed token came from ((0, 0) before the first verification) — given where a node head reads them
    (models.features.nodes.node_columns' groups copy / verify: tree traces always, decode for heads that ask). The
    index is the caller's and moves on after the round (decode and traces push the committed tokens onto it): read
    it while the tree is the round's. `support`: the draft's reduced vocabulary (models.lm.LM.support; None for a
    full head), outside which every q is 0, so node features read q there (models.features.nodes.node_columns).
    `policy_s`: seconds `grow` spent in the expander (a builder's own work — a node head's features and scores —
    which decode books as policy time, not draft time). `stats(node, k)` / `q_token(node)` cache what the builders'
    children and the node features read of a distribution, so each is computed once per node and round."""

    root_q: torch.Tensor
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    joint: list[float] = field(default_factory=list)
    rank: list[int] = field(default_factory=list)
    q: dict = field(default_factory=dict)
    dpos: dict = field(default_factory=dict)
    tpos: dict = field(default_factory=dict)  # verified nodes' positions in the target cache
    score: list = field(default_factory=list)
    levels: list = field(default_factory=list)  # nodes of each draft call after the root's (what a round costs)
    context: object = None
    verify: tuple | None = None
    support: torch.Tensor | None = None
    policy_s: float = 0.0
    _stats: dict = field(default_factory=dict, repr=False)
    _q_token: dict = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, prob: float, rank: int) -> int:
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
        self.joint.append((1.0 if parent < 0 else self.joint[parent]) * float(prob))
        self.rank.append(int(rank))
        return len(self.tokens) - 1

    def dist(self, node: int) -> torch.Tensor:
        return self.root_q if node < 0 else self.q[node]

    def stats(self, node: int, k: int = DEFAULT_TOPK, support=None) -> tuple[torch.Tensor, ...]:
        """(the k largest probabilities of the draft's distribution after `node`, best first; their tokens; its
        entropy), read on the draft's support (`support` or the tree's; zeros off it add nothing: the values of
        models.features.signals.DraftStep's top-k and entropy: models.distributions.support_topk / support_entropy,
        a sixth of the work on an 8k-of-49k FR-Spec draft). Cached per node for the tree's own support and at least
        DEFAULT_TOPK wide: a level's children (the builders' top-k) and its node features (the learned builders'
        rows) read one top-k and one entropy per parent, not three."""
        own, width = support is None or support is self.support, max(k, DEFAULT_TOPK)
        have = self._stats.get(node) if own else None
        if have is None or len(have[0]) < k:
            q, support = self.dist(node), self.support if own else support
            mass = on_support(q, support)  # gathered once for both
            have = (*support_topk(q, width, support, mass, ids=True), support_entropy(q, mass=mass))
            if own:
                self._stats[node] = have
        return have[0][:k], have[1][:k], have[2]

    def top(self, node: int, k: int) -> list[tuple[int, float, int]]:
        """The k most likely children of `node` as (token, prob, rank), best first: what a builder adds under it."""
        v, i, _ = self.stats(node, k)
        return [(int(t), float(p), r + 1) for r, (p, t) in enumerate(zip(v.tolist(), i.tolist()))]

    def q_token(self, node: int) -> float:
        """The draft's probability of the node's token after its parent (cached: a level's rows read it as their
        q_token, the next level's as their parent_q)."""
        if node not in self._q_token:
            self._q_token[node] = float(self.dist(self.parents[node])[self.tokens[node]])
        return self._q_token[node]

    def children(self, nodes: list[int]) -> dict[int, list[int]]:
        """Parent → its children among `nodes`, in rank order (the order verification tries them)."""
        out: dict[int, list[int]] = {}
        for i in sorted(nodes, key=lambda i: (self.rank[i], i)):
            out.setdefault(self.parents[i], []).append(i)
        return out


def run_nodes(draft, dcache, tree: Tree, nodes: list[int], prefix_len: int, temperature: float = 0.0,
              top_p: float = 1.0) -> None:
    """One draft call on `nodes`: their distributions (as the chain loop computes q) and cache positions."""
    start = dcache.get_seq_length()
    pos, mask = tree_attention(tree.parents, nodes, prefix_len, start, tree.dpos, draft.device)
    logits, _ = draft([tree.tokens[i] for i in nodes], dcache, last=len(nodes), positions=pos, mask=mask)
    for j, node in enumerate(nodes):
        tree.q[node] = draft_probs(logits[j], temperature, top_p)
        tree.dpos[node] = start + j


def grow_levels(tree: Tree, depth: int, add, expand, run=None) -> None:
    """The round's growth, level by level up to `depth`: `add(tree, parent, level)` adds a parent's children (returns
    the new nodes), `expand(tree, new, level)` names the nodes the draft runs on next, `run(frontier)` runs it (and
    `tree.levels` records each call). The one loop decode (`grow`) and the replay of a grown builder
    (decode.tree_builders.GrownTree.pick, adding a recorded tree's nodes, `run` None) share. The time in `add` and
    `expand` is the expander's own (`Tree.policy_s`)."""
    frontier, clock = [-1], time.perf_counter
    for level in range(1, depth + 1):
        ts = clock()
        new = [node for parent in frontier for node in add(tree, parent, level)]
        frontier = expand(tree, new, level) if new and level < depth else []
        tree.policy_s += clock() - ts
        if not frontier:
            break
        if run is not None:
            run(frontier)
        tree.levels.append(len(frontier))


def grow(draft, dcache, d_pending: list[int], expander, temperature: float = 0.0, top_p: float = 1.0,
         max_depth: int | None = None, context=None, verify: tuple | None = None) -> tuple[Tree, int, int]:
    """The draft runs on its pending tokens (the root's distribution), then the expander's levels, at most
    `max_depth` of them (decode: the tokens left to generate, as a chain stops drafting there). Returns the tree,
    the prefix length (committed tokens, all now in the draft cache) and the number of draft calls. `context` /
    `verify` are attached to the tree (`Tree`) before the expander sees it."""
    logits, _ = draft(d_pending, dcache, last=1)
    prefix_len = dcache.get_seq_length()
    tree = Tree(root_q=draft_probs(logits[0], temperature, top_p), context=context, verify=verify,
                support=getattr(draft, "support", None))
    depth = expander.max_depth if max_depth is None else min(expander.max_depth, int(max_depth))

    def add(tree, parent, level):
        return [tree.add(parent, tok, prob, rank) for tok, prob, rank in expander.children(tree, parent, level)]

    grow_levels(tree, depth, add, expander.expand,
                lambda frontier: run_nodes(draft, dcache, tree, frontier, prefix_len, temperature, top_p))
    calls = 1 + len(tree.levels)
    return tree, prefix_len, calls


class TopkExpander:
    """EAGLE-2's expansion without its selection (data_gen's tree traces): every expanded node gets its draft
    distribution's top-`topk` children, and per level the `topk` new nodes of highest joint probability are
    expanded, to depth `max_depth`. decode.tree_builders.Eagle2 grows exactly this tree (same children, same order),
    so a trace of it holds every node Eagle2 could select, and any shallower Eagle2 tree is its first levels."""

    def __init__(self, topk: int = 4, max_depth: int = 5):
        self.topk, self.max_depth = int(topk), int(max_depth)

    def children(self, tree: Tree, parent: int, level: int) -> list[tuple[int, float, int]]:
        return tree.top(parent, self.topk)

    def expand(self, tree: Tree, new: list[int], level: int) -> list[int]:
        return sorted(new, key=lambda i: -tree.joint[i])[: self.topk]
