"""models.lm token trees (issue 30): a tree call gives every node its root path's logits, in one call or grown level by
level over several; `keep` compacts an accepted path so decoding goes on as if only that path had run; without
positions/mask a call is today's chain call. Both forwards (lean, transformers'), the target, the tiny draft, an int8
draft, an FR-Spec reduced-vocabulary draft, the full-forward (non-plain) path and the pairs' other model families;
windowed attention is refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from omegaconf import OmegaConf

from models.lm import LM, tree_attention
from models.pair import load_pair

pytestmark = pytest.mark.usefixtures("one_thread")

PREFIX = list(range(3, 14))
# two roots; levels [0, 1], [2, 3, 4], [5, 6, 7] in node order (as a draft growing the tree level by level lays it out)
PARENTS = [-1, -1, 0, 0, 1, 2, 2, 4]
TOKENS = [20, 31, 42, 53, 64, 75, 86, 97]
# float32, torch's defaults: a tree call's attention groups its sums unlike a chain's (max difference seen 8e-6)
ATOL, RTOL = 1e-5, 1.3e-6


@pytest.fixture(scope="module")
def models(tiny_pair, tiny_cfg, tmp_path_factory):
    """name → (model, vocab): the target, the draft, an int8 copy of the draft, an FR-Spec draft."""
    from models.lm_head import quantize_linears

    int8 = copy.deepcopy(tiny_pair.draft)
    assert quantize_linears(int8, keep={id(p) for p in tiny_pair.target.parameters()}, only_where_fast=False) > 0
    freq = tmp_path_factory.mktemp("freq") / "freq.json"
    freq.write_text(json.dumps({"ids_by_frequency": list(range(3, 200))}))
    subset = load_pair(OmegaConf.merge(tiny_cfg, {"draft": {"vocab_subset": 40, "vocab_freq": str(freq)}}))
    v = tiny_pair.vocab_size
    return {"target": (tiny_pair.target, v), "draft": (tiny_pair.draft, v), "int8": (int8, v),
            "subset": (subset.draft, subset.vocab_size)}


CASES = [(name, lean) for name in ("target", "draft", "int8", "subset") for lean in (True, False)]


def make_lm(models, name: str, lean: bool) -> LM:
    lm = LM(*models[name], lean=lean)
    assert (lm.lean is not None) == lean
    return lm


def prefilled(lm: LM):
    cache = lm.new_cache()
    lm(PREFIX, cache, 0)
    return cache


def path(node: int) -> list[int]:
    """The root path ending at `node`, root first."""
    out = []
    while node >= 0:
        out.append(node)
        node = PARENTS[node]
    return out[::-1]


def keep_index(node: int) -> list[int]:
    return [*range(len(PREFIX)), *(len(PREFIX) + i for i in path(node))]


def chain_logits(lm: LM, node: int) -> torch.Tensor:
    """The node's logits from its root path run as a chain after a fresh prefix cache."""
    logits, _ = lm([TOKENS[a] for a in path(node)], prefilled(lm), 1)
    return logits[0]


def one_call(lm: LM) -> tuple[torch.Tensor, object]:
    """The whole tree in one call after the prefix cache: node i at cache position len(PREFIX) + i."""
    cache = prefilled(lm)
    positions, mask = tree_attention(PARENTS, range(len(PARENTS)), len(PREFIX), len(PREFIX))
    logits, hidden = lm(TOKENS, cache, len(TOKENS), positions, mask)
    assert hidden.shape[0] == len(TOKENS) and cache.get_seq_length() == len(PREFIX) + len(TOKENS)
    return logits, cache


