"""One class + one config per idea (issue 28): every policy, head family and feature kind is built from its yaml /
class by `hydra.utils.instantiate`, a policy defined outside the package (a class here + a yaml in a tmp conf dir) is
found by name by decode and by the replay, and a yaml that names no StopPolicy is one clear error line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from decode.policies import StopPolicy, build_policy, known_policies, parse_spec, policy_class, policy_config
from models.features.signals import DraftStep
from models.features.spec import FeatureSpec, feature_kinds
from models.heads import build_head, head_family, head_kinds
from tests.conftest import REPO
from utils.files import read_jsonl
from utils import discover
from utils.cli import UserError, open_overrides

pytestmark = pytest.mark.usefixtures("one_thread")

N_PROMPTS, NEW = 3, 16


class Floored(StopPolicy):
    """A policy from outside the package: stop once max q < floor, but never before `min_len` drafted tokens."""

    name = "floored"
    trace_score = "max_q"

    def __init__(self, floor: float = 0.5, min_len: int = 1, max_len: int = 8):
        super().__init__(max_len)
        self.floor, self.min_len = float(floor), int(min_len)

    def should_stop(self, step):
        return step.position_in_round + 1 >= self.min_len and float(step.probs.max()) < self.floor

    def describe(self):
        return {**super().describe(), "floor": self.floor, "min_len": self.min_len}


@pytest.fixture(scope="module")
def conf_dir(tmp_path_factory):
    """A user's conf dir: policy/floored.yaml (this module's class) and three broken policy yamls."""
    root = tmp_path_factory.mktemp("user_conf")
    (root / "policy").mkdir()
    (root / "policy" / "floored.yaml").write_text(
        f"# a test policy\n_target_: {__name__}.Floored\nfloor: 0.3\nmin_len: 2\nmax_len: 6\n")
    (root / "policy" / "no_target.yaml").write_text("k: 3\n")
    (root / "policy" / "not_a_policy.yaml").write_text("_target_: collections.OrderedDict\n")
    (root / "policy" / "not_importable.yaml").write_text("_target_: nowhere_at_all.Policy\n")
    return root


def cfg_of(name: str, *overrides: str, hydra_node: bool = False):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(name, list(overrides), return_hydra_config=hydra_node)


# ----------------------------------------------------------------------------------- (a) everything instantiates


def test_every_policy_yaml_instantiates(tiny_pair):
    """Each conf/policy/<name>.yaml builds its class by instantiate, given what the class's capabilities ask for; the
    class's name is the file's (the name a summary shows)."""
    from tests.test_decode import make_head
    from tests.test_policies import ev_profile

    names = known_policies()
    assert {"constant", "svip", "adaedl", "learned", "sprinter", "oracle", "hf_assisted"} <= set(names)
    for name in names:
        yaml = policy_config(name)
        cls = policy_class(name)
        extra = {}
        if cls.external:
            extra["pair"] = tiny_pair
        if cls.learned:
            extra["bundle"] = make_head(tiny_pair, "sprinter" if cls.approximate else "tree_node" if cls.tree else "disco")
        if cls.wants_profile({k: v for k, v in yaml.items() if k != "_target_"}, extra.get("bundle")):
            extra["profile"] = ev_profile()
        yaml.pop("ckpt", None)  # a head's checkpoint path: decode loads the bundle from it (build_policy)
        pol = instantiate(yaml, _partial_=True, _convert_="all")(**extra)
        assert isinstance(pol, cls) and isinstance(pol, StopPolicy) and pol.name == name, name
        assert pol.describe()["name"] == name


def test_capabilities_are_declared_on_the_classes():
    """What a policy is comes from its class, never from a list of names here: the flags are booleans, the ones that
    imply others agree, a tree policy is a tree builder, and the flags decide what building it asks for."""
    from decode.tree_builders import TreeBuilder

    flags = ("needs_probs", "needs_hidden", "needs_context", "needs_verify_stats", "greedy_only", "approximate",
             "oracle", "needs_profile", "learned", "external", "tree")
    caps = {n: policy_class(n) for n in known_policies()}
    for name, cls in caps.items():
        assert all(isinstance(getattr(cls, f), bool) for f in flags), name
        assert cls.tree == issubclass(cls, TreeBuilder), name
        assert not cls.approximate or cls.learned, name  # SPRINTER's verifier is a head
        assert not cls.oracle or cls.greedy_only, name  # the oracle reads the greedy target output
        assert not (cls.external and cls.tree), name
        assert cls.trace_score in (None, "max_q", "neg_entropy"), name
        params = {k: v for k, v in policy_config(name).items() if k != "_target_"}
        if cls.learned:  # a head policy without a checkpoint is one line naming the fix
            with pytest.raises(UserError, match=f"policy '{name}' needs a head"):
                build_policy(name, params)
        elif cls.wants_profile(params):  # a profile-reading rule built with no profile and no pair: one line
            with pytest.raises(UserError, match="cost profile"):
                build_policy(name, params)
    # each capability is carried by at least one shipped policy, so every branch above ran on something
    assert all(any(getattr(c, f) for c in caps.values()) for f in ("learned", "external", "oracle", "tree",
                                                                    "approximate", "needs_profile"))


def _spec_for(kind: str, cfg: dict) -> FeatureSpec:
    features = head_family(kind).features
    if features == "hidden":
        return FeatureSpec("hidden", d=8)
    if features == "disco_plus":
        return FeatureSpec("disco_plus", k=int(cfg.get("k", 10)), groups=[g for g in cfg["groups"] if g != "text"])
    return FeatureSpec(features, k=int(cfg.get("k", 10)))


def test_every_head_family_yaml_instantiates():
    """conf/model/<kind>.yaml: its `arch` node (with `_target_`) builds the family's network by instantiate, and the
    head built from it reads its feature kind's rows."""
    kinds = head_kinds()
    assert kinds == ["c2t", "disco", "disco_plus", "specdecpp", "sprinter", "tree_node", "tree_node_plus"]
    for kind in kinds:
        cfg = discover.load("model", kind)
        assert cfg["kind"] == kind  # the family's name is its file's
        family = head_family(kind)
        spec = _spec_for(kind, cfg)
        net = instantiate(family.arch_for(spec, cfg["arch"]), in_dim=spec.dim, _convert_="all")
        assert type(net) is family and family.features in feature_kinds()
        head = build_head(kind, spec, cfg["arch"])
        assert type(head.net) is family and head(torch.rand(3, spec.dim)).shape == (3,)
    with pytest.raises(UserError, match="unknown head kind 'nope'; known: c2t, disco, disco_plus, specdecpp, "
                       "sprinter, tree_node, tree_node_plus"):
        head_family("nope")


