"""Tree builders that grow and prune by a trained node head (`learned_tree:CKPT`, `c2t:CKPT`): EAGLE-2's growth
(decode.tree_builders.Eagle2) with the head's P(node on the accepted path) in place of the joint probability."""

from __future__ import annotations

from decode.tree_builders import Eagle2
from models.features.nodes import compose_path
from utils.cli import UserError


class LearnedTree(Eagle2):
    """This project's learned tree builder (`learned_tree:CKPT`): EAGLE-2's growth with a trained node head's
    P(node on the accepted path) in place of the joint probability — the head (`python -m train
    +experiment=tree_mbpp`) reads the DISCO features of the node's parent distribution, its own probability, rank,
    depth and joint (a tree_node_plus head, `+experiment=tree_plus_mbpp`, also the node's copy features and the
    last verification's target entropy and margin, which the loop hands it) — under the expected-value rule: a
    level is drafted while its offers pay for the draft call, and the N nodes verified are those that maximise
    expected tokens per unit time on the measured profile (`Eagle2`). A node's estimate is capped by its parent's
    (a node cannot be accepted without its parent), so selections stay ancestor-closed. A head trained on
    labels=on_path_given_parent predicts P(accepted | parent accepted), so its estimate is instead the product of P
    along the root path (models.features.nodes.compose_path), as EAGLE-2's joint is the product of q: a calibrated
    edge probability composed into P(on path), still never above the parent's."""

    name = "learned_tree"
    learned = True

    def __init__(self, bundle=None, topk: int = 4, max_depth: int = 6, max_nodes: int = 32, nodes: int | None = None,
                 threshold: float | None = None, profile=None):
        super().__init__(topk, max_depth, max_nodes, nodes, threshold, profile=profile)
        from models.features.spec import feature_kind

        kind = feature_kind(bundle.spec.kind) if bundle is not None else None
        if kind is None or not getattr(kind, "tree", False):
            got = "none" if bundle is None else f"a '{bundle.spec.kind}' head"
            raise UserError(f"{self.name} needs a node head (python -m train +experiment=tree_mbpp or c2t_mbpp), got "
                            f"{got}; chain heads go with learned:CKPT")
        self.bundle, self.kind = bundle, kind
        # a head that reads the copy / verify node groups (tree_node_plus): decode.loop hands each round's tree the
        # root context and the last verification's target statistics (models.tree.Tree.context / .verify)
        self.needs_context = kind.needs_context(bundle.spec)
        self.needs_verify_stats = kind.needs_verify(bundle.spec)
        from data_gen.labels import is_conditional

        self.conditional = is_conditional(bundle.labels)  # P(on path | parent on path): composed by product
        self._rows = None  # bundle.row_scorer(), made on first use
        self._acc: tuple = (None, [])  # (the tree, P(on path) of its nodes composed so far)

    def acceptance(self, tree):
        """P(on path) of every node so far. Only the nodes added since the last call are scored and composed (a
        parent comes before its children, so theirs is known): models.features.nodes.compose_path, from where the last
        call stopped."""
        if len(tree.score) < len(tree):  # decode: score the nodes added since (their parents' distributions are known)
            new = list(range(len(tree.score), len(tree)))
            x = self.kind.node_rows(tree, new, self.bundle.spec)
            self._rows = self._rows or self.bundle.row_scorer()
            tree.score.extend(self._rows(x.numpy()).reshape(-1).tolist())
        if self._acc[0] is not tree:
            self._acc = (tree, [])
        if len(self._acc[1]) < len(tree):  # compose the nodes added since (their parents' are known)
            how = "product" if self.conditional else "min"
            self._acc = (tree, compose_path(tree.score[: len(tree)], tree.parents, how, self._acc[1]).tolist())
        return self._acc[1]

    def describe(self):
        return {**super().describe(), "head": self.bundle.path, "head_kind": self.bundle.spec.kind,
                "head_labels": self.bundle.labels.get("name")}


class C2T(LearnedTree):
    """C2T (Huo et al. 2025, arXiv 2502.13652): a 2-layer classifier on the node's joint probability, its parent
    distribution's entropy and its depth (`python -m train +experiment=c2t_mbpp`) scores each new node, and nodes
    scoring below `threshold` are pruned (with everything under them) from EAGLE-2's expansion before the next level
    and from the verified tree. `threshold`: null takes the checkpoint's (chosen on validation). Its depth, like
    eagle2's, is cut on the measured profile (a level is drafted while it pays for the draft call)."""

    name = "c2t"

    def __init__(self, bundle=None, threshold: float | None = None, topk: int = 4, max_depth: int = 6,
                 max_nodes: int = 32, nodes: int | None = None, profile=None):
        super().__init__(bundle, topk, max_depth, max_nodes, nodes,
                         float(bundle.threshold) if threshold is None and bundle is not None else threshold, profile)
        if self.conditional:  # its threshold was chosen on the edge P, not on the composed P(on path) C2T prunes by
            raise UserError(f"c2t prunes on a head's P(on path); {bundle.path} is a labels={bundle.labels['name']} "
                            "head (P given the parent): use learned_tree:CKPT, with policy.learned_tree.threshold=T "
                            "to prune")
