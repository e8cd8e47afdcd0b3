"""Token-tree node features (issue 30): the per-node columns a tree gives (`node_columns`, the one definition
data_gen's tree traces store and decode's node heads read), the node groups, and the node feature kinds.

One row per candidate-tree node, labelled on_path — `c2t` (C2T, arXiv 2502.13652: joint probability, entropy of the
parent's distribution, depth), `tree_node` (those, the DISCO inputs of the parent distribution, the node's q_token
and rank, log joint, the parent's own q_token) and `tree_node_plus` (tree_node's row + node groups, per node:
`verify` — the target's entropy and top-2 margin at the position before the tree's root, 0 before the first
verification — and `copy`: COPY of the node's token after prompt + committed continuation + the node's root path up
to its parent, `node_copy_columns`). Rows come from tree-trace columns (`from_columns`) or from a models.tree.Tree
(`node_rows`, the tree carrying its root context and verification numbers: `Tree.context` / `Tree.verify`).
"""

from __future__ import annotations

import torch

from models.features.context import ContextIndex
from models.features.groups import FeatureGroup, resolve
from models.features.kind import FeatureKind
from models.features.layout import COPY, NODE_VERIFY, VERIFY
from models.features.trace import as_array
from models.tree import Tree



def parent_rows(columns: dict):
    """Per tree-trace row, the row of its parent node in the same (prompt_id, position) tree; −1 for the root's
    children. Node ids index within one tree, so the lookup is by (prompt_id, position, node).

    data_gen writes a tree's nodes as consecutive rows in node order (node i is row start + i), so the parent's row is
    row − node + parent; a reordered table (checked) falls back to a lookup by (prompt_id, position, node)."""
    import numpy as np

    node = as_array(columns["node"]).astype(np.int64)
    parent = as_array(columns["parent"]).astype(np.int64)
    keys = [as_array(columns[c]) for c in ("prompt_id", "position") if c in columns]
    n, has = len(node), parent >= 0
    rows = np.where(has, np.arange(n) - node + parent, np.arange(n))  # a root child points at itself (unused)
    good = (rows >= 0) & (rows < n)
    if good.all():
        good = node[rows] == np.where(has, parent, node)
        for key in keys:
            good &= key[rows] == key
    if not good.all():
        where = {(*(key[i] for key in keys), int(node[i])): i for i in range(n)}
        rows = np.array([where.get((*(key[i] for key in keys), int(parent[i])), -1) if has[i] else i for i in range(n)],
                        dtype=np.int64)
        if (rows[has] < 0).any():
            raise ValueError("tree trace rows name a parent node missing from the table; load whole trees")
    return np.where(has, rows, -1)


def parent_q_column(columns: dict):
    """Per tree-trace row, its parent node's own q_token (1.0 for the root's children), read off the parent's row
    (`parent_rows`)."""
    import numpy as np

    rows = parent_rows(columns)
    q = as_array(columns["q_token"]).astype(np.float32)
    out = np.ones(len(rows), dtype=np.float32)
    out[rows >= 0] = q[rows[rows >= 0]]
    return out


def parent_on_path_rows(parents, on_path):
    """The nodes whose parent is on the accepted path (the root's children always): the rows of the conditional
    task P(on path | parent on path) (labels=on_path_given_parent). `parents`: per row its parent's row, −1 at the
    root (`parent_rows`, or a models.tree.Tree's `parents`, where node i is row i)."""
    import numpy as np

    par = np.asarray(parents, dtype=np.int64)
    on = np.asarray(on_path).astype(bool)
    out = par < 0
    out[~out] = on[par[~out]]
    return out


def compose_path(scores, parents, how: str = "product", known=()):
    """Per node, its score composed along its root path: `product` (acc = P · acc[parent], a conditional head's
    P(on path | parent on path) → P(on path), as EAGLE-2's joint composes q) or `min` (acc = min(P, acc[parent]),
    an unconditional head's P capped by its parent's). `parents` as in `parent_on_path_rows`; any row order.
    `known`: the composed values of the first rows, already computed (decode's learned builders compose a tree level
    by level, passing what the earlier levels gave). The one composition eval and decode's builders read."""
    import numpy as np

    p = np.asarray(scores, dtype=np.float64).reshape(-1)
    par = np.asarray(parents, dtype=np.int64).reshape(-1)
    op = {"product": np.multiply, "min": np.minimum}.get(how)
    if op is None:
        raise ValueError(f"compose_path: how must be product or min, got '{how}'")
    acc, done = p.copy(), par < 0
    acc[: len(known)] = np.asarray(known, dtype=np.float64)
    done[: len(known)] = True
    while not done.all():  # one level per pass: the nodes whose parent is composed
        ready = ~done & done[np.where(done, 0, par)]
        if not ready.any():
            raise ValueError("compose_path: a node's parent is missing or on a cycle; pass whole trees")
        acc[ready] = op(p[ready], acc[par[ready]])
        done |= ready
    return acc