def test_tree_attention_layout():
    p = len(PREFIX)
    positions, mask = tree_attention(PARENTS, range(8), p, p)
    assert positions.tolist() == [p, p, p + 1, p + 1, p + 1, p + 2, p + 2, p + 2]
    assert mask.shape == (8, p + 8) and mask[:, :p].all()
    assert [(row[p:].nonzero().flatten()).tolist() for row in mask] == [
        [0], [1], [0, 2], [0, 3], [1, 4], [0, 2, 5], [0, 2, 6], [1, 4, 7]]
    # the last level, its ancestors cached by earlier calls (anywhere in the cache)
    cached = {0: p + 3, 1: p + 1, 2: p, 4: p + 2}
    positions, mask = tree_attention(PARENTS, [5, 7], p, p + 4, cached)
    assert positions.tolist() == [p + 2, p + 2] and mask.shape == (2, p + 6)
    assert [row[p:].nonzero().flatten().tolist() for row in mask] == [[0, 3, 4], [1, 2, 5]]
    # a target's call: two pending prefix tokens (causal), then nodes 1 and 4
    positions, mask = tree_attention(PARENTS, [1, 4], p, p - 2)
    assert positions.tolist() == [p - 2, p - 1, p, p + 1]
    assert mask.tolist() == [[True] * (p - 1) + [False] * 3, [True] * p + [False] * 2,
                             [True] * p + [True, False], [True] * p + [True, True]]
    with pytest.raises(ValueError, match="ancestor 2 is neither cached nor in the call"):
        tree_attention(PARENTS, [5], p, p, {0: p})
    with pytest.raises(ValueError, match="parent 3 is not -1 or an earlier node"):
        tree_attention([-1, 3, 1, 0], [2], 0, 0, {1: 0, 3: 1})
    with pytest.raises(ValueError, match="pending prefix tokens run before"):
        tree_attention(PARENTS, [2], p, p - 1, {0: p})


@pytest.mark.parametrize("name,lean", CASES)
def test_tree_call_gives_each_root_paths_logits(models, name, lean):
    """(a) one call over the whole tree = each node's root path run as a chain."""
    lm = make_lm(models, name, lean)
    with torch.inference_mode():
        logits, _ = one_call(lm)
        for j in range(len(PARENTS)):
            torch.testing.assert_close(logits[j], chain_logits(lm, j), atol=ATOL, rtol=RTOL)


LEVELS = [[0, 1], [2, 3, 4], [5], [6, 7]]  # level by level, one call of one row included
FRONTIERS = [[1], [4], [7], [0], [2, 3], [5, 6]]  # cache positions unlike node ids


def grown(lm: LM, calls: list[list[int]]) -> tuple[dict, object, dict]:
    """The tree run over several calls after the prefix cache, each call's ancestors cached by earlier ones: node →
    logits, the cache, node → cache position."""
    cache, cached, got = prefilled(lm), {}, {}
    for nodes in calls:
        start = cache.get_seq_length()
        positions, mask = tree_attention(PARENTS, nodes, len(PREFIX), start, cached)
        logits, _ = lm([TOKENS[i] for i in nodes], cache, len(nodes), positions, mask)
        got.update({node: logits[j] for j, node in enumerate(nodes)})
        cached.update({node: start + j for j, node in enumerate(nodes)})
    return got, cache, cached