def synthetic_columns(n: int = 6, k: int = 10, d: int = 8) -> dict:
    """Trace columns of one continuation of n rows (every column a feature kind may read)."""
    rng = np.random.default_rng(0)
    topk = np.sort(rng.random((n, k)), axis=1)[:, ::-1]
    return {"draft_topk": topk / topk.sum(1, keepdims=True), "draft_entropy": rng.random(n),
            "draft_token": np.array([5, 6, 7, 5, 6, 8]), "target_token": np.array([5, 6, 9, 5, 6, 8]),
            "position": np.arange(n), "prompt_id": np.array(["p"] * n), "kind": np.array(["target_ar"] * n),
            "draft_hidden": rng.random((n, d)).astype(np.float32), "target_entropy": rng.random(n),
            "target_margin": rng.random(n), "tvd": rng.random(n), "context_token": np.array([5, 6, 9, 5, 6, 8]),
            "prompt_tokens": np.array([np.array([1, 2, 5, 6])] + [np.array([], dtype=np.int64)] * (n - 1),
                                      dtype=object),
            # one token tree of n nodes (tree-trace columns, read by the node kinds)
            "node": np.arange(n), "parent": np.array([-1, -1, 0, 0, 2, 3]), "depth": np.array([1, 1, 2, 2, 3, 3]),
            "rank": np.array([1, 2, 1, 2, 1, 1]), "q_token": rng.random(n), "joint": rng.random(n),
            "root_target_entropy": np.full(n, 0.5), "root_target_margin": np.full(n, 0.2), "copy_len": rng.random(n),
            "lookup_hit": rng.random(n), "lookup_len": rng.random(n)}


