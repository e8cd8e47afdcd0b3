"""Tree builders: which draft tokens the target verifies, chosen like stop policies (`policies=[tree_static,eagle2]`).

A builder is a `decode.policies.StopPolicy` with `tree = True` (so decode, the replay and the tables treat it as
one more method) and three decisions the loop asks for, level by level (models.tree.grow):
- `children(tree, parent, level)`: the (token, prob, rank) children to add under a node whose draft distribution is
  known (the root's, or a node the draft has run on);
- `expand(tree, new, level)`: which of the new nodes the draft runs on next (one tree-attention call per level);
- `select(tree)`: the nodes the target verifies, closed under ancestors.
For eval.tree_replay (greedy replay on data_gen's `tree` traces) a builder also answers `pick(candidate)`: the nodes
of a recorded candidate tree it would verify, and `replay_cost(candidate, picked)`: (draft levels, verified nodes).
Children are the top ranks of the draft's distribution (deterministic), which is what makes decode.tree's sampling
rule exact. Every builder is sized on the measured cost profile t(n) (models.cost): a tree is only worth its
verification pass where the profile says so, and on a CPU whose t(n) climbs with n the best tree may be a chain.
"""

from __future__ import annotations

import torch

from decode.policies import StopPolicy
from utils.cli import UserError


# the default pair's acceptance by rank on MBPP test (results/trees/ceiling.json); conf/policy/*.yaml carry it too
RANK_PROBS = (0.584, 0.121, 0.040, 0.026, 0.017, 0.010, 0.012, 0.008)


def _top(q: torch.Tensor, k: int) -> list[tuple[int, float, int]]:
    v, i = q.topk(k)
    return [(int(t), float(p), r + 1) for r, (p, t) in enumerate(zip(v.tolist(), i.tolist()))]


class TreeBuilder(StopPolicy):
    """Base: the capability flags and the profile-based cost of a round (draft levels + one verification)."""

    name = "tree"
    tree = True
    needs_probs = True
    needs_profile = True

    def __init__(self, max_depth: int = 6, profile=None):
        super().__init__(max_len=max_depth)
        if profile is None:
            raise UserError(f"the {self.name} tree builder is sized on the measured cost profile (models.cost); "
                            "decode passes it — build the builder with profile=...")
        self.max_depth = int(max_depth)
        self.profile = profile

    def round_cost(self, depth: int, nodes: int) -> float:
        """A round's time in target steps: `depth` draft calls (one per level, each about a one-token call on a
        CPU) and a verification pass over the pending token + `nodes`."""
        c = float(self.profile.cost_ratio)
        return depth * c + float(self.profile.verify_ratio(nodes + 1))

    def children(self, tree, parent: int, level: int) -> list[tuple[int, float, int]]:
        raise NotImplementedError

    def expand(self, tree, new: list[int], level: int) -> list[int]:
        return new

    def select(self, tree) -> list[int]:
        return list(range(len(tree)))

    def describe(self) -> dict:
        return {"name": self.name, "max_depth": self.max_depth}

    def pick(self, candidate) -> list[int]:
        """The nodes of a recorded candidate tree (models.tree.Tree from a `tree` trace, no distributions) this
        builder would verify, closed under ancestors. Static shapes: `static_shape()` matched by (parent, rank)."""
        return match_shape(*self.static_shape(), candidate)

    def replay_cost(self, candidate, picked: list[int]) -> tuple[int, int]:
        """(draft levels, verified nodes) of the round: a static shape drafts and verifies all of itself, whether or
        not the candidate tree recorded every node of it."""
        parents, _ = self.static_shape()
        return self.max_depth, len(parents)

    def static_shape(self) -> tuple[list[int], list[int]]:
        """A static builder's tree as (parents, ranks), every parent before its children (−1: the root)."""
        raise NotImplementedError(f"{self.name} has no static shape")


