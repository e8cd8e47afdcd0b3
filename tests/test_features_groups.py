"""models.features.groups: a feature group is one class + one yaml. A group defined here (`LineParity`) and a yaml in
a user's conf dir are all it takes: a disco_plus spec names it, trace loading and decode build the same rows, and the
shipped groups keep their names, order and checkpoint loading."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.features.groups import FeatureGroup
from tests.test_features import NEW, Recorder, plus_traces  # noqa: F401  (the fixture)


class LineParity(FeatureGroup):
    """A toy group: whether the drafted token's position in the continuation is odd, and the token id mod `mod`."""

    columns = ("odd_position", "token_mod")
    trace_columns = ("position", "draft_token")

    def __init__(self, mod: int = 7):
        self.mod = int(mod)

    def from_columns(self, columns, spec, cache):
        pos = np.asarray(columns["position"]).astype(np.int64)
        tok = np.asarray(columns["draft_token"]).astype(np.int64)
        return np.stack([pos % 2, tok % self.mod], 1).astype(np.float32)

    def values(self, step, state):
        return [float(step.position % 2), float(step.token % self.mod)]


@pytest.fixture
def user_group(tmp_path, monkeypatch):
    """conf dir with feature_group/parity.yaml (this module's class) on the search path, as hydra.searchpath adds it."""
    from utils import discover

    (tmp_path / "feature_group").mkdir()
    (tmp_path / "feature_group" / "parity.yaml").write_text(f"_target_: {__name__}.LineParity\nmod: 5\n")
    (tmp_path / "feature_group" / "broken.yaml").write_text("_target_: collections.OrderedDict\n")
    real = discover.search_path
    monkeypatch.setattr(discover, "search_path", lambda cfg=None: [tmp_path, *real(cfg)])
    return tmp_path


def test_new_group_by_yaml(user_group, plus_traces, tiny_pair):  # noqa: F811
    from data_gen.contract import trace_columns
    from data_gen.store import load_traces
    from decode.loop import speculative
    from models.features.spec import FeatureSpec, features_from_columns, needed_columns
    from models.features.trace import continuation_starts

    spec = FeatureSpec("disco_plus", groups=["parity", "copy"])
    assert spec.groups == ("copy", "parity")  # shipped groups first (rank), then the user's
    assert spec.names[-5:] == ["copy_len", "lookup_hit", "lookup_len", "odd_position", "token_mod"]
    assert spec.needs_context and not spec.needs_verify and not spec.reads_hidden
    assert {"position", "draft_token", "context_token"} <= set(needed_columns(spec))
    assert FeatureSpec(**spec.to_dict()) == spec  # what a checkpoint stores loads back

    ds, _ = load_traces(plus_traces)
    cols = trace_columns(ds, list(needed_columns(spec)))
    x = features_from_columns(cols, spec)
    np.testing.assert_array_equal(x[:, -1].numpy(), cols["draft_token"] % 5)  # the yaml's argument
    starts = np.flatnonzero(continuation_starts(cols))
    a = int(starts[0])
    rec = Recorder(spec)
    speculative(tiny_pair, [int(t) for t in cols["prompt_tokens"][a]], rec, max_new_tokens=NEW,
                eos=tiny_pair.eos_ids)
    assert rec.rows
    for pos, row in rec.rows.items():  # decode's row is the trace's in the group's and copy's columns
        assert torch.equal(row[-5:], x[a + pos, -5:])


def test_unknown_and_broken_groups(user_group):
    from models.features.spec import FeatureSpec
    from utils.cli import UserError

    with pytest.raises(ValueError, match="takes the groups verify, copy, token, text, .*parity"):
        FeatureSpec("disco_plus", groups=["nope"])
    with pytest.raises(UserError, match="broken.*is not a models.features.groups.FeatureGroup"):
        FeatureSpec("disco_plus", groups=["broken"])
    with pytest.raises(ValueError, match="takes the groups none"):
        FeatureSpec("disco", groups=["parity"])


def test_shipped_groups_keep_their_order():
    from models.features.layout import GROUPS
    from models.features.spec import FeatureSpec

    spec = FeatureSpec("disco_plus", d=2, groups=list(reversed(GROUPS)), text_classes="AAAA")
    assert spec.groups == GROUPS
    assert FeatureSpec("tree_node_plus", groups=["copy", "verify"]).groups == ("verify", "copy")