@pytest.mark.parametrize("name,lean", CASES)
def test_tree_grown_over_several_calls_gives_the_same_logits(models, name, lean):
    """(b) the tree run over several calls whose ancestors are cached nodes = one call."""
    lm = make_lm(models, name, lean)
    with torch.inference_mode():
        want, _ = one_call(lm)
        for calls in (LEVELS, FRONTIERS):
            got, _, _ = grown(lm, calls)
            torch.testing.assert_close(torch.stack([got[i] for i in range(len(PARENTS))]), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name,lean", CASES)
def test_pending_prefix_tokens_then_the_tree(models, name, lean):
    """A target's verification: the last committed tokens (not yet cached) and the tree in one call = the prefix's
    chain logits for those rows, the one-call tree's for the nodes."""
    lm = make_lm(models, name, lean)
    with torch.inference_mode():
        want_tree, _ = one_call(lm)
        want_prefix, _ = lm(PREFIX, lm.new_cache(), 3)
        cache = lm.new_cache()
        lm(PREFIX[:-3], cache, 0)
        positions, mask = tree_attention(PARENTS, range(len(PARENTS)), len(PREFIX), len(PREFIX) - 3)
        got, _ = lm(PREFIX[-3:] + TOKENS, cache, 3 + len(TOKENS), positions, mask)
        torch.testing.assert_close(got[:3], want_prefix, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(got[3:], want_tree, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name,lean", CASES)
def test_keep_a_path_then_decode(models, name, lean):
    """(c) after keeping the prefix and one root path — off the first branch (entries move), a prefix range (a crop),
    none; in the one-call layout and in the frontier one — the next call's logits are those of a cache that ran only
    that path."""
    lm = make_lm(models, name, lean)
    with torch.inference_mode():
        for layout, node in [("one", 7), ("one", 3), ("one", 0), ("one", -1), ("frontiers", 6), ("frontiers", 7)]:
            if layout == "one":
                (_, cache), where = one_call(lm), {i: len(PREFIX) + i for i in range(len(PARENTS))}
            else:
                _, cache, where = grown(lm, FRONTIERS)
            lm.keep(cache, [*range(len(PREFIX)), *(where[i] for i in path(node))])
            assert cache.get_seq_length() == len(PREFIX) + len(path(node))
            got, _ = lm([50, 51], cache, 2)
            want, _ = lm([TOKENS[a] for a in path(node)] + [50, 51], prefilled(lm), 2)
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_keep_refuses_bad_positions(models):
    lm = make_lm(models, "target", True)
    with torch.inference_mode():
        cache = prefilled(lm)
        with pytest.raises(ValueError, match="outside the cache's 11"):
            lm.keep(cache, [0, 11])
        with pytest.raises(ValueError, match="sorted and distinct"):
            lm.keep(cache, [0, 1, 5, 4])
        with pytest.raises(ValueError, match="needs positions \\(2,\\) and a bool mask \\(2, 13\\)"):
            lm([5, 6], cache, 1, torch.tensor([11, 12]), torch.ones(2, 12, dtype=torch.bool))
        with pytest.raises(ValueError, match="both positions and mask"):
            lm([5], cache, 1, positions=torch.tensor([11]))


@pytest.mark.parametrize("name,lean", CASES)
def test_no_tree_arguments_is_todays_call(models, name, lean):
    """(d) positions=None, mask=None: the chain call bit for bit, over a prefill, rows and a crop."""
    lm = make_lm(models, name, lean)
    with torch.inference_mode():
        a, b = lm.new_cache(), lm.new_cache()
        for ids in (PREFIX, [20], [21, 22, 23], "crop", [24]):
            if ids == "crop":
                a.crop(-2)
                b.crop(-2)
                continue
            la, ha = lm(ids, a, len(ids))
            lb, hb = lm(ids, b, len(ids), positions=None, mask=None)
            assert torch.equal(la, lb) and torch.equal(ha, hb)


@pytest.mark.parametrize("lean", [True, False])
def test_a_chain_shaped_tree_is_the_chain_call_bit_for_bit(models, lean):
    """A tree that is one chain gives the causal mask and positions the chain call builds itself: the same bits."""
    lm = make_lm(models, "target", lean)
    with torch.inference_mode():
        chain, tree = prefilled(lm), prefilled(lm)
        want, _ = lm(TOKENS[:4], chain, 4)
        positions, mask = tree_attention([-1, 0, 1, 2], range(4), len(PREFIX), len(PREFIX))
        got, _ = lm(TOKENS[:4], tree, 4, positions, mask)
        assert torch.equal(got, want)


@pytest.mark.parametrize("name,dtype", [("target", "float32"), ("int8", "float32"), ("target", "bfloat16")])
def test_lean_tree_calls_are_transformers_bits(models, tiny_cfg, name, dtype):
    """The lean forward's tree calls give transformers' logits bit for bit, in bf16 too: several rows (grouped heads
    with the mask, as its causal rows), and one row, which packs its query heads as transformers packs a masked row."""
    if dtype != "float32":
        pair = load_pair(OmegaConf.merge(tiny_cfg, {"dtype": dtype}))
        models = {name: (pair.target, pair.vocab_size)}
    lean, hf = make_lm(models, name, True), make_lm(models, name, False)
    with torch.inference_mode():
        assert torch.equal(one_call(lean)[0], one_call(hf)[0])
        for calls in (LEVELS, FRONTIERS):
            a, b = grown(lean, calls)[0], grown(hf, calls)[0]
            assert all(torch.equal(a[i], b[i]) for i in a), calls


def test_full_forward_path_takes_tree_calls(models):
    """Models that post-process logits run the full forward (LM.plain False); tree calls and keep work there too.
    A Llama marked with a logit scale it never applies stands in for one."""
    model = models["target"][0]
    model.config.logit_scale = 1.0
    try:
        lm = LM(model, models["target"][1])
        assert not lm.plain
        with torch.inference_mode():
            logits, cache = one_call(lm)
            for j in (0, 4, 7):
                torch.testing.assert_close(logits[j], chain_logits(lm, j), atol=ATOL, rtol=RTOL)
            lm.keep(cache, keep_index(7))
            got, _ = lm([50], cache, 1)
            want, _ = lm([TOKENS[a] for a in path(7)] + [50], prefilled(lm), 1)
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    finally:
        del model.config.logit_scale


def tiny_family(family: str):
    """A 2-layer random model of another family (the hf path: DynamicCache, transformers' attention)."""
    import transformers as tf

    torch.manual_seed(0)
    small = {"vocab_size": 101}
    cfgs = {
        "gpt2": tf.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, **small),
        "gpt_bigcode": tf.GPTBigCodeConfig(n_embd=32, n_layer=2, n_head=2, n_positions=64, **small),
        "gpt_neox": tf.GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=64, **small),
        "qwen2": tf.Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=64, **small),
        # eager attention (GPT-Neo has no sdpa): the tree mask goes in additive
        "gpt_neo": tf.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global"], 2]],
                                   max_position_embeddings=64, **small),
        "gpt_neo_local": tf.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=64,
                                         attention_types=[[["global", "local"], 1]], **small),
    }
    return tf.AutoModelForCausalLM.from_config(cfgs[family]).eval()


