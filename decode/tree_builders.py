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

import numpy as np

from decode.policies import StopPolicy
from utils.cli import UserError


class TreeBuilder(StopPolicy):
    """Base: the capability flags, the profile-based cost of a round (draft levels + one verification), and the
    expected-value test for drafting one more level that the cost-aware builders share."""

    name = "tree"
    tree = True
    needs_probs = True
    needs_profile = True
    # priced as the chain loop's rounds (one-token draft calls, a causal pass): eval.tree_replay's width-1 stand-ins
    # for decode's chain policies; decode runs every builder as a tree round
    chain_loop = False

    def __init__(self, max_depth: int = 6, profile=None):
        super().__init__(max_len=max_depth)
        if profile is None:
            raise UserError(f"the {self.name} tree builder is sized on the measured cost profile (models.cost); "
                            "decode passes it — build the builder with profile=...")
        self.max_depth = int(max_depth)
        self.profile = profile

    def round_cost(self, levels: list[int], nodes: int) -> float:
        """A round's time in target steps (`CostProfile.round_steps`): the root's draft call, one draft call per
        level the draft runs on (`levels`: the nodes of each, priced by the profile's tree-level curve) and a
        verification pass over the pending token + `nodes` (its tree-attention curve)."""
        return self.profile.round_steps(1 + len(levels), nodes, None if self.chain_loop else list(levels))

    def best_prefix(self, expected: float, levels: list[int], nodes: int, offers: list[tuple[float, int]]) -> int:
        """How many of `offers` (gain, nodes) — the nodes of the newest level the draft could run on, best first,
        each with what its children add — to draft: the prefix that most raises the round's expected tokens per
        unit time, 0 when none does. `expected` tokens (1 + the nodes' estimated acceptances) for the draft calls
        `levels` (`round_cost`) and `nodes` verified nodes so far; taking m offers costs one more draft call on m
        nodes and their children's share of the verification pass. With one rank-1 offer this is the chain's
        expected-value stop rule (decode.expected_value.ExpectedValueRule: gain = survival × the last token's
        probability) priced as a tree round, so a builder that uses it contains the expected-value chain."""
        best, best_m, gain, added = expected / self.round_cost(levels, nodes), 0, 0.0, 0
        for m, (g, n) in enumerate(offers, 1):
            gain, added = gain + g, added + n
            value = (expected + gain) / self.round_cost([*levels, m], nodes + added)
            if value > best * (1 + 1e-12):
                best, best_m = value, m
        return best_m

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

    def replay_cost(self, candidate, picked: list[int]) -> tuple[list[int], int]:
        """(the draft calls after the root's as `round_cost` takes them, verified nodes) of the round: a static
        shape drafts and verifies all of itself, whether or not the candidate tree recorded every node of it."""
        from models.tree_dp import run_levels

        parents, _ = self.static_shape()
        return run_levels(parents), len(parents)

    def static_shape(self) -> tuple[list[int], list[int]]:
        """A static builder's tree as (parents, ranks), every parent before its children (−1: the root)."""
        raise NotImplementedError(f"{self.name} has no static shape")


def own_prob(tree, node: int) -> float:
    """The draft's probability of the node's token after its parent (joint ÷ the parent's joint)."""
    par = tree.parents[node]
    if par < 0:
        return tree.joint[node]
    return tree.joint[node] / tree.joint[par] if tree.joint[par] > 0 else 0.0