def node_copy_columns(index: ContextIndex, parents, tokens, nodes):
    """(len(nodes), 3) COPY per token-tree node: `ContextIndex.copy_features` of the node's token after the tree's
    root context (what `index` holds: prompt + committed continuation) followed by the node's root path up to its
    parent — the chain's definition on a context that branches per node. `parents` / `tokens`: the tree's (−1: a
    child of the root). Nodes under one parent share a context: its path is pushed once, read, and rolled back, so
    `index` is left as found (decode keeps one index per prompt; traces one per continuation)."""
    import numpy as np

    out = np.zeros((len(nodes), len(COPY)), dtype=np.float32)
    by_parent: dict[int, list[int]] = {}
    for j, i in enumerate(nodes):
        by_parent.setdefault(int(parents[i]), []).append(j)
    for par, rows in by_parent.items():
        path, cur = [], par
        while cur >= 0:
            path.append(int(tokens[cur]))
            cur = int(parents[cur])
        mark = index.mark()
        for tok in reversed(path):
            index.push(tok)
        for j in rows:
            out[j] = index.copy_features(int(tokens[nodes[j]]))
        index.rollback(mark)
    return out



class NodeGroup(FeatureGroup):
    """A tree_node_plus node group (`conf/node_group/<name>.yaml`): per node, the `trace_columns` a tree gives
    (`tree_columns`, stored by tree traces under the same names) read as the head columns `columns`, in order."""

    def tree_columns(self, tree: Tree, nodes: list[int]) -> dict:
        """The group's float32 columns for `nodes` of `tree`."""
        raise NotImplementedError


class NodeVerifyGroup(NodeGroup):
    """The target's H_p and top-2 margin before the tree's root (`Tree.verify`), the policy-free part of the chain's
    verify group: the rest (accepted, all-accepted, mean TVD) depends on the builder that verified the last tree."""

    rank, columns, trace_columns, reads_verify = 0, VERIFY[:2], NODE_VERIFY, True

    def tree_columns(self, tree, nodes):
        import numpy as np

        if tree.verify is None:
            raise RuntimeError("node features of group verify need Tree.verify (the last verification's target "
                               "entropy and margin); grow the tree with verify=... (decode.loop does for builders "
                               "whose head asks)")
        return {name: np.full(len(nodes), v, dtype=np.float32) for name, v in zip(self.trace_columns, tree.verify)}


class NodeCopyGroup(NodeGroup):
    """COPY of the node's token after the root context and the node's root path (`node_copy_columns`)."""

    rank, columns, trace_columns, reads_context = 1, COPY, COPY, True

    def tree_columns(self, tree, nodes):
        if tree.context is None:
            raise RuntimeError("node features of group copy need Tree.context (a ContextIndex of prompt + committed "
                               "tokens); grow the tree with copy=... (decode.loop does for builders whose head asks)")
        copy = node_copy_columns(tree.context, tree.parents, tree.tokens, list(nodes))
        return {name: copy[:, j] for j, name in enumerate(self.trace_columns)}


# what `node_columns` returns per node: the structure, the node's own draft probability, and the DISCO features of
# its parent's distribution (draft_topk (n, k) when k > 0, draft_entropy) plus parent_q, the parent's own q_token
NODE_COLUMNS = ("node", "parent", "depth", "rank", "token", "q_token", "joint", "draft_entropy", "parent_q")
NODE_GROUP_FOLDER = "node_group"  # where node groups are found by name (models.features.groups)