def test_every_feature_kind_declares_its_columns():
    """Each FeatureKind builds rows of its declared width from exactly the trace columns it declares, and its
    decode-time row builder gives a row of the same width."""
    cols = synthetic_columns()
    specs = {"disco": FeatureSpec("disco"), "hidden": FeatureSpec("hidden", d=8),
             "disco_plus": FeatureSpec("disco_plus", d=8, groups=["verify", "copy", "token", "hidden"]),
             "c2t": FeatureSpec("c2t"), "tree_node": FeatureSpec("tree_node"),
             "tree_node_plus": FeatureSpec("tree_node_plus")}
    assert set(feature_kinds()) == set(specs)
    for name, cls in feature_kinds().items():
        kind, spec = cls(), specs[name]
        assert spec.family.name == name and len(kind.names(spec)) == spec.dim
        src = dict(cols, position=np.zeros(len(cols["position"]), np.int32)) if kind.tree else cols  # one tree: one position
        x = kind.from_columns({c: src[c] for c in kind.columns(spec)}, spec)  # nothing beyond its columns
        assert x.shape == (len(cols["position"]), spec.dim), name
        if kind.tree:  # node kinds score tree nodes (tests/test_features_nodes.py: node_rows); no chain-round decoder
            with pytest.raises(UserError, match="token-tree nodes"):
                kind.decoder(spec)
            continue
        step = DraftStep(probs=torch.softmax(torch.rand(20), -1), token=5, hidden=torch.rand(8), position_in_round=0,
                         position=0, context=[1, 2] if spec.needs_context else None)
        rows = kind.decoder(spec)
        rows.reset()
        assert rows.row(step).shape == (spec.dim,), name
    assert [specs[n].reads_probs for n in ("disco", "hidden", "disco_plus")] == [True, False, True]
    assert [specs[n].reads_hidden for n in ("disco", "hidden", "disco_plus")] == [False, True, True]
    assert specs["disco_plus"].needs_context and specs["disco_plus"].needs_verify and not specs["disco"].needs_context
    with pytest.raises(ValueError, match="unknown feature kind 'nope'"):
        FeatureSpec("nope").dim


# ------------------------------------------------------------------------ (b) a policy from the user's conf dir


def test_policy_overrides_need_no_defaults_line():
    """decode.yaml lists no policy; the CLI turns policy.<name>.<param>=V into Hydra's ++ form (the key is added)."""
    assert "policy@" not in (REPO / "conf" / "decode.yaml").read_text()
    assert open_overrides(["-m", "policy.svip.h=0.2,0.3", "+policy.x.y=1", "~policy.z", "limit=3", "policy_ckpt=a"],
                          ("policy",)) == ["-m", "++policy.svip.h=0.2,0.3", "+policy.x.y=1", "~policy.z", "limit=3",
                                           "policy_ckpt=a"]
    from decode.methods import methods_from_cfg

    cfg = cfg_of("decode", "policies=[svip,constant]", "++policy.svip.h=0.2")
    params = {m.key: m.params for m in methods_from_cfg(cfg)}
    assert params == {"svip": {"c": 0.15, "h": 0.2, "max_len": 40}, "constant": {"k": 5}}


def test_user_policy_decodes_by_name(conf_dir, tmp_path, tiny_pair):
    """A class defined here + conf_dir/policy/floored.yaml: `python -m decode hydra.searchpath=[file://DIR]
    policies=[...,floored]` finds it by name, merges policy.floored.* over its yaml and decodes it (greedy:
    lossless)."""
    from decode.runner import main as decode

    with pytest.raises(UserError, match="unknown policy 'floored'"):
        parse_spec("floored")  # not on the default search path
    out = tmp_path / "dec"
    cfg = cfg_of("decode", "pair=tiny_random", "dataset=mbpp", "split=test", "limit=2", "max_new_tokens=12",
                 "plots=false", "warmup=false", f"hydra.searchpath=[file://{conf_dir}]", "policies=[constant,floored]",
                 "++policy.floored.floor=0.2", f"out_dir={out}", hydra_node=True)
    decode(cfg)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["floored"]["params"] == {"name": "floored", "max_len": 6, "floor": 0.2, "min_len": 2}
    assert summary["floored"]["lossless"] is True and summary["floored"]["oracle"] is False
    rows = [r for r in read_jsonl(out / "prompts.jsonl") if r["method"] == "floored"]
    for r in rows:  # min_len and max_len hold wherever the token budget (12) leaves room for them
        done = 0
        for k, n in r["rounds"]:
            cap = min(6, 12 - done - 1)
            assert min(2, cap) <= k <= cap, r["rounds"]
            done += n + 1


