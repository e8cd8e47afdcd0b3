"""Label schemes: functions of stored trace columns, applied at load time (train and eval share them).

Traces keep raw statistics (q(x), p(x), TVD, tokens), so a τ sweep or a new scheme never regenerates traces.
A scheme is one `LabelScheme` class plus `conf/labels/<name>.yaml` whose `_target_` names it (`labels=NAME`, built by
`scheme`); what train and eval ask of it (its columns, soft or hard, node or chain, conditional) is declared on the
class, never read off its name.

| scheme | label | source |
|---|---|---|
| greedy_match | 1[x = argmax p] | DISCO App. D |
| tvd | soft 1 − TVD(p, q); with `hard_threshold` set, 1[1 − TVD ≥ threshold] | DISCO ("cross-entropy with the TVD") |
| ratio | 1[q(x)/p(x) ≤ τ] (τ = 1 ⇔ p ≥ q; larger τ accepts more) | SPRINTER |
| accept_prob | soft min(1, p(x)/q(x)) | SpecDec++ |
| sum_min | soft Σ_v min(p_v, q_v) (= 1 − TVD: the exact sampler's acceptance rate at that position) | DISCO, Leviathan α |
| on_path | 1[a candidate-tree node's root path is the target's greedy continuation] (tree traces, node heads) | C2T |
| on_path_given_parent | on_path, on the rows whose parent is on the path (the root's children always): P(accept ∣ parent accepted), an edge probability composed by product along the path (tree traces, node heads) | EAGLE-2's joint, learned |

Row masks (`make_mask`): a conditional scheme labels only some rows (on_path_given_parent: the nodes whose parent is
on the path, looked up in the same (prompt_id, position) tree, models.features.parent_rows); train and eval drop the
other rows before fitting, metrics, calibration and the threshold (a zero weight would not keep them out of metrics).

Row weights (`make_weights`, the loss's per-row weight): `reach_weight` w ∈ [0, 1] down-weights rows a decoder
would not reach because an earlier token of the same draft round was rejected — weight = R + (1 − R)·w, R = Π of
the acceptances of the round's earlier rows (`reach: hard` 1[x = argmax p], `soft` min(1, p/q)), rounds as in
`models.features.trace_round_positions`. w = 1 (default) weights every row alike; w = 0 trains on reachable mass
only (SpecDec++'s argument: past a rejection the draft runs on a context the decoder never sees). On greedy
target_ar traces with hard reach every row is reachable (rounds there end at their first rejection), so it only
changes soft-reach or sampled training.
"""

from __future__ import annotations

import numpy as np

from models.features.layout import CHAIN_COLUMNS, ROUND_COLUMNS
from utils import discover
from utils.cli import UserError


