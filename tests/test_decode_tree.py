"""decode.tree, decode.tree_builders and decode.learned_trees (token trees, issue 30): the walks' acceptance rules, the builders' shapes, and the loop's losslessness."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from decode.tree import greedy_walk, sample_walk
from models.cost import CostProfile
from models.tree import Tree


def _profile(slope: float = 0.0, c: float = 0.05, measured: int = 64) -> CostProfile:
    """A cost profile with a flat verification pass (a GPU's t(n)) or one that climbs with n: t(n) = 1 + slope·(n − 1)
    target steps, a draft call c of them (no colder first call)."""
    return CostProfile(key={}, draft_ms=[c], target_ms=[1.0 + slope * i for i in range(measured)], prefill_lengths=[1],
                       prefill_target_ms=[1.0], prefill_draft_ms=[c], context=1, repeats=1)


def _tree() -> Tree:
    """Root children a=1 (rank 1), b=2 (rank 2); under a: c=3."""
    t = Tree(root_q=torch.tensor([0.1, 0.5, 0.3, 0.05, 0.05]))
    a = t.add(-1, 1, 0.5, 1)
    t.add(-1, 2, 0.3, 2)
    t.add(a, 3, 0.6, 1)
    return t


def test_greedy_walk_follows_the_targets_argmax_through_any_branch():
    t = _tree()
    assert greedy_walk(t, [0, 1, 2], {-1: 1, 0: 3, 1: 0, 2: 4}) == ([0, 2], 4)
    assert greedy_walk(t, [0, 1, 2], {-1: 2, 0: 3, 1: 0, 2: 4}) == ([1], 0)  # the second branch
    assert greedy_walk(t, [0, 1], {-1: 1, 0: 3, 1: 0}) == ([0], 3)  # node 2 not selected: the target's token
    assert greedy_walk(t, [0, 1, 2], {-1: 4, 0: 3, 1: 0, 2: 4}) == ([], 4)


def test_sample_walk_emits_the_targets_distribution():
    """SpecInfer's multi-step speculative sampling over point-mass children: the first token follows p(root) and,
    after an accepted child, the next follows p(child) — χ² over 20k walks."""
    t = _tree()
    p = {-1: torch.tensor([0.2, 0.1, 0.4, 0.2, 0.1]), 0: torch.tensor([0.05, 0.05, 0.1, 0.3, 0.5]),
         1: torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1]), 2: torch.tensor([0.25, 0.25, 0.25, 0.125, 0.125])}
    gen = torch.Generator().manual_seed(0)
    first, after_a, n = Counter(), Counter(), 20_000
    for _ in range(n):
        path, nxt = sample_walk(t, [0, 1, 2], p, gen)
        emitted = [t.tokens[i] for i in path] + [nxt]
        first[emitted[0]] += 1
        if path and path[0] == 0:
            after_a[emitted[1]] += 1
    for counts, dist in ((first, p[-1]), (after_a, p[0])):
        obs = [counts[i] for i in range(5)]
        exp = (dist.double() * sum(obs)).tolist()
        assert chisquare(obs, exp).pvalue > 1e-3, (obs, exp)


def test_builders_degenerate_to_a_chain_where_branching_does_not_pay():
    from decode.tree_builders import Eagle2, TreeStatic

    steep = TreeStatic(branching=[2, 2, 1, 1], rank_probs=[0.6, 0.1], profile=_profile(slope=0.5))
    flat = TreeStatic(branching=[2, 2, 1, 1], rank_probs=[0.6, 0.1], profile=_profile(slope=0.0))
    assert steep.max_depth < flat.max_depth == 4
    t = Tree(root_q=torch.tensor([0.05, 0.6, 0.3, 0.05]))
    eagle = Eagle2(topk=2, max_depth=3, profile=_profile(slope=0.0))
    kids = eagle.children(t, -1, 1)
    assert [k[0] for k in kids] == [1, 2] and [k[2] for k in kids] == [1, 2]
    for tok, prob, rank in kids:
        t.add(-1, tok, prob, rank)
    assert sorted(eagle.select(t)) == [0, 1]  # a flat pass: both pay
    costly = Eagle2(topk=2, max_depth=3, profile=_profile(slope=2.0))
    assert costly.select(t) == [] or costly.select(t) == [0]
    from decode.tree_builders import Sequoia

    chain_like = Sequoia(rank_probs=[0.8, 0.05], max_nodes=12, max_depth=8, profile=_profile(slope=0.3))
    assert all(r == 1 for r in chain_like.shape.ranks)  # a steep t(n) and a weak second rank: a chain
    bushy = Sequoia(rank_probs=[0.4, 0.3, 0.2], max_nodes=12, max_depth=8, profile=_profile(slope=0.0))
    assert max(bushy.shape.ranks) > 1 and len(bushy.shape.parents) == 12


def test_wide_level_calls_cost_what_the_profile_says():
    """A level's draft call is priced by its size: where a call on many nodes costs more than on one, the
    expected-value rule expands fewer of the offered nodes, and Sequoia's best shape has fewer nodes with children;
    run_levels counts a static shape's draft calls after the root's."""
    from decode.tree_builders import Eagle2, Sequoia
    from models.tree_dp import run_levels

    assert run_levels([-1, -1, 0, 0, 2, 1]) == [2, 1]  # depth 1: nodes 0 and 1 have children; depth 2: node 2
    assert run_levels([-1]) == [] and run_levels([]) == []
    flat, dear = _profile(slope=0.05, c=0.05), _profile(slope=0.05, c=0.05)
    flat.draft_level_ms = [0.05] * 8
    dear.draft_level_ms = [0.05 + 0.05 * i for i in range(8)]  # each node of a level adds a draft step
    offers = [(0.3, 1), (0.2, 1), (0.1, 1), (0.08, 1), (0.06, 1), (0.04, 1)]  # best first
    assert Eagle2(profile=flat).best_prefix(1.5, [1], 2, offers) == 4
    assert Eagle2(profile=dear).best_prefix(1.5, [1], 2, offers) == 2
    ranks = [0.6, 0.2, 0.1]
    wide = Sequoia(rank_probs=ranks, max_nodes=12, max_depth=4, profile=flat).shape
    narrow = Sequoia(rank_probs=ranks, max_nodes=12, max_depth=4, profile=dear).shape
    assert run_levels(wide.parents) == [2, 1] and run_levels(narrow.parents) == [1, 1]


@pytest.mark.parametrize("forward", ["hf", "lean"])
@pytest.mark.parametrize("policy", ["tree_static", "sequoia", "eagle2"])
def test_tree_decoding_is_target_greedy(tiny_cfg, forward, policy):
    """Greedy tree decoding emits exactly target-only greedy (float32), with trees that really branch."""
    from omegaconf import OmegaConf

    from decode.tree_builders import Eagle2, Sequoia, TreeStatic
    from models.pair import load_pair

    cfg = OmegaConf.merge(tiny_cfg, {"forward": forward})
    pair = load_pair(cfg)
    prof = _profile(slope=0.0)
    builder = {"tree_static": lambda: TreeStatic(branching=[3, 2, 1], rank_probs=[0.5, 0.3, 0.2], profile=prof),
               "sequoia": lambda: Sequoia(rank_probs=[0.5, 0.3, 0.2], max_nodes=10, max_depth=4, profile=prof),
               "eagle2": lambda: Eagle2(topk=3, max_depth=3, max_nodes=12, profile=prof)}[policy]()
    assert_branching_lossless(pair, builder)


def assert_branching_lossless(pair, builder, label: str = "") -> None:
    """`builder` decodes exactly target-only greedy on three prompts, and some round verifies more nodes than a
    chain of that depth would (the trees really branch)."""
    from decode.loop import autoregressive, speculative

    widest = 0
    for text in ("def f(x):", "import os\nclass A:", "hello world"):
        ids = pair.tokenizer.encode(text)
        res = speculative(pair, ids, builder, 24)
        assert res.tokens == autoregressive(pair, ids, 24).tokens, f"{builder.name} {label} on {text!r}"
        widest = max(widest, max(k for k, _ in res.rounds))
    assert widest > 3, f"{builder.name} {label}: no round verified more than 3 nodes"


def test_tree_sampling_first_tokens_match_target_sampling(tiny_cfg):
    """Exact sampling with a tree on a model: the first emitted token's law equals target-only sampling's (χ²
    two-sample test; the walk's deeper steps are checked on a synthetic tree above)."""
    from omegaconf import OmegaConf

    from decode.loop import autoregressive, speculative
    from decode.tree_builders import Eagle2
    from models.pair import load_pair

    pair = load_pair(OmegaConf.merge(tiny_cfg, {"forward": "lean"}))
    ids = pair.tokenizer.encode("def f(x):")
    builder = Eagle2(topk=3, max_depth=2, max_nodes=8, profile=_profile(slope=0.0))
    n = 600
    ours, ref = Counter(), Counter()
    for i in range(n):
        g1, g2 = torch.Generator().manual_seed(i), torch.Generator().manual_seed(10_000 + i)
        ours[tuple(speculative(pair, ids, builder, 2, temperature=1.0, generator=g1).tokens[:1])] += 1
        ref[tuple(autoregressive(pair, ids, 1, temperature=1.0, generator=g2).tokens[:1])] += 1
    from scipy.stats import chi2_contingency

    keys = sorted(set(ours) | set(ref))
    table = [[ours[k] for k in keys], [ref[k] for k in keys]]
    table = [[a for a, b in zip(*table) if a + b >= 5], [b for a, b in zip(*table) if a + b >= 5]]
    assert chi2_contingency(table).pvalue > 1e-3


def _decode_rounds(pair, builder, texts=("def f(x):", "import os\nclass A:", "hello world"), n=24):
    from decode.loop import speculative

    out = []
    for text in texts:
        res = speculative(pair, pair.tokenizer.encode(text), builder, n)
        out.append((res.tokens, res.rounds, res.draft_calls))
    return out


@pytest.fixture(scope="module")
def close_tiny(tiny_cfg):
    """The tiny target with a 3-of-4-layer draft: confident enough that rounds run several tokens deep."""
    from omegaconf import OmegaConf

    from models.pair import load_pair

    return load_pair(OmegaConf.merge(tiny_cfg, {"draft": {"layers": [0, 1, 2]}, "forward": "lean"}))


def test_sequoia_with_a_chain_shape_is_the_expected_value_chain(close_tiny):
    """Where the profile makes Sequoia's shape a chain, its level-by-level expected-value cut drafts exactly what
    `expected_value` (a=1, b=0) drafts: same tokens, same (drafted, accepted) rounds and draft calls (but for the
    last round, where no token is left to draft: a chain then skips its draft call, a tree round still makes it)."""
    from decode.expected_value import ExpectedValue
    from decode.tree_builders import Sequoia

    prof = _profile(slope=0.004, c=0.002)
    seq = Sequoia(rank_probs=[0.9, 0.001], max_nodes=8, max_depth=6, spine_depth=12, profile=prof)
    assert all(r == 1 for r in seq.shape.ranks)
    ev = ExpectedValue(score="max_q", a=1.0, b=0.0, max_len=12, profile=prof)
    ours, theirs = _decode_rounds(close_tiny, seq), _decode_rounds(close_tiny, ev)
    assert [(t, r) for t, r, _ in ours] == [(t, r) for t, r, _ in theirs]
    assert all(c - d in (0, 1) for (_, _, c), (_, _, d) in zip(ours, theirs))
    assert max(k for _, rounds, _ in ours for k, _ in rounds) > 2  # rounds deeper than the cut's first level


def test_dear_draft_calls_cut_the_trees_levels(close_tiny):
    """A level is drafted only while it pays on the profile: with a dear draft call eagle2 and sequoia draft fewer
    levels per round than with a cheap one (and sequoia's spine past its shape is used when calls are cheap)."""
    from decode.tree_builders import Eagle2, Sequoia

    def calls_per_round(builder):
        runs = _decode_rounds(close_tiny, builder)
        return sum(c for _, _, c in runs) / sum(len(r) for _, r, _ in runs)

    for make in (lambda p: Eagle2(topk=3, max_depth=5, max_nodes=12, profile=p),
                 lambda p: Sequoia(rank_probs=[0.5, 0.3, 0.2], max_nodes=8, max_depth=3, spine_depth=6, profile=p)):
        cheap, dear = calls_per_round(make(_profile(c=0.001))), calls_per_round(make(_profile(c=0.6)))
        assert dear < cheap
        assert dear >= 1.0


def test_svip_decides_eagle2s_depth_every_two_levels(close_tiny):
    """SVIP on EAGLE-2's tree (the SVIP paper's Table 4): with h so small that every distribution fails √(c·H) ≤ h
    the tree stops growing at level 2 (checked every two levels), with h so large that none does it grows as
    eagle2; both stay target-greedy."""
    from decode.tree_builders import Eagle2

    def rounds(svip):
        return _decode_rounds(close_tiny, Eagle2(topk=3, max_depth=6, nodes=8, svip=svip, profile=_profile()))

    plain, never, always = rounds(None), rounds({"h": 100.0}), rounds({"h": 1e-6, "every": 2})
    assert [t for t, _, _ in never] == [t for t, _, _ in plain] == [t for t, _, _ in always]
    assert never == plain
    calls = [c / len(r) for _, r, c in always]
    assert max(calls) <= 2 + 1e-9 < max(c / len(r) for _, r, c in plain)  # the root call and one level past it


@pytest.mark.parametrize("name,kind", [("learned_tree", "tree_node"), ("c2t", "tree_node"),
                                       ("learned_tree", "tree_node_plus")])
def test_learned_builders_are_target_greedy_and_refuse_chain_heads(close_tiny, name, kind):
    """The node-head builders decode exactly target-only greedy (float32) with trees that branch, score each node
    once, and refuse a chain head in one line; a tree_node_plus head (copy and verify node groups) makes the loop
    hand each round's tree its context and the last verification's numbers."""
    from decode.loop import autoregressive, speculative
    from decode.learned_trees import C2T, LearnedTree
    from tests.test_decode import make_head
    from utils.cli import UserError

    cls = LearnedTree if name == "learned_tree" else C2T
    bundle = make_head(close_tiny, kind, seed=2)
    bundle.calibration = {"temperature": 0.3, "bias": 2.0, "mode": "platt"}  # a confident random head: trees grow
    extra = {"threshold": 0.2} if name == "c2t" else {}
    builder = cls(bundle=bundle, topk=3, max_depth=4, max_nodes=12, profile=_profile(c=0.01), **extra)
    assert builder.needs_context == builder.needs_verify_stats == (kind == "tree_node_plus")
    widest = 0
    for text in ("def f(x):", "import os\nclass A:", "hello world"):
        ids = close_tiny.tokenizer.encode(text)
        res = speculative(close_tiny, ids, builder, 24)
        assert res.tokens == autoregressive(close_tiny, ids, 24).tokens
        widest = max(widest, max(k for k, _ in res.rounds))
    assert widest > 4  # more nodes than a chain of this depth
    with pytest.raises(UserError, match="needs a node head"):
        cls(bundle=make_head(close_tiny, "disco"), profile=_profile())


@pytest.mark.parametrize("support", [None, torch.arange(0, 400, 3)])
def test_node_columns_read_each_parent_once_and_match_the_one_extractor(support):
    """node_columns reads each parent's distribution once (Tree.stats, cached for the builders' children too): each
    node's top-k and entropy are DraftStep's for its own parent (the chain policies' extractor), its q_token that
    parent's probability of its token, for any subset of nodes asked for (a learned builder asks level by level);
    the children a builder adds (Tree.top) are the top-k of the full distribution, read on the support."""
    from models.features.signals import DraftStep
    from models.features.nodes import node_columns

    gen = torch.Generator().manual_seed(0)

    def dist():
        q = torch.rand(400, generator=gen) ** 8
        if support is not None:
            q[~torch.isin(torch.arange(400), support)] = 0.0
        return q / q.sum()

    t = Tree(root_q=dist(), support=support)
    for _ in range(3):
        t.add(-1, int(torch.randint(400, (1,), generator=gen)), 0.1, 1)
    for parent in (0, 1, 0):
        t.q[parent] = dist()
        t.add(parent, int(torch.randint(400, (1,), generator=gen)), 0.1, 2)
    t.q[4] = dist()
    t.add(4, 7, 0.1, 1)
    for nodes in (list(range(len(t))), [6, 3], [5]):
        cols = node_columns(t, nodes, 10)
        for j, i in enumerate(nodes):
            par = t.parents[i]
            one = DraftStep(probs=t.dist(par), token=t.tokens[i], hidden=None, position_in_round=0, position=0,
                            support=support)
            assert torch.equal(torch.from_numpy(cols["draft_topk"][j]), one.topk(10))
            assert cols["draft_entropy"][j] == pytest.approx(float(one.entropy), rel=1e-6)
            assert cols["q_token"][j] == np.float32(t.dist(par)[t.tokens[i]])
            assert cols["parent_q"][j] == (1.0 if par < 0 else np.float32(t.dist(t.parents[par])[t.tokens[par]]))
    for node in (-1, 0, 1, 4):
        v, i = t.dist(node).topk(4)
        assert [(tok, p) for tok, p, _ in t.top(node, 4)] == list(zip(i.tolist(), v.tolist()))
        assert [r for _, _, r in t.top(node, 4)] == [1, 2, 3, 4]
    cached = t._stats[0]
    t.top(0, 3), node_columns(t, [3], 10)
    assert t._stats[0] is cached  # computed once, read by children and rows