@pytest.fixture(scope="module")
def traces(tmp_path_factory, tiny_pair):
    from data_gen.run import generate

    root = tmp_path_factory.mktemp("registry_traces")
    return {split: generate(cfg_of("data_gen", "pair=tiny_random", "dataset=mbpp", f"trace_root={root}",
                                   "progress=false", f"trace.max_new_tokens={NEW}", f"split={split}",
                                   f"limit={N_PROMPTS}"), split, tiny_pair)
            for split in ("validation", "test")}


def test_user_policy_is_replayed_and_tuned(conf_dir, traces, tmp_path):
    """The replay finds the same policy by name, tunes its grid, reports the AUROC of its declared `trace_score`, and
    the bar tells it apart from heads and the oracle by its class."""
    from eval.bar import is_learned, is_training_free
    from eval.replay import run

    res = run(cfg_of("replay", "+experiment=study/disco_mbpp", "pair=tiny_random",
                     f"replay.tune={traces['validation']}", f"replay.eval={traces['test']}",
                     "policies=[constant,floored,hf_assisted]",
                     f"hydra.searchpath=[file://{conf_dir}]", "+tune.grid.floored.floor=[0.2,0.6]", "replay.c=0.3",
                     "replay.synthetic_auroc=[]", f"replay.out_dir={tmp_path / 'r'}", hydra_node=True))
    assert set(res["eval"]) == {"constant", "floored"} and res["chosen"]["floored"]["floor"] in (0.2, 0.6)
    assert res["skipped"] == {"hf_assisted": "runs transformers' own loop"}  # external: read off the class
    assert 0.0 <= res["eval"]["floored"]["score_auroc"] <= 1.0 and res["eval"]["constant"]["score_auroc"] is None
    assert json.loads((tmp_path / "r" / "tuned.json").read_text())["chosen"]["floored"]["min_len"] == 2
    assert is_learned("learned:disco_mbpp") and is_learned("sprinter[threshold=0.5]") and not is_learned("svip")
    assert is_training_free("svip[h=0.3]") and not is_training_free("oracle")
    assert not is_training_free("synthetic[auroc=0.9]") and not is_training_free("learned")


# ---------------------------------------------------------------------------------------- (c) a broken policy yaml


@pytest.mark.parametrize("name, message", [
    ("no_target", "names no class: give it `_target_: package.module.Class` (a decode.policies.StopPolicy)"),
    ("not_a_policy", ": `_target_: collections.OrderedDict` is not a decode.policies.StopPolicy"),
    ("not_importable", ": cannot import `_target_: nowhere_at_all.Policy` (ModuleNotFoundError: No module named "
                       "'nowhere_at_all')"),
])
def test_broken_policy_yaml_is_one_user_error(conf_dir, name, message):
    from decode.methods import methods_from_cfg

    cfg = cfg_of("decode", f"hydra.searchpath=[file://{conf_dir}]", f"policies=[{name}]", hydra_node=True)
    with pytest.raises(UserError) as err:
        methods_from_cfg(cfg)
    where = conf_dir / "policy" / f"{name}.yaml"
    assert str(err.value) == f"policy '{name}' ({where}){'' if message.startswith(':') else ' '}{message}"


def test_broken_policy_yaml_cli_one_line(cli, conf_dir, tmp_path):
    r = cli("decode", f"hydra.searchpath=[file://{conf_dir}]", "policies=[not_a_policy]", f"out_dir={tmp_path / 'x'}")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert lines == [f"error: policy 'not_a_policy' ({conf_dir / 'policy' / 'not_a_policy.yaml'}): `_target_: "
                     "collections.OrderedDict` is not a decode.policies.StopPolicy"], r.stderr


def test_the_search_path_follows_the_running_hydra_config(tmp_path):
    """`discover.search_path()` reads the job's config sources once per Hydra config (decode asks per tree level),
    and follows a new config: a folder added by hydra.searchpath appears, and goes when the config goes."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.instance()
    saved = hc.cfg
    try:
        for extra, expect in ((f"hydra.searchpath=[file://{tmp_path}]", True), (None, False)):
            with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
                cfg = compose("decode", overrides=[extra] if extra else [], return_hydra_config=True)
            hc.set_config(cfg)
            first = discover.search_path()
            assert (tmp_path in first) is expect and discover.search_path() == first
    finally:
        hc.cfg = saved