@torch.no_grad()
def node_columns(tree: Tree, nodes: list[int], k: int, support=None, groups=()) -> dict:
    """Per-node numpy columns computed from the tree alone, the one definition data_gen's tree traces store
    (data_gen.traces.tree_rows) and decode's node heads read (`NodeFeatures.node_rows`), so a node head sees at
    decode exactly what it was trained on.

    draft_topk / draft_entropy are those of the distribution the node was drawn from (its parent's, `tree.dist`),
    the values of models.features.signals.DraftStep, the extractor decode's chain policies read (`Tree.stats`;
    `support`: the draft's reduced vocabulary, same values); q_token = that distribution at the node's token;
    parent_q = the parent's own q_token (1.0 for the root's children). `support` defaults to the tree's. Ints are
    int32, floats float32; draft_topk is (len(nodes), k), omitted for k = 0. `groups` (node group names) add their
    `tree_columns`: `verify` reads `tree.verify`, `copy` `tree.context`; a tree without them is refused.
    """
    import numpy as np

    found = resolve(NODE_GROUP_FOLDER, groups)
    nodes = list(nodes)
    parents = list(dict.fromkeys(tree.parents[i] for i in nodes))
    stats = [tree.stats(p, max(k, 1), support) for p in parents]  # once per parent, shared with the builder's children
    row = {p: j for j, p in enumerate(parents)}
    rows = [row[tree.parents[i]] for i in nodes]
    ints = {"node", "parent", "depth", "rank", "token"}
    take = {"node": nodes, "parent": [tree.parents[i] for i in nodes], "depth": [tree.depth[i] for i in nodes],
            "rank": [tree.rank[i] for i in nodes], "token": [tree.tokens[i] for i in nodes],
            "q_token": [tree.q_token(i) for i in nodes], "joint": [tree.joint[i] for i in nodes],
            "draft_entropy": [float(stats[j][2]) for j in rows],
            "parent_q": [1.0 if tree.parents[i] < 0 else tree.q_token(tree.parents[i]) for i in nodes]}
    out = {name: np.asarray(take[name], dtype=np.int32 if name in ints else np.float32) for name in NODE_COLUMNS}
    if k > 0:
        top = np.stack([s[0].float().numpy() for s in stats]) if stats else np.zeros((0, k), np.float32)
        out["draft_topk"] = top[rows] if rows else np.zeros((0, k), np.float32)
    for group in found:
        out.update(group.tree_columns(tree, nodes))
    return out


class NodeFeatures(FeatureKind):
    """A token-tree node kind: one row per candidate-tree node, from `tree` traces (`from_columns`) or from a
    models.tree.Tree at decode (`node_rows`); both go through `_matrix` on the same per-node columns (`node_columns`),
    so the rows are equal. `parts` lists the row's values in order ("topk": the parent distribution's sorted top-k,
    k values; the others one value each, `NODE_VALUES`), then each node group's columns. The label is `on_path`, the
    training-free baselines the joint probability and q_token (the scores EAGLE-2 and a greedy tree rank nodes by)."""

    tree = True
    baselines = ("joint", "q_token")
    position_columns = ("depth",)
    parts: tuple = ()
    group_folder = NODE_GROUP_FOLDER

    def feature_groups(self, spec) -> tuple:
        """The node groups a head of this kind reads: what decode's builder must hand the tree (Tree.context,
        Tree.verify) and what only newer tree traces store (data_gen.store.TREE_FORMAT)."""
        return ()

    def names(self, spec):
        out = []
        for part in self.parts:
            out += [f"top{i + 1}" for i in range(spec.k)] if part == "topk" else [part]
        for group in self.feature_groups(spec):
            out += group.names(spec)
        return out

    def columns(self, spec):
        cols = []
        for part in self.parts:
            cols += NODE_SOURCES[part]
        for group in self.feature_groups(spec):
            cols += group.trace_columns
        return tuple(dict.fromkeys(cols))

    def _matrix(self, cols: dict, spec) -> torch.Tensor:
        import numpy as np

        blocks = []
        for part in self.parts:
            if part == "topk":
                topk = np.asarray(cols["draft_topk"], dtype=np.float32)
                if topk.ndim != 2 or topk.shape[1] < spec.k:
                    raise ValueError(f"draft_topk has shape {tuple(topk.shape)}; the feature spec needs k={spec.k}")
                blocks.append(topk[:, : spec.k])
            else:
                blocks.append(np.asarray(NODE_VALUES[part](cols), dtype=np.float32).reshape(-1, 1))
        for group in self.feature_groups(spec):
            blocks += [np.asarray(cols[c], dtype=np.float32).reshape(-1, 1) for c in group.trace_columns]
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(blocks, axis=1), dtype=np.float32))

    def from_columns(self, columns, spec):
        lack = [c for c in self.columns(spec) if c not in columns and c not in ("prompt_id", "position")]  # keys only
        if lack:
            from utils.cli import UserError

            raise UserError(f"{self.name} features need tree-trace column(s) {lack} these traces lack (made before "
                            "them?); regenerate the tree traces with python -m data_gen trace=tree ... overwrite=true")
        cols = {c: as_array(columns[c]) for c in self.columns(spec) if c in columns}
        if "parent_q" in self.parts:
            cols["parent_q"] = parent_q_column(columns)
        return self._matrix(cols, spec)

    def node_rows(self, tree: Tree, nodes: list[int], spec, support=None) -> torch.Tensor:
        """(len(nodes), spec.dim) float32 rows of `nodes` of a models.tree.Tree (their parents' distributions known:
        `tree.dist`), the rows `from_columns` gives for the same nodes in a tree trace. `support`: the draft's reduced
        vocabulary (models.lm.LM.support) when it has one — the same values, fewer reads."""
        k = spec.k if "topk" in self.parts else 0
        groups = [g.name for g in self.feature_groups(spec)]
        return self._matrix(node_columns(tree, list(nodes), k, support, groups), spec)

    def positions(self, columns):
        """depth − 1: the node's position on its drafted path (0 = a child of the root), as a chain's round position."""
        import numpy as np

        return as_array(columns["depth"]).astype(np.int64) - 1

    def decoder(self, spec, device=None):
        from utils.cli import UserError

        raise UserError(f"a {self.name} head scores token-tree nodes (decode's tree builders: kind.node_rows); it has "
                        "no chain-round decoder, so it cannot be a chain stop policy (learned:<ckpt>): use a disco head")

    def needs_context(self, spec):
        return any(g.reads_context for g in self.feature_groups(spec))

    def needs_verify(self, spec):
        return any(g.reads_verify for g in self.feature_groups(spec))