def match_shape(parents: list[int], ranks: list[int], candidate) -> list[int]:
    """The candidate's nodes that play a static shape's nodes, matched by (parent, rank) from the root. A shape node
    the candidate lacks (the trace's expansion did not reach its parent, or its rank is past the trace's top-k) has
    no match, nor has anything below it: the replay counts it as verified and rejected (it is paid for, never
    accepted), so a static tree's replayed τ is a lower bound where the trace's tree is narrower than the shape."""
    at = {(p, r): i for i, (p, r) in enumerate(zip(candidate.parents, candidate.rank))}
    matched, out = {-1: -1}, []
    for j, (par, rank) in enumerate(zip(parents, ranks)):
        node = at.get((matched[par], rank)) if par in matched else None
        if node is not None:
            matched[j] = node
            out.append(node)
    return out


class TreeStatic(TreeBuilder):
    """A fixed shape, as EAGLE-1 and Medusa ship: `branching[l]` children (the draft's top ranks) under every node of
    level l. Sized on the profile once: the number of levels is the one whose expected tokens per unit time is
    highest when a rank-r child is accepted with probability `rank_probs[r-1]` given its parent was (measure them
    with `python -m eval.tree_ceiling`, which prints this override)."""

    name = "tree_static"

    def __init__(self, branching=(2, 2, 1, 1, 1), rank_probs=RANK_PROBS, max_depth: int | None = None,
                 profile=None):
        branching = [int(b) for b in branching]
        if not branching or min(branching) < 1:
            raise UserError(f"policy.tree_static.branching must list ≥ 1 children per level, got {branching}")
        super().__init__(len(branching), profile)
        self.rank_probs = [float(p) for p in rank_probs]
        self.branching = branching[: self._best_depth(branching) if max_depth is None else int(max_depth)]
        self.max_depth = len(self.branching)
        self.max_len = self.max_depth

    def _value(self, branching: list[int]) -> tuple[float, int]:
        """(expected accepted drafted tokens, nodes) of the shape: a rank-r child survives with p_r."""
        level_mass, level_nodes, exp, nodes = [1.0], [1], 0.0, 0
        for b in branching:
            mass = level_mass[-1] * sum(self.rank_probs[r] if r < len(self.rank_probs) else 0.0 for r in range(b))
            level_nodes.append(level_nodes[-1] * b)
            level_mass.append(mass)
            exp += mass
            nodes += level_nodes[-1]
        return exp, nodes

    def _best_depth(self, branching: list[int]) -> int:
        def speed(d):
            exp, nodes = self._value(branching[:d])
            return (1 + exp) / self.round_cost(d, nodes)

        return max(range(1, len(branching) + 1), key=speed)

    def children(self, tree, parent, level):
        return _top(tree.dist(parent), self.branching[level - 1])

    def expand(self, tree, new, level):
        return new if level < self.max_depth else []

    def describe(self):
        return {**super().describe(), "branching": self.branching, "rank_probs": self.rank_probs}

    def static_shape(self):
        parents, ranks, frontier = [], [], [-1]
        for b in self.branching:
            new = []
            for par in frontier:
                for r in range(1, b + 1):
                    parents.append(par)
                    ranks.append(r)
                    new.append(len(parents) - 1)
            frontier = new
        return parents, ranks