class LabelScheme:
    """A label scheme: the trace columns it reads and the labels (float32 in [0, 1]) it makes of them.

    Class flags: `soft` (labels are probabilities; metrics binarise them at 0.5), `node` (labels token-tree nodes,
    trace=tree, so no chain reach weighting), `conditional` (a node scheme conditional on the parent being on the
    path: P(on path) is its product along the root path, models.features.compose_path, and it labels only the rows
    `make_mask` keeps). The yaml's other keys (`name`, `reach_weight`, `reach`, the scheme's own) are its settings.
    """

    columns: tuple[str, ...] = ()
    soft = False
    node = False
    conditional = False

    def __init__(self, name: str | None = None, reach_weight: float | None = 1.0, reach: str = "hard", **params):
        self.name = str(name)
        self.reach_weight = reach_weight
        self.reach = reach
        self.params = params

    @property
    def is_soft(self) -> bool:
        return self.soft

    def labels(self, col: dict[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError


class GreedyMatch(LabelScheme):
    columns = ("draft_token", "target_token")

    def labels(self, col):
        return (col["draft_token"] == col["target_token"]).astype(np.float32)


class Tvd(LabelScheme):
    columns = ("tvd",)
    soft = True

    @property
    def is_soft(self) -> bool:  # hard_threshold set: 1[1 − TVD ≥ threshold]
        return self.params.get("hard_threshold") is None

    def labels(self, col):
        soft = 1.0 - col["tvd"].astype(np.float64)
        threshold = self.params.get("hard_threshold")
        return (soft >= float(threshold)).astype(np.float32) if threshold is not None else soft.astype(np.float32)


class Ratio(LabelScheme):
    columns = ("q_draft", "p_draft")

    def labels(self, col):
        q, p = col["q_draft"].astype(np.float64), col["p_draft"].astype(np.float64)
        return (q <= float(self.params.get("tau", 1.0)) * p).astype(np.float32)


class AcceptProb(LabelScheme):
    columns = ("q_draft", "p_draft")
    soft = True

    def labels(self, col):
        q, p = col["q_draft"].astype(np.float64), col["p_draft"].astype(np.float64)
        return np.minimum(1.0, p / np.maximum(q, 1e-30)).astype(np.float32)


class SumMin(LabelScheme):
    columns = ("tvd",)
    soft = True

    def labels(self, col):
        return np.clip(1.0 - col["tvd"].astype(np.float64), 0.0, 1.0).astype(np.float32)


class OnPath(LabelScheme):
    columns = ("on_path",)
    node = True

    def labels(self, col):
        return col["on_path"].astype(np.float32)


class OnPathGivenParent(OnPath):
    """on_path's labels; its rows are `make_mask`'s (the nodes whose parent is on the path)."""

    columns = ("on_path", "node", "parent", "prompt_id", "position")
    conditional = True


def scheme(cfg) -> LabelScheme:
    """The scheme a labels config (or a checkpoint's labels dict) describes, built from its `_target_`; a config
    without one (checkpoints from before the key) is looked up by `name` in conf/labels."""
    if isinstance(cfg, LabelScheme):
        return cfg
    return discover.build("labels", cfg, LabelScheme, "name", f"label scheme '{dict(cfg or {}).get('name')}'")


def required_columns(cfg) -> tuple[str, ...]:
    return scheme(cfg).columns


def is_soft(cfg) -> bool:
    """Soft labels are probabilities in [0, 1]; metrics binarise them at 0.5."""
    return scheme(cfg).is_soft


def is_node(cfg) -> bool:
    """A scheme that labels token-tree nodes (trace=tree, node heads), not chain drafting steps."""
    return scheme(cfg).node


def is_conditional(labels) -> bool:
    """A node scheme conditional on the parent being on the path (`labels`: a labels config or a checkpoint's dict)."""
    return bool(labels) and scheme(labels).conditional


def make_labels(columns: dict, cfg) -> np.ndarray:
    """Labels (float32 in [0, 1]) for trace columns (a dict or a `datasets.Dataset`) under scheme `cfg`."""
    s = scheme(cfg)
    names = columns.column_names if hasattr(columns, "column_names") else list(columns)
    missing = [c for c in s.columns if c not in names]
    if missing:
        if s.node:
            raise UserError(f"label scheme '{s.name}' labels token-tree nodes and these traces lack column(s) {missing}: "
                            "use tree traces (trace=tree) with a node head (model=c2t or model=tree_node)")
        hint = (" (these are token-tree traces: use labels=on_path or on_path_given_parent)" if "on_path" in names
                else "")
        raise UserError(
            f"label scheme '{s.name}' needs trace column(s) {missing} that these traces lack{hint}; "
            "regenerate them with this code's data_gen or pick another labels="
        )
    return s.labels({c: np.asarray(columns[c]) for c in s.columns})


def make_mask(columns: dict, cfg) -> np.ndarray | None:
    """The rows scheme `cfg` labels (bool per row), None when it labels every row. on_path_given_parent: the nodes
    whose parent (in the same (prompt_id, position) tree) is on the path, and the root's children."""
    s = scheme(cfg)
    if not s.conditional:
        return None
    from models.features.nodes import parent_on_path_rows, parent_rows

    make_labels(columns, s)  # missing columns → its one-line error
    try:
        return parent_on_path_rows(parent_rows(columns), np.asarray(columns["on_path"]))
    except ValueError as err:
        raise UserError(f"label scheme '{s.name}' looks up each node's parent in its tree: {err}") from None


def reach_weight(cfg) -> float:
    s = scheme(cfg)
    w = 1.0 if s.reach_weight is None else float(s.reach_weight)
    if not 0.0 <= w <= 1.0:
        raise UserError(f"labels.reach_weight must be in [0, 1] (1 = every row alike, 0 = reachable rows only), got {w}")
    if w < 1.0 and s.node:
        raise UserError(f"labels.reach_weight weights chain rounds; {s.name} labels tree nodes: leave it at 1")
    if str(s.reach) not in ("hard", "soft"):
        raise UserError(f"labels.reach must be hard or soft, got '{s.reach}'")
    return w


def weight_columns(cfg) -> tuple[str, ...]:
    """Trace columns `make_weights` reads (none while reach weighting is off)."""
    if reach_weight(cfg) >= 1.0:
        return ()
    acc = ("q_draft", "p_draft") if str(scheme(cfg).reach) == "soft" else ()
    return (*ROUND_COLUMNS, *CHAIN_COLUMNS, *acc)


def make_weights(columns: dict, cfg) -> np.ndarray:
    """Per-row loss weights R + (1 − R)·reach_weight (module docstring); all ones when reach_weight = 1."""
    from models.features.trace import trace_round_positions

    w = reach_weight(cfg)
    n = len(columns["position"]) if "position" in columns else len(next(iter(columns.values())))
    if w >= 1.0:
        return np.ones(n, dtype=np.float32)
    if str(scheme(cfg).reach) == "soft":
        q = np.asarray(columns["q_draft"], dtype=np.float64)
        acc = np.minimum(1.0, np.asarray(columns["p_draft"], dtype=np.float64) / np.maximum(q, 1e-30))
    else:
        acc = (np.asarray(columns["draft_token"]) == np.asarray(columns["target_token"])).astype(np.float64)
    pos = trace_round_positions(columns)
    # R_j = Π_{i < j in the round} acc_i, via cumulative log-acceptance (zeros kept exact with a counter)
    logs = np.log(np.maximum(acc, 1e-300))
    zero = (acc <= 0).astype(np.int64)
    clog, czero = np.concatenate([[0.0], np.cumsum(logs)]), np.concatenate([[0], np.cumsum(zero)])
    idx = np.arange(n)
    start = idx - pos
    reach = np.where(czero[idx] - czero[start] > 0, 0.0, np.exp(clog[idx] - clog[start]))
    return (reach + (1.0 - reach) * w).astype(np.float32)
