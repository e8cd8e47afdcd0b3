"""Feature groups: the optional column groups a grouped feature kind appends to its row, one class + one yaml each.

A group is found by name: `conf/feature_group/<name>.yaml` (disco_plus's chain groups) or `conf/node_group/<name>.yaml`
(tree_node_plus's node groups) on Hydra's search path (utils.discover), its `_target_` the class, built with
`hydra.utils.instantiate`. So `model.groups=[verify,copy]` keeps its meaning, checkpoints that store group names keep
loading, and a new group is a class here (or anywhere importable) plus a yaml. Each group says which head columns it
adds, which trace columns it reads and what decode must hand it (context, verification statistics, hidden state).
"""

from __future__ import annotations

from models.features.layout import COPY, NO_VERIFY, TEXT, TOKEN, VERIFY, hidden_names
from models.features.text import classes_of
from models.features.trace import copy_token_columns, hidden_columns, text_columns, verify_columns


class FeatureGroup:
    """One group of columns. `rank` orders a spec's groups (the shipped ones in layout.GROUPS order; a new group
    defaults to after them, then by name). Chain groups answer `from_columns` (trace rows) and `values` (decode, from
    the DraftStep and the row builder's state: models.features.chain.PlusFeatures)."""

    name = ""  # the yaml's file name, set on loading
    rank = 100
    columns: tuple = ()  # the head columns it adds
    trace_columns: tuple = ()  # the trace columns `from_columns` reads
    reads_context = False  # decode must hand DraftStep.context (Tree.context for a node group)
    reads_verify = False  # decode must hand the last verification's statistics
    reads_hidden = False  # decode must hand the draft's hidden state; traces must store it
    needs_classes = False  # reads the tokenizer's token classes (FeatureSpec.text_classes)

    def names(self, spec) -> list[str]:
        return list(self.columns)

    def from_columns(self, columns: dict, spec, cache: dict):
        """(N, len(names)) values per trace row; `cache` is shared by a row's groups (copy and token share a pass)."""
        raise NotImplementedError

    def values(self, step, state) -> list[float]:
        """The decode-time values of one drafted token (`state`: PlusFeatures' index, prev token, line, table)."""
        raise NotImplementedError


def _copy_token(columns: dict, cache: dict):
    if "copy_token" not in cache:
        cache["copy_token"] = copy_token_columns(columns)
    return cache["copy_token"]


class VerifyGroup(FeatureGroup):
    """The last verification: target entropy and top-2 margin, accepted count, all-accepted, mean TVD."""

    rank, columns, reads_verify = 0, VERIFY, True
    trace_columns = ("target_entropy", "target_margin", "tvd")

    def from_columns(self, columns, spec, cache):
        return verify_columns(columns)

    def values(self, step, state):
        return step.verify.values() if step.verify is not None else NO_VERIFY


class CopyGroup(FeatureGroup):
    """Does the token continue an n-gram of prompt + output; prompt lookup's agreement (models.features.context)."""

    rank, columns, reads_context = 1, COPY, True
    trace_columns = ("context_token", "prompt_tokens")

    def from_columns(self, columns, spec, cache):
        return _copy_token(columns, cache)[0]

    def values(self, step, state):
        return state.index.copy_features(step.token)


class TokenGroup(FeatureGroup):
    """The drafted token's and the previous token's ids (the head embeds them)."""

    rank, columns, reads_context = 2, TOKEN, True
    trace_columns = ("context_token", "prompt_tokens")

    def from_columns(self, columns, spec, cache):
        return _copy_token(columns, cache)[1]

    def values(self, step, state):
        return [float(step.token), float(state.prev)]


class TextGroup(FeatureGroup):
    """The token classes of the drafted and the previous token, and the line position (models.features.text)."""

    rank, columns, reads_context, needs_classes = 3, TEXT, True, True
    trace_columns = ("context_token", "prompt_tokens")

    def from_columns(self, columns, spec, cache):
        return text_columns(columns, spec.classes)

    def values(self, step, state):
        return [*classes_of(state.table, step.token), *classes_of(state.table, state.prev), float(state.line)]


class HiddenGroup(FeatureGroup):
    """The draft's last hidden state (d values), always last: decode copies the tensor in after the other values."""

    rank, reads_hidden = 1000, True  # after every other group, a user's too
    trace_columns = ("draft_hidden",)

    def names(self, spec):
        return hidden_names(spec.d)

    def from_columns(self, columns, spec, cache):
        return hidden_columns(columns, spec.d)

    def values(self, step, state):
        return []


_LOADED: dict = {}  # (folder, yaml path) → the group built from it


def group_names(folder: str) -> list[str]:
    """The groups `folder` (feature_group / node_group) holds on the search path."""
    from utils import discover

    return discover.names(folder)


def feature_group(folder: str, name: str) -> FeatureGroup:
    """The group `<folder>/<name>.yaml` builds (ValueError naming the known ones when there is none)."""
    from utils import discover

    path = discover.find(folder, name)
    if path is None:
        raise ValueError(f"unknown feature group '{name}'; known: {', '.join(group_names(folder))}")
    key = (folder, str(path))
    if key not in _LOADED:
        from hydra.utils import instantiate

        cfg = discover.read(path)
        discover.target_class(cfg.get("_target_"), FeatureGroup, f"feature group '{name}' ({discover.shown(path)})")
        group = instantiate(cfg)
        group.name = name
        _LOADED[key] = group
    return _LOADED[key]


_RESOLVED: dict = {}  # (folder, names, search path) → groups: decode asks per tree level, a listing costs ~100 µs


def resolve(folder: str, names) -> tuple[FeatureGroup, ...]:
    """The named groups in column order (`rank`, then name); ValueError naming any unknown ones."""
    from utils import discover

    names = tuple(names)
    if not names:
        return ()
    key = (folder, names, tuple(str(p) for p in discover.search_path()))
    if key not in _RESOLVED:
        known = set(group_names(folder))
        unknown = sorted(set(names) - known)
        if unknown:
            raise ValueError(f"unknown feature group(s) {unknown}; known: {', '.join(sorted(known))}")
        found = [feature_group(folder, n) for n in dict.fromkeys(names)]
        _RESOLVED[key] = tuple(sorted(found, key=lambda g: (g.rank, g.name)))
    return _RESOLVED[key]