class GrownTree(TreeBuilder):
    """A builder whose growth decisions (`expand`) and selection read only the tree's joints, depths and ranks, so
    the replay (eval.tree_replay) reproduces decode's rounds on a recorded candidate tree: `pick` regrows the round
    level by level as models.tree.grow does, adding the candidate's nodes that `replay_children` names (what
    `children` would add) with the candidate's joints, then selects."""

    def replay_children(self, tree, parent: int, candidate, cparent: int, level: int) -> list[int]:
        """The candidate's nodes (ids) this builder would add under `cparent` (tree node `parent`), in the order
        `children` adds them; one it would add that the candidate lacks is counted in `_replay_missing`."""
        raise NotImplementedError

    def pick(self, candidate) -> list[int]:
        from models.tree import Tree, grow_levels

        self._replay_missing = 0
        tree, back = Tree(root_q=None), []

        def add(tree, par, level):  # the candidate's nodes `children` would add, with the recorded joints
            new = []
            for c in self.replay_children(tree, par, candidate, -1 if par < 0 else back[par], level):
                new.append(tree.add(par, candidate.tokens[c], own_prob(candidate, c), candidate.rank[c]))
                tree.joint[-1] = candidate.joint[c]  # the recorded joint itself, not a re-multiplied one
                back.append(c)
            return new

        grow_levels(tree, self.max_depth, add, self.expand)  # decode's level loop, without the draft calls
        self._replay_levels = list(tree.levels)
        return sorted(back[i] for i in self.select(tree))

    def replay_cost(self, candidate, picked):
        """Draft calls: every level grown (whatever the selection then keeps); nodes: the picked ones plus those the
        builder would have added that the trace lacks (paid for, never accepted)."""
        return self._replay_levels, len(picked) + self._replay_missing


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

    def __init__(self, branching=(2, 2, 1, 1, 1), rank_probs=(), max_depth: int | None = None, profile=None):
        branching = [int(b) for b in branching]
        if not branching or min(branching) < 1:
            raise UserError(f"policy.tree_static.branching must list ≥ 1 children per level, got {branching}")
        if max_depth is None and not rank_probs:  # the default pair's are in conf/policy/tree_static.yaml
            raise UserError("policy.tree_static needs rank_probs (python -m eval.tree_ceiling measures them) "
                            "or max_depth")
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
            sizes = [int(np.prod(branching[:lvl])) for lvl in range(1, d)]  # levels 1 .. d − 1 are run
            return (1 + exp) / self.round_cost(sizes, nodes)

        return max(range(1, len(branching) + 1), key=speed)

    def children(self, tree, parent, level):
        return tree.top(parent, self.branching[level - 1])

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


class Sequoia(GrownTree):
    """Sequoia (Chen et al. 2024, arXiv 2402.12374): the best static tree by dynamic programming
    (models.tree_dp) from the acceptance-by-rank vector `rank_probs` (`python -m eval.tree_ceiling` measures it and
    prints this override), sized on the measured profile: among trees of up to `max_nodes` nodes and `max_depth`
    levels, the one with the most expected tokens per unit time.

    Two departures, so that it never loses to the chain it contains (issue 30's bar): the shape's rank-1 spine goes
    on past the shape, to `spine_depth` levels; and each level is drafted only while the expected-value rule says it
    pays (`best_prefix`: a node's acceptance is its joint draft probability, a rank-r child of node i is worth
    joint_i · q_i · rank_probs[r]/rank_probs[1]). Where the shape is a chain this is exactly `expected_value` (a=1,
    b=0) capped at `spine_depth`; a static tree is what it grows when the draft stays confident."""

    name = "sequoia"
    SPINE = -2  # the shape-node id of the spine's continuation past the shape

    def __init__(self, rank_probs, max_nodes: int = 32, max_depth: int = 12, spine_depth: int = 16,
                 profile=None):
        from models.tree_dp import TreeTable, run_levels

        super().__init__(max_depth, profile)
        self.rank_probs = [float(p) for p in rank_probs]
        table = TreeTable(self.rank_probs, int(max_nodes), self.max_depth)
        best, shape = 0.0, None
        for n in range(1, int(max_nodes) + 1):
            for depth in range(1, self.max_depth + 1):
                if table.value(n, depth) == float("-inf"):
                    continue
                t = table.tree(n, depth)
                speed = (1 + t.expected_accepted) / self.round_cost(run_levels(t.parents), n)
                if speed > best + 1e-12:
                    best, shape = speed, t
        self.shape = shape
        self.spine_depth = max(int(spine_depth), shape.depth)
        self.max_depth = self.max_len = self.spine_depth
        self.kids: dict[int, list[tuple[int, int]]] = {}
        for j, (par, rank) in enumerate(zip(shape.parents, shape.ranks)):
            self.kids.setdefault(par, []).append((j, rank))
        end = -1  # the spine's last shape node: follow rank-1 children from the root
        while any(r == 1 for _, r in self.kids.get(end, [])):
            end = next(j for j, r in self.kids[end] if r == 1)
        self.kids.setdefault(end, []).append((self.SPINE, 1))
        self.kids[self.SPINE] = [(self.SPINE, 1)]
        self._node_shape: dict[int, int] = {}

    def _spec(self, node: int) -> list[tuple[int, int]]:
        return self.kids.get(-1 if node < 0 else self._node_shape.get(node), [])

    def children(self, tree, parent, level):
        if parent < 0:
            self._node_shape = {}  # a new round: tree node -> shape node
        spec = self._spec(parent)
        if not spec:
            return []
        top = tree.top(parent, max(r for _, r in spec))
        out = []
        for j, rank in spec:
            self._node_shape[len(tree) + len(out)] = j  # the index tree.add will give it (children are added in order)
            out.append(top[rank - 1])
        return out

    def expand(self, tree, new, level):
        """The level's nodes with children in the shape, best offers first, while drafting them pays."""
        offers = []
        for i in new:
            spec = self._spec(i)
            if spec:
                a = tree.joint[i] * own_prob(tree, i)  # the chain's estimate of the rank-1 child's acceptance
                ratio = sum(self.rank_probs[r - 1] for _, r in spec if r <= len(self.rank_probs)) / self.rank_probs[0]
                offers.append((a * ratio, len(spec), i))
        offers.sort(key=lambda o: -o[0] / o[1])
        m = self.best_prefix(1.0 + sum(tree.joint), tree.levels, len(tree), [(g, n) for g, n, _ in offers])
        return sorted(i for _, _, i in offers[:m])

    def replay_children(self, tree, parent, candidate, cparent, level):
        if parent < 0:
            self._node_shape = {}
        at = {r: i for i, (p, r) in enumerate(zip(candidate.parents, candidate.rank)) if p == cparent}
        out = []
        for j, rank in self._spec(parent):
            if rank in at:
                self._node_shape[len(tree) + len(out)] = j
                out.append(at[rank])
            else:
                self._replay_missing += 1
        return out

    def describe(self):
        return {**super().describe(), "rank_probs": self.rank_probs, "nodes": len(self.shape.parents),
                "spine_depth": self.spine_depth, "parents": list(self.shape.parents), "ranks": list(self.shape.ranks)}