def _log(x):
    """float32 log, floored at 1e-30 (a joint probability can underflow to 0 in float32)."""
    import numpy as np

    return np.log(np.maximum(np.asarray(x, dtype=np.float32), np.float32(1e-30)))


# the trace columns each node value reads, and the value from those columns (float32 arrays, `NodeFeatures._matrix`)
NODE_SOURCES = {
    "topk": ("draft_topk",),
    "parent_entropy": ("draft_entropy",),
    "depth": ("depth",),
    "joint": ("joint",),
    "log_joint": ("joint",),
    "q_token": ("q_token",),
    "rank": ("rank",),
    "parent_q": ("node", "parent", "q_token", "prompt_id", "position"),
}
NODE_VALUES = {
    "parent_entropy": lambda c: c["draft_entropy"],
    "depth": lambda c: c["depth"],
    "joint": lambda c: c["joint"],
    "log_joint": lambda c: _log(c["joint"]),
    "q_token": lambda c: c["q_token"],
    "rank": lambda c: c["rank"],
    "parent_q": lambda c: c["parent_q"],
}


class C2TFeatures(NodeFeatures):
    """C2T (arXiv 2502.13652): [joint probability, entropy of the parent's distribution, depth]."""

    name = "c2t"
    parts = ("joint", "parent_entropy", "depth")


class TreeNodeFeatures(NodeFeatures):
    """This project's richer node row: C2T's inputs, the DISCO inputs of the parent distribution (sorted top-k), the
    node's own q_token and rank, log joint, and the parent's own q_token (1.0 for the root's children)."""

    name = "tree_node"
    reads_probs = True
    parts = ("topk", "parent_entropy", "depth", "joint", "log_joint", "q_token", "rank", "parent_q")


class TreeNodePlusFeatures(TreeNodeFeatures):
    """tree_node's row + the node groups (issue 30; `NodeVerifyGroup`, `NodeCopyGroup`): the richer inputs the
    chain's disco_plus heads read, per node. Not `hidden`: the parent's 576-float hidden state per node would take
    ~7 GB of tree traces for 500 prompts. Decode hands the builder the root context and the verification numbers
    (`needs_context`, `needs_verify`: decode.loop attaches them to the tree, models.tree.grow). `model.groups` picks
    either group alone (the ablation); a spec without groups (the heads saved before groups were selectable) reads
    `default_groups`."""

    name = "tree_node_plus"
    grouped = True
    default_groups = ("verify", "copy")

    def feature_groups(self, spec):
        return resolve(self.group_folder, tuple(spec.groups) or self.default_groups)
