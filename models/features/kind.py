"""The base of every feature kind (`FeatureSpec.kind`): what a kind declares — its columns, the trace columns it is
built from, what decode must compute for it — so the stages ask a spec, never compare kind names."""

from __future__ import annotations

import torch

from models.features.layout import CHAIN_COLUMNS, ROUND_COLUMNS
from models.features.trace import trace_round_positions


class FeatureKind:
    """One kind of head input (`FeatureSpec.kind`): its columns, the trace columns it is built from, and what decode
    must compute for it. Every difference between kinds lives in its class, so the stages ask a spec
    (`spec.reads_probs`, `spec.reads_hidden`, `needed_columns(spec)`, ...) rather than compare kind names; a new kind
    is one subclass with a new `name` (the string checkpoints store), which `feature_kind` finds."""

    name = ""
    reads_probs = False  # the DISCO part (top-k q, H_q): decode computes q, traces store draft_topk / draft_entropy
    grouped = False  # takes optional column groups (`FeatureSpec.groups`, train's model.groups)
    group_folder = "feature_group"  # where a grouped kind finds its groups by name (models.features.groups)
    # scores token-tree nodes (`NodeFeatures`: tree traces, decode's tree builders) rather than chain drafting steps:
    # no round decoder, no chain speed rule or static-length baseline
    tree = False
    # the training-free scores its heads are compared with (eval.metrics.BASELINES names), on the same rows
    baselines = ("max_q", "neg_entropy")
    position_columns = ROUND_COLUMNS + CHAIN_COLUMNS  # the trace columns `positions` reads (the latter if present)

    def names(self, spec) -> list[str]:
        """Column names of the head input, in order."""
        raise NotImplementedError

    def columns(self, spec) -> tuple[str, ...]:
        """The trace columns `from_columns` reads."""
        raise NotImplementedError

    def from_columns(self, columns: dict, spec) -> torch.Tensor:
        """(N, spec.dim) float32 head input from trace columns."""
        raise NotImplementedError

    def decoder(self, spec, device=None):
        """The decode-time row builder: `reset()` per prompt, `row(step)` per drafted token (`from_columns`' row)."""
        raise NotImplementedError

    def positions(self, columns: dict):
        """Per row, its 0-based position in what the decoder drafts in one go (per-position metrics buckets; chain
        kinds: the position in the draft round, `trace_round_positions`)."""
        return trace_round_positions(columns)

    def reads_hidden(self, spec) -> bool:
        return False

    def needs_context(self, spec) -> bool:
        return False

    def needs_verify(self, spec) -> bool:
        return False

    def feature_groups(self, spec) -> tuple:
        """The group objects a spec of this kind reads (models.features.groups; none for an ungrouped kind)."""
        return ()