class Eagle2(GrownTree):
    """EAGLE-2 (Li et al. 2024, arXiv 2406.16858): a dynamic tree from the draft's confidence. Each level adds the
    top-`topk` children of the level's expanded nodes and expands the `topk` new nodes of highest joint probability
    (product of draft probabilities along the path: EAGLE-2's estimate of the chance a node is accepted); then the
    nodes are reranked by joint probability and the best N verified.

    Sized on the measured profile where EAGLE-2 fixes its depth and N (tuned for a GPU, where a draft call and a
    wider verification are nearly free): N is chosen every round as the N that maximises (1 + Σ of the N best
    joints) / round cost, and a level is drafted only for the prefix of its expansion that pays for one more draft
    call (`best_prefix`, a node offering its rank-1 child at joint · own probability: the chain's expected-value
    estimate) — so on a CPU where draft calls are dear it stops as the expected-value chain would."""

    name = "eagle2"

    def __init__(self, topk: int = 4, max_depth: int = 6, max_nodes: int = 32, nodes: int | None = None,
                 threshold: float | None = None, svip: dict | None = None, profile=None):
        super().__init__(max_depth, profile)
        # SVIP deciding the depth (SVIP paper §4.4, Table 4): every `every` levels, stop growing when the
        # distribution the level's most likely node was drawn from has √(c·H) > h — decode.rules.SVIP's test
        self.svip = None
        if svip:
            from decode.rules import SVIP

            svip = dict(svip)
            every = int(svip.pop("every", 2))
            if every < 1:
                raise UserError(f"policy.{self.name}.svip.every must be ≥ 1, got {every}")
            self.svip = (SVIP(**svip), every)
        if int(topk) < 1 or int(max_nodes) < 1 or (nodes is not None and int(nodes) < 1):
            raise UserError(f"policy.{self.name}.topk, max_nodes and nodes must be ≥ 1, got {topk}, {max_nodes}, {nodes}")
        self.topk, self.max_nodes = int(topk), int(max_nodes)
        # EAGLE-2 as published: every level grown, the `nodes` most likely verified (a fixed N; the sweeps of
        # accepted length against verified nodes use it); null: depth and N chosen on the profile
        self.nodes = None if nodes is None else int(nodes)
        # C2T's pruning: nodes whose acceptance estimate is below it are neither expanded nor verified (on eagle2's
        # joint probability it is the training-free ablation of C2T's classifier); null: no pruning
        self.threshold = None if threshold is None else float(threshold)

    def children(self, tree, parent, level):
        return tree.top(parent, self.topk)

    def replay_children(self, tree, parent, candidate, cparent, level):
        kids = sorted((r, i) for i, (p, r) in enumerate(zip(candidate.parents, candidate.rank))
                      if p == cparent and r <= self.topk)
        self._replay_missing += self.topk - len(kids)
        if candidate.score and len(tree.score) == len(tree):  # a learned builder's replay: the trace's head scores
            tree.score.extend(candidate.score[i] for _, i in kids)
        return [i for _, i in kids]

    def acceptance(self, tree) -> list[float]:
        """Each node's estimated chance to be on the accepted path: EAGLE-2's joint draft probability. It never
        exceeds the parent's, so every prefix of the nodes in decreasing order is ancestor-closed."""
        return tree.joint

    def _order(self, acc: list[float], tree) -> list[int]:
        return sorted(range(len(tree)), key=lambda i: (-acc[i], tree.depth[i], i))[: self.max_nodes]

    def _best(self, acc: list[float], tree) -> tuple[float, int]:
        """(expected tokens, N) of the best selection: the N most likely nodes with the most tokens per unit time,
        costed with the draft calls the round has made so far (`tree.levels`)."""
        best, best_e, best_n, gain = 1.0 / self.round_cost(tree.levels, 0), 1.0, 0, 0.0
        for n, node in enumerate(self._order(acc, tree), 1):
            gain += acc[node]
            value = (1 + gain) / self.round_cost(tree.levels, n)
            if value > best:
                best, best_e, best_n = value, 1 + gain, n
        return best_e, best_n

    def prune(self, acc: list[float], nodes: list[int]) -> list[int]:
        """Nodes of the expansion that may grow: those at or above `threshold` (all without one)."""
        return nodes if self.threshold is None else [i for i in nodes if acc[i] >= self.threshold]

    def _svip_stops(self, tree, new, level) -> bool:
        if self.svip is None or level % self.svip[1]:
            return False
        if tree.root_q is None:  # eval.tree_replay regrows a recorded tree, which holds no distributions
            raise UserError(f"policy {self.name}'s svip depth rule reads the draft's distributions, which a tree "
                            "trace does not keep; measure it with python -m decode")
        best = max(new, key=lambda i: tree.joint[i])
        return float(tree.stats(tree.parents[best])[2]) > self.svip[0].h_max

    def expand(self, tree, new, level):
        if self._svip_stops(tree, new, level):
            return []
        acc = self.acceptance(tree)
        # EAGLE-2's expansion — the top-k new nodes by joint, as tree traces record it (so the replay holds every
        # node any of these builders grows) — then the most likely first
        top = self.prune(acc, sorted(new, key=lambda i: -tree.joint[i])[: self.topk])
        top.sort(key=lambda i: -acc[i])
        if self.nodes is not None:
            return top
        expected, n = self._best(acc, tree)

        def offer(i):  # the rank-1 child's chance: the node's, times its own chance given its parent (the chain's)
            par = tree.parents[i]
            cond = acc[i] if par < 0 else (acc[i] / acc[par] if acc[par] > 0 else 0.0)
            return acc[i] * cond, 1

        return top[: self.best_prefix(expected, tree.levels, n, [offer(i) for i in top])]

    def select(self, tree):
        """The best N by acceptance, costed with the draft calls the round made (every level paid one)."""
        acc = self.acceptance(tree)
        if self.threshold is not None:  # the nodes above it, at most `nodes` (max_nodes) of them
            keep = sum(1 for a in acc if a >= self.threshold)
            return self._order(acc, tree)[: keep if self.nodes is None else min(keep, self.nodes)]
        n = self.nodes if self.nodes is not None else self._best(acc, tree)[1]
        return self._order(acc, tree)[:n]

    def describe(self):
        return {**super().describe(), "topk": self.topk, "max_nodes": self.max_nodes, "nodes": self.nodes,
                "threshold": self.threshold,
                "svip": None if self.svip is None else {**self.svip[0].describe(), "every": self.svip[1]}}


class Eagle2SVIP(Eagle2):
    """EAGLE-2's tree with SVIP deciding its depth, as the SVIP paper applies it (§4.4, Table 4): `eagle2` with its
    `svip` rule on by default (every two levels, stop when √(c·H) > h; official c = 0.15, h = 0.3), so the two sit
    side by side in one run under their own names."""

    name = "eagle2_svip"

    def __init__(self, *args, svip: dict | None = None, **kwargs):
        super().__init__(*args, svip={"c": 0.15, "h": 0.3, "every": 2} if svip is None else svip, **kwargs)