@pytest.mark.parametrize("family", ["gpt2", "gpt_bigcode", "gpt_neox", "qwen2", "gpt_neo"])
def test_other_families_take_tree_calls_and_keep(family):
    """The transformers path of the pairs' other families (absolute or rotary positions, sdpa or eager): a node's
    logits are its root path's, grown over calls too, and keep then decodes as the path alone."""
    lm = LM(tiny_family(family), 101)
    assert lm.additive_mask == (family == "gpt_neo")
    with torch.inference_mode():
        want, _ = one_call(lm)
        for j in range(len(PARENTS)):
            torch.testing.assert_close(want[j], chain_logits(lm, j), atol=ATOL, rtol=RTOL)
        got, cache, where = grown(lm, FRONTIERS)
        torch.testing.assert_close(torch.stack([got[i] for i in range(len(PARENTS))]), want, atol=ATOL, rtol=RTOL)
        lm.keep(cache, [*range(len(PREFIX)), *(where[i] for i in path(6))])
        got, _ = lm([50], cache, 1)
        torch.testing.assert_close(got, lm([TOKENS[a] for a in path(6)] + [50], prefilled(lm), 1)[0], atol=ATOL,
                                   rtol=RTOL)


def test_windowed_attention_refuses_trees():
    """GPT-Neo's local layers band attention by cache slot, which a tree's slots are not: refused in one line."""
    from utils.cli import UserError

    lm = LM(tiny_family("gpt_neo_local"), 101)
    with torch.inference_mode(), pytest.raises(UserError, match="gpt_neo has sliding-window or local layers"):
        one_call(lm)


@pytest.mark.parametrize("lean", [True, False])
def test_a_chain_shaped_tree_call_runs_plain(models, lean):
    """A tree call that is a chain appended to the cache (a spine level, a chain-shaped tree) is run as the ordinary
    causal call — no rotary gather, no mask — with the same logits; a branching call keeps its mask."""
    lm = make_lm(models, "target", lean)
    with torch.inference_mode():
        cache = prefilled(lm)
        n = cache.get_seq_length()
        pos, mask = tree_attention([-1, 0, 1], [0, 1, 2], n, n, None)  # a chain of three nodes
        assert lm._tree_args(3, cache, pos, mask) == (None, None)
        branch_pos, branch_mask = tree_attention([-1, -1], [0, 1], n, n, None)  # two siblings
        got = lm._tree_args(2, cache, branch_pos, branch_mask)
        assert got[0] is not None and torch.equal(got[1].cpu(), branch_mask)
        tree_logits, _ = lm([5, 6, 7], cache, 3, pos, mask)
        plain = prefilled(lm)
        plain_logits, _ = lm([5, 6, 7], plain, 3)
        assert torch.equal(tree_logits, plain_logits)
