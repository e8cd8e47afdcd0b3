"""Trace kinds (data_gen/kinds.py): each kind is read from its class; a new kind is one class plus one yaml."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from data_gen.kinds import Interleaved, TargetAR, Tree, trace_kind
from tests.conftest import REPO
from utils.cli import UserError


class FirstPositions(TargetAR):
    """A kind only this test knows: target_ar rows, cut to each continuation's first `keep` positions."""

    def folder_suffix(self, t):
        return f"-keep{int(t.keep)}"

    def manifest_extra(self, t):
        return {"keep": int(t.keep)}

    def rows(self, pair, items, t):
        out = []
        for cols in super().rows(pair, items, t):
            n = min(int(cols["n"]), int(t.keep))
            out.append({k: v if k in ("prompt_tokens", "prompt_id", "split", "kind") else v[:n]
                        for k, v in cols.items() if k != "n"} | {"n": n})
        return out


OVERRIDES = ("pair=tiny_random", "dataset=mbpp", "progress=false", "max_prompt_tokens=40", "split=test", "limit=3")


def user_conf(tmp_path):
    """A user's conf dir holding trace/first_positions.yaml (this module's class)."""
    root = tmp_path / "user_conf"
    (root / "trace").mkdir(parents=True, exist_ok=True)
    (root / "trace" / "first_positions.yaml").write_text(
        f"# a test kind\n_target_: {__name__}.FirstPositions\nkind: first_positions\nmax_new_tokens: 8\n"
        "temperature: 0.0\ntop_p: 1.0\nseed: 0\nstore_hidden: false\ntopk: 10\nkeep: 3\n")
    return root


def data_gen_cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("data_gen", [*OVERRIDES, f"trace_root={tmp_path / 'traces'}",
                                    f"hydra.searchpath=[file://{user_conf(tmp_path)}]", *overrides])


def test_each_kind_is_read_from_its_class():
    conf = lambda name: OmegaConf.load(REPO / "conf" / "trace" / f"{name}.yaml")  # noqa: E731
    assert type(trace_kind(conf("target_ar"))) is TargetAR and trace_kind(conf("interleaved")).store_hidden({})
    tree = trace_kind(conf("tree"))
    assert isinstance(tree, Tree) and tree.tree and tree.folder_suffix(conf("tree")) == "-w4-d5"
    assert isinstance(trace_kind({"kind": "interleaved"}), Interleaved)  # a manifest's config from before `_target_`
    with pytest.raises(UserError, match="unknown trace kind .nope.; known: .*target_ar"):
        trace_kind({"kind": "nope"})
    with pytest.raises(UserError, match="is not a data_gen.kinds.TraceKind"):
        trace_kind({"kind": "x", "_target_": "collections.OrderedDict"})


@pytest.mark.slow
def test_a_new_kind_generates_traces_through_the_data_gen_command(tmp_path, tiny_pair, cli):
    """`python -m data_gen trace=first_positions hydra.searchpath=[file://DIR]` as a user types it: the class's rows,
    folder name and manifest entry, and the rows are target_ar's first positions."""
    from data_gen.run import generate
    from data_gen.store import load_traces

    done = cli("data_gen", *OVERRIDES, "trace=first_positions", f"trace_root={tmp_path / 'traces'}",
               f"hydra.searchpath=[file://{user_conf(tmp_path)}]", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-2000:]
    (folder,) = [p for p in (tmp_path / "traces").rglob("manifest.json")]
    folder = folder.parent
    assert folder.name.endswith("-keep3--test-lim3") and "--first_positions-" in folder.name
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["trace_kind"] == "first_positions" and manifest["keep"] == 3 and manifest["complete"]
    new, _ = load_traces(folder)
    ref, _ = load_traces(generate(data_gen_cfg(tmp_path, "trace=target_ar", "trace.max_new_tokens=8"), "test", tiny_pair))
    ref = ref.filter(lambda r: r["position"] < 3)
    assert len(new) == len(ref) > 0 and max(new["position"]) == 2
    for col in ("prompt_id", "position", "draft_token", "target_token", "q_draft", "p_draft", "tvd"):
        np.testing.assert_array_equal(np.asarray(new[col]), np.asarray(ref[col]), err_msg=col)
