"""The best static token tree for a rank-acceptance vector: Sequoia's dynamic programme (Chen et al. 2024).

Model (greedy verification, position independence): a tree node is a drafted token; its children are the draft's
rank-1, rank-2, … candidates after it (distinct ranks per parent). The target's token at any node is the draft's
rank-r candidate with probability p_r, the same everywhere, so a node is accepted with the product of p_rank over
its root path, and the expected number of accepted draft tokens is Σ over nodes of that product.

    g(n, r, D) = best forest of exactly n nodes whose roots use distinct ranks ≥ r and whose trees have depth ≤ D
               = max(g(n, r+1, D),  max_{s=0..n-1} p_r·(1 + g(s, 1, D−1)) + g(n−1−s, r+1, D))

A tree of size n under the pending token is g(n, 1, D). One table for D ≤ max_depth answers every (n, D) at once
(`TreeTable`), so a sweep over sizes and depths costs one O(N²·R·D) fill. Pure python: decode's tree builder and
eval.tree_ceiling share it without torch.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

NEG = float("-inf")


class StaticTree(NamedTuple):
    """A tree of draft nodes in preorder: `parents[i]` is the index of node i's parent (−1: the pending token, the
    root), `ranks[i]` its 1-based rank among its parent's candidates; `depth` levels (a chain of K: depth K)."""

    expected_accepted: float
    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    depth: int


def _check_probs(rank_probs: Sequence[float]) -> list[float]:
    p = [float(x) for x in rank_probs]
    if not p or any(x < 0 for x in p) or sum(p) > 1 + 1e-9:
        raise ValueError(f"rank_probs must be non-negative with sum ≤ 1, got {p}")
    return p


class TreeTable:
    """g(n, r, D) for n ≤ max_nodes, r ≤ len(rank_probs), D ≤ max_depth, with the choice that reached each value."""

    def __init__(self, rank_probs: Sequence[float], max_nodes: int, max_depth: int | None = None):
        self.p = _check_probs(rank_probs)
        self.n_max, self.d_max = int(max_nodes), int(max_nodes if max_depth is None else max_depth)
        R = len(self.p)
        # g[D][r][n] with r in 1..R+1 (index r; R+1 = no rank left), choice[D][r][n]: −1 skip rank r, else s
        self.g = [[[0.0] + [NEG] * self.n_max for _ in range(R + 2)] for _ in range(self.d_max + 1)]
        self.choice = [[[-1] * (self.n_max + 1) for _ in range(R + 2)] for _ in range(self.d_max + 1)]
        for D in range(1, self.d_max + 1):
            self._fill(D)

    def _fill(self, D: int) -> None:
        g, below, R = self.g[D], self.g[D - 1][1], len(self.p)
        for r in range(R, 0, -1):
            pr, nxt = self.p[r - 1], g[r + 1]
            for n in range(1, self.n_max + 1):
                best, arg = nxt[n], -1
                for s in range(n):
                    if below[s] == NEG or nxt[n - 1 - s] == NEG:
                        continue
                    v = pr * (1.0 + below[s]) + nxt[n - 1 - s]
                    if v > best + 1e-15:
                        best, arg = v, s
                g[r][n], self.choice[D][r][n] = best, arg

    def value(self, n: int, max_depth: int) -> float:
        """Best expected accepted tokens of a tree of exactly n nodes and depth ≤ max_depth (−inf: none exists)."""
        return self.g[min(max_depth, self.d_max)][1][n]

    def tree(self, n: int, max_depth: int) -> StaticTree:
        """The tree that reaches `value(n, max_depth)`; ValueError when no tree of n nodes fits the depth and ranks."""
        D = min(max_depth, self.d_max)
        if not 0 <= n <= self.n_max or self.g[D][1][n] == NEG:
            raise ValueError(f"no tree of {n} nodes with depth ≤ {max_depth} and ranks ≤ {len(self.p)}")
        parents: list[int] = []
        ranks: list[int] = []
        self._emit(n, 1, D, -1, parents, ranks)
        depth = _depth(parents)
        return StaticTree(self.g[D][1][n], tuple(parents), tuple(ranks), depth)

    def _emit(self, n: int, r: int, D: int, parent: int, parents: list[int], ranks: list[int]) -> None:
        """Append the forest g(n, r, D) under `parent` in preorder."""
        while n > 0:
            s = self.choice[D][r][n]
            if s >= 0:
                parents.append(parent)
                ranks.append(r)
                self._emit(s, 1, D - 1, len(parents) - 1, parents, ranks)
                n -= 1 + s
            r += 1


def run_levels(parents: Sequence[int]) -> list[int]:
    """The draft calls a static shape costs after the root's: per depth 1 .. depth − 1, its nodes with children
    (the draft runs a node to propose its children; `CostProfile.round_steps`' `levels`)."""
    level: list[int] = []
    for par in parents:
        level.append(1 if par < 0 else level[par] + 1)
    out = [0] * max(max(level, default=0) - 1, 0)
    for par in set(parents) - {-1}:
        out[level[par] - 1] += 1
    return out


def _depth(parents: Sequence[int]) -> int:
    level: list[int] = []
    for par in parents:
        level.append(1 if par < 0 else level[par] + 1)
    return max(level, default=0)


def best_static_tree(rank_probs: Sequence[float], n_nodes: int, max_depth: int | None = None) -> StaticTree:
    """The tree of `n_nodes` draft nodes (depth ≤ max_depth, None: any) with the most expected accepted tokens."""
    depth = n_nodes if max_depth is None else max_depth
    return TreeTable(rank_probs, n_nodes, depth).tree(n_nodes, depth)


def score_tree(rank_probs: Sequence[float], parents: Sequence[int], ranks: Sequence[int]) -> float:
    """Expected accepted draft tokens of a given tree (Σ over nodes of Π p_rank on the root path); ranks beyond the
    vector score 0. Parents must come before their children and siblings need distinct ranks."""
    p = _check_probs(rank_probs)
    if len(parents) != len(ranks):
        raise ValueError("parents and ranks differ in length")
    reach: list[float] = []
    seen: set[tuple[int, int]] = set()
    for i, (par, r) in enumerate(zip(parents, ranks)):
        if not -1 <= par < i or r < 1 or (par, r) in seen:
            raise ValueError(f"node {i}: parent {par} must precede it and rank {r} be ≥ 1 and new among its siblings")
        seen.add((par, r))
        pr = p[r - 1] if r <= len(p) else 0.0
        reach.append(pr * (1.0 if par < 0 else reach[par]))
    return float(sum(reach))


def chain(k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(parents, ranks) of a chain of k rank-1 nodes: classic speculative decoding with draft length k."""
    return tuple(range(-1, k - 1)), (1,) * k