class Sequoia(TreeBuilder):
    """Sequoia (Chen et al. 2024, arXiv 2402.12374): the best static tree by dynamic programming
    (models.tree_dp) from the acceptance-by-rank vector `rank_probs` (`python -m eval.tree_ceiling` measures it and
    prints this override), sized on the measured profile: among trees of up to `max_nodes` nodes and `max_depth`
    levels, the one with the most expected tokens per unit time. Where the profile's verification pass climbs
    steeply (a CPU) that tree is a chain, so the builder can never lose to the chain it contains by much."""

    name = "sequoia"

    def __init__(self, rank_probs=RANK_PROBS, max_nodes: int = 32, max_depth: int = 12, profile=None):
        from models.tree_dp import TreeTable

        super().__init__(max_depth, profile)
        self.rank_probs = [float(p) for p in rank_probs]
        table = TreeTable(self.rank_probs, int(max_nodes), self.max_depth)
        best, shape = 0.0, None
        for n in range(1, int(max_nodes) + 1):
            for depth in range(1, self.max_depth + 1):
                if table.value(n, depth) == float("-inf"):
                    continue
                t = table.tree(n, depth)
                speed = (1 + t.expected_accepted) / self.round_cost(t.depth, n)
                if speed > best + 1e-12:
                    best, shape = speed, t
        self.shape = shape
        self.max_depth = self.max_len = shape.depth
        self.kids: dict[int, list[tuple[int, int]]] = {}
        for j, (par, rank) in enumerate(zip(shape.parents, shape.ranks)):
            self.kids.setdefault(par, []).append((j, rank))
        self._node_shape: dict[int, int] = {}

    def children(self, tree, parent, level):
        if parent < 0:
            self._node_shape = {}  # a new round: tree node -> shape node
        here = -1 if parent < 0 else self._node_shape.get(parent)
        spec = self.kids.get(here, [])
        if not spec:
            return []
        top = _top(tree.dist(parent), max(r for _, r in spec))
        out = []
        for j, rank in spec:
            self._node_shape[len(tree) + len(out)] = j  # the index tree.add will give it (children are added in order)
            out.append(top[rank - 1])
        return out

    def expand(self, tree, new, level):
        return [i for i in new if self.kids.get(self._node_shape.get(i))]

    def describe(self):
        return {**super().describe(), "rank_probs": self.rank_probs, "nodes": len(self.shape.parents),
                "parents": list(self.shape.parents), "ranks": list(self.shape.ranks)}

    def static_shape(self):
        return list(self.shape.parents), list(self.shape.ranks)


class Eagle2(TreeBuilder):
    """EAGLE-2 (Li et al. 2024, arXiv 2406.16858): a dynamic tree from the draft's confidence. Each level adds the
    top-`topk` children of the level's expanded nodes and expands the `topk` new nodes of highest joint probability
    (product of draft probabilities along the path: EAGLE-2's estimate of the chance a node is accepted); then the
    nodes are reranked by joint probability. Where EAGLE-2 keeps a fixed top N, here N is chosen every round on the
    profile: the N that maximises (1 + Σ of the N best joints) / round cost — the tree grows while the next node's
    expected gain pays for its share of the verification pass."""

    name = "eagle2"

    def __init__(self, topk: int = 4, max_depth: int = 6, max_nodes: int = 32, profile=None):
        super().__init__(max_depth, profile)
        if int(topk) < 1 or int(max_nodes) < 1:
            raise UserError(f"policy.eagle2.topk and max_nodes must be ≥ 1, got {topk}, {max_nodes}")
        self.topk, self.max_nodes = int(topk), int(max_nodes)

    def children(self, tree, parent, level):
        return _top(tree.dist(parent), self.topk)

    def expand(self, tree, new, level):
        return sorted(new, key=lambda i: -tree.joint[i])[: self.topk]

    def select(self, tree):
        order = sorted(range(len(tree)), key=lambda i: (-tree.joint[i], tree.depth[i], i))[: self.max_nodes]
        best, best_n, gain, depth = 1.0 / self.round_cost(1, 0), 0, 0.0, 1
        for n, node in enumerate(order, 1):  # joint ≤ parent's joint, so every prefix of `order` is ancestor-closed
            gain += tree.joint[node]
            depth = max(depth, tree.depth[node])
            value = (1 + gain) / self.round_cost(depth, n)
            if value > best:
                best, best_n = value, n
        return order[:best_n]

    def describe(self):
        return {**super().describe(), "topk": self.topk, "max_nodes": self.max_nodes}

    def pick(self, candidate):
        """`select` on the candidate's first `max_depth` levels: with the trace's top-k equal to `topk` (the replay
        checks it) those levels are exactly the tree this builder grows, so the pick is decode's."""
        keep = sum(1 for d in candidate.depth if d <= self.max_depth)  # nodes are added level by level
        if keep < len(candidate):
            from models.tree import Tree

            candidate = Tree(root_q=candidate.root_q, tokens=candidate.tokens[:keep],
                             parents=candidate.parents[:keep], depth=candidate.depth[:keep],
                             joint=candidate.joint[:keep], rank=candidate.rank[:keep])
        return self.select(candidate)

    def replay_cost(self, candidate, picked):
        """It grows every level it can (one draft call each) whatever it then selects."""
        return min(self.max_depth, max(candidate.depth, default=1)), len(picked)
