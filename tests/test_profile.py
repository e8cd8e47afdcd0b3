"""The measured cost profile and the cost model that reads it; the decode-time LM head (fast float32 product,
FR-Spec reduced-vocabulary draft) and its losslessness."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from scipy.stats import chisquare

from decode.loop import autoregressive, speculative
from decode.metrics import cost_model_speedup
from decode.policies import build_policy
from models.cost import LOADED_CORES, CostProfile, modeled_ms, warn_if_loaded
from models.profiling import get_profile
from models.lm_head import packed_available, packed_bf16_available
from models.distributions import draft_probs
from utils.files import read_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


SMALL = {"max_n": 4, "max_tree_n": 5, "max_level": 6, "context": 16, "prefill_lengths": [8, 16], "repeats": 2,
         "warmup": 1}


def flat_profile(c: float, target_ms=None) -> CostProfile:
    """Every target pass costs one step (or `target_ms`), a draft step c, a prefill one target step / c."""
    target_ms = target_ms or [1.0] * 8
    return CostProfile(key={}, draft_ms=[c, c], target_ms=target_ms, prefill_lengths=[1, 1000],
                       prefill_target_ms=[1.0, 1.0], prefill_draft_ms=[c, c], context=16, repeats=1)


def test_profile_is_measured_once_then_cached(tiny_pair, tmp_path, monkeypatch):
    """The first call measures t_draft(1..2), t_target(1..max_n) and prefills; the second reads the cache (a
    second measurement would fail here); refresh=true measures again."""
    import models.profiling as dp

    monkeypatch.setenv("SPECSTOP_CACHE", str(tmp_path))
    prof = get_profile(tiny_pair, SMALL)
    assert len(prof.target_ms) == 4 and len(prof.draft_ms) == 2 and len(prof.prefill_target_ms) == 2
    assert len(prof.draft_level_ms) == 6 and len(prof.target_tree_ms) == 5  # token trees' calls (max_level, max_tree_n)
    assert all(t > 0 for t in prof.target_ms + prof.draft_ms + prof.prefill_draft_ms + prof.draft_level_ms
               + prof.target_tree_ms)
    assert prof.key["dtype"] == "float32" and prof.key["threads"] == 1
    for curve in ("target_ms", "verify_ms", "target_tree_ms", "draft_level_ms"):  # non-decreasing in n, the medians kept beside
        ys, raw = getattr(prof, curve), prof.extra["raw_ms"][curve]
        assert all(a <= b for a, b in zip(ys, ys[1:])) and len(raw) == len(ys)
    assert len(prof.verify_ms) == 4 and prof.version == 3  # verification: the causal passes after a draft call
    assert all(t >= c for t, c in zip(prof.target_tree_ms, prof.verify_ms))  # `tree_curve`'s floor
    assert list((tmp_path / "profiles").glob("tiny_random-*.json"))
    monkeypatch.setattr(dp, "measure", lambda *a, **k: pytest.fail("measured again despite the cache"))
    again = get_profile(tiny_pair, SMALL)
    assert again.target_ms == prof.target_ms
    with pytest.raises(pytest.fail.Exception):
        get_profile(tiny_pair, {**SMALL, "refresh": True})
    assert get_profile(tiny_pair, {**SMALL, "repeats": 1}).target_ms == prof.target_ms  # fewer rounds: the cache serves
    with pytest.raises(pytest.fail.Exception):  # more rounds than the cached profile was timed over: measured again
        get_profile(tiny_pair, {**SMALL, "repeats": 3})


def test_a_run_off_its_profile_says_so():
    """decode.run.profile_drift: the run's target-only step (its decode steps after the prefill call) against the
    profile's target step; none without a profile or steps."""
    from decode.run import profile_drift

    rows = [{"target_s": 0.012, "target_calls": 7}, {"target_s": 0.004, "target_calls": 3}]  # 16 ms over 8 steps
    assert profile_drift(rows, flat_profile(0.1, [2.5] * 8)) == pytest.approx(2 / 2.5 - 1)
    assert profile_drift(rows, None) is None and profile_drift([{"target_s": 0.0, "target_calls": 1}],
                                                               flat_profile(0.1)) is None


def test_a_profile_measured_under_load_says_so(tiny_pair, tmp_path, monkeypatch, capsys):
    """Other processes' CPU time during the measurement (machine busy time minus ours, /proc/stat) is stored with the
    profile; above half a core every use of that profile prints one warning line naming the fix."""
    import models.profiling as dp

    assert dp.other_load((100.0, 10.0), (106.0, 12.0), 4.0) == pytest.approx(1.0)  # 6 s busy, 2 s ours, in 4 s
    assert dp.other_load(None, (1.0, 1.0), 1.0) is None
    monkeypatch.setenv("SPECSTOP_CACHE", str(tmp_path))
    readings = iter([(0.0, 0.0), (1e6, 0.0)])  # before / after: the whole machine busy, none of it ours
    monkeypatch.setattr(dp, "cpu_seconds", lambda: next(readings))
    prof = get_profile(tiny_pair, SMALL)
    assert prof.extra["other_load_cores"] > LOADED_CORES
    assert "profile.refresh=true" in capsys.readouterr().out
    get_profile(tiny_pair, SMALL)  # read back from the cache: still named
    out = capsys.readouterr().out
    assert out.count("warning: other processes kept") == 1
    quiet = flat_profile(0.2)
    quiet.extra["other_load_cores"] = 0.1
    warn_if_loaded(quiet)
    assert capsys.readouterr().out == ""


def test_monotone_pools_only_what_breaks_the_order():
    """Isotonic regression: an ordered curve comes back as it was; a point below an earlier one is pooled with it
    (the mean of the block), so a 10-token pass can no longer look cheaper than a 5-token one."""
    from models.cost import monotone

    assert monotone([1.0, 1.0, 2.0, 3.5]) == [1.0, 1.0, 2.0, 3.5]
    assert monotone([30.0, 33.0, 31.0, 35.0]) == pytest.approx([30.0, 32.0, 32.0, 35.0])
    assert monotone([37.0, 36.0, 35.0]) == pytest.approx([36.0, 36.0, 36.0])
    assert monotone([5.0]) == [5.0]


def test_profile_curve_interpolates_and_extends():
    prof = flat_profile(0.2, target_ms=[10.0, 12.0, 14.0])
    assert prof.target(2) == 12.0 and prof.target(2.5) == 13.0
    assert prof.target(5) == 18.0  # linear past the measured range
    assert prof.verify_ratio(3) == pytest.approx(1.4) and prof.cost_ratio == pytest.approx(0.02)
    assert CostProfile.from_dict(json.loads(json.dumps(prof.to_dict()))).target_ms == prof.target_ms


def test_cost_model_reduces_to_constant_c_on_a_flat_profile():
    """With every pass one target step and prefills costed as steps, the profile's cost model is the classic
    new tokens ÷ (target calls + c · draft calls)."""
    c = 0.25
    spec = {"new_tokens": 20, "target_calls": 6, "draft_calls": 15, "drafted": 15,
            "rounds": [[3, 3], [3, 2], [2, 2], [3, 3], [2, 2], [2, 1]], "prompt_tokens": 40}
    base = {"new_tokens": 20, "target_calls": 20, "draft_calls": 0, "prompt_tokens": 40}
    got = cost_model_speedup([spec], [base], flat_profile(c))
    assert got == pytest.approx(20 / (6 + c * 15))


def test_cost_model_charges_longer_verification():
    """A profile where a K+1-token pass costs more than one step lowers the modeled speedup of long rounds."""
    spec = {"new_tokens": 20, "target_calls": 5, "draft_calls": 20, "drafted": 20, "rounds": [[4, 3]] * 5,
            "prompt_tokens": 40}
    base = {"new_tokens": 20, "target_calls": 20, "draft_calls": 0, "prompt_tokens": 40}
    flat = cost_model_speedup([spec], [base], flat_profile(0.1))
    steep = cost_model_speedup([spec], [base], flat_profile(0.1, target_ms=[1.0, 1.2, 1.4, 1.6, 1.8]))
    assert steep < flat
    assert modeled_ms(spec, flat_profile(0.1, target_ms=[1.0, 1.2, 1.4, 1.6, 1.8])) == pytest.approx(
        1.0 + 4 * 1.8 + 0.1 + 19 * 0.1)


def test_verification_is_priced_after_a_draft_call(tiny_pair, tmp_path, monkeypatch):
    """A round's pass reads `verify_ms` (timed right after a draft call), target-only steps and the speedup's unit
    `target_ms`; prompt lookup's rounds (no model call before the pass) the latter. A version-2 profile (a committed
    run's record) still reads, its verification priced as `target_ms`; as a cache entry it is measured anew."""
    import dataclasses

    import models.profiling as dp
    from decode.lookup import Lookup

    prof = dataclasses.replace(flat_profile(0.1, target_ms=[1.0, 1.2, 1.4, 1.6, 1.8]),
                               verify_ms=[1.1, 1.3, 1.5, 1.7, 1.9])
    assert prof.round_steps(3, 2) == pytest.approx((0.1 + 2 * 0.1 + 1.5) / 1.0)
    assert prof.round_steps(0, 2) == pytest.approx(1.4)  # no draft call before it
    spec = {"new_tokens": 9, "target_calls": 3, "draft_calls": 6, "drafted": 6, "rounds": [[2, 2], [2, 2], [2, 1]],
            "prompt_tokens": 40}
    assert modeled_ms(spec, prof) == pytest.approx(1.0 + 2 * 1.5 + 0.1 + 5 * 0.1)
    base = {"new_tokens": 9, "target_calls": 9, "draft_calls": 0, "prompt_tokens": 40}
    assert modeled_ms(base, prof) == pytest.approx(1.0 + 8 * 1.0)
    assert Lookup.profile_of(None, prof).verify(3) == 1.4
    old = {k: v for k, v in prof.to_dict().items() if k != "verify_ms"} | {"version": 2}
    assert CostProfile.from_dict(old).verify(3) == 1.4
    with pytest.raises(Exception, match="another format version"):
        CostProfile.from_dict({**old, "version": 1})
    monkeypatch.setenv("SPECSTOP_CACHE", str(tmp_path))
    fresh = get_profile(tiny_pair, SMALL)
    path = dp.cache_path(tiny_pair, fresh.key)
    path.write_text(json.dumps({k: v for k, v in fresh.to_dict().items() if k != "verify_ms"} | {"version": 2}))
    assert get_profile(tiny_pair, SMALL).version == 3 and json.loads(path.read_text())["version"] == 3


def test_a_tree_pass_is_never_priced_below_the_causal_pass_of_its_size():
    """`tree_curve`: a tree point measured under the causal curve is lifted to it (the same products plus a mask);
    past the causal curve's end its last point is the floor (a cheap tail point pooled with the ones before it
    would drag them under theirs); the result is non-decreasing."""
    from models.cost import tree_curve

    assert tree_curve([0.9, 1.3, 1.0, 2.0, 1.9], [1.0, 1.2, 1.4]) == pytest.approx([1.0, 1.3, 1.4, 1.95, 1.95])
    assert tree_curve([1.0, 1.0, 3.0, 3.0, 1.0], [1.0, 1.0, 3.0, 3.0]) == pytest.approx([1.0, 1.0, 3.0, 3.0, 3.0])


def test_tree_rounds_are_priced_by_their_own_curves():
    """A token tree's round: the root's draft call cold, each level call by its size (`draft_level_ms`), the pass
    by the tree-attention curve; a chain's as before; a profile without the tree curves prices both alike; a tree
    row's modeled time sums its rounds so."""
    prof = flat_profile(0.1, target_ms=[1.0, 1.2, 1.4, 1.6, 1.8])
    prof.draft_cold_ms = 0.15
    assert prof.round_steps(3, 4, [2, 3]) == pytest.approx(0.15 + 0.1 + 0.1 + 1.8)  # no tree curves: as a chain's
    prof.draft_level_ms, prof.target_tree_ms = [0.1, 0.12, 0.14, 0.16], [1.0, 1.3, 1.6, 1.9, 2.2]
    assert prof.round_steps(3, 4, [2, 3]) == pytest.approx(0.15 + 0.12 + 0.14 + 2.2)
    assert prof.round_steps(3, 4) == pytest.approx(0.15 + 2 * 0.1 + 1.8)  # a chain round reads the chain curves
    assert prof.round_steps(0, 2) == pytest.approx(1.4)
    with pytest.raises(ValueError, match="2 level sizes"):
        prof.round_steps(3, 4, [2])
    row = {"new_tokens": 9, "target_calls": 3, "draft_calls": 7, "drafted": 9, "prompt_tokens": 40,
           "rounds": [[4, 2], [3, 3], [2, 1]], "tree_levels": [[2, 1], [3], []]}
    # the target's prefill (1.0: flat_profile) with the first pass; later passes over 3 + 1 and 2 + 1 tokens; the
    # draft's prefill (0.1), two cold root calls, the level calls on 2, 1 and 3 nodes
    assert modeled_ms(row, prof) == pytest.approx(1.0 + 1.9 + 1.6 + 0.1 + 2 * 0.15 + 0.12 + 0.1 + 0.14)
    assert CostProfile.from_dict(json.loads(json.dumps(prof.to_dict()))).draft_level_ms == prof.draft_level_ms


def test_decode_run_json_carries_the_profile(cli, tmp_path):
    out = tmp_path / "run"
    r = cli("decode", "pair=tiny_random", "dataset=mbpp", "split=test", "limit=2", "max_new_tokens=8", "threads=1",
            "plots=false", "policies=[constant,svip]", f"out_dir={out}", f"+pair.cache_dir={tmp_path}/cache",
            "profile.max_n=5", "profile.repeats=2")
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads((out / "run.json").read_text())
    prof = info["cost_profile"]
    assert len(prof["target_ms"]) == 5 and prof["key"]["pair"] == "tiny_random"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["constant"]["cost_model_speedup"] > 0
    rows = read_jsonl(out / "prompts.jsonl")
    assert all(r["prompt_tokens"] > 0 for r in rows)


def test_profile_cli_prints_the_curve(cli, tmp_path):
    out = tmp_path / "p.json"
    r = cli("decode.profile", "pair=tiny_random", "threads=1", f"+pair.cache_dir={tmp_path}", "profile.max_n=3",
            "profile.repeats=2", f"out={out}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "target pass over n tokens" in r.stdout and "c = " in r.stdout
    assert len(json.loads(out.read_text())["target_ms"]) == 3


# -------------------------------------------------------------------------------------- linear products, LM head


needs_onednn = pytest.mark.skipif(not packed_available(), reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not packed_bf16_available(), reason="oneDNN cannot pack bf16 on this CPU"))])
def test_packed_linear_equals_linear_and_is_batch_invariant(dtype):
    """The packed product is F.linear's (bit for bit in bf16, to rounding in float32), and a row gives the same bits
    alone and inside a batch: a K-token verification sees exactly what K single steps would."""
    from models.lm_head import PackedLinear

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(96, 700, bias=True).to(dtype)
    torch.nn.init.normal_(lin.weight, generator=g)
    packed = PackedLinear(lin.weight, lin.bias)
    h = torch.randn(1, 9, 96, generator=g).to(dtype)
    with torch.inference_mode():
        got, want = packed(h), lin(h)
        rows = torch.cat([packed(h[:, i : i + 1]) for i in range(9)], dim=1)
    assert got.shape == (1, 9, 700)
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(rows, got)


@needs_onednn
def test_packed_linear_follows_weight_updates_and_trains():
    """In-place weight changes (an optimizer step, load_state_dict) repack; with grad recording it is F.linear, so
    gradients flow; parameters and state_dict keys are the Linear's."""
    from models.lm_head import PackedLinear

    lin = torch.nn.Linear(64, 300, bias=False)
    packed = PackedLinear(lin.weight)
    assert list(packed.state_dict()) == ["weight"]
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = packed(x)
        lin.weight.mul_(2.0)
        torch.testing.assert_close(packed(x), 2 * before, rtol=1e-5, atol=1e-4)
    packed(x).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.shape == (300, 64)
    # after use it holds oneDNN's opaque packed copy; deepcopy (train.distill's student layers) still works
    with torch.no_grad():
        used = packed(x)
        twin = copy.deepcopy(packed)
        assert twin.weight is not packed.weight and torch.equal(twin(x), used)


@needs_onednn
def test_packed_pair_is_lossless_and_keeps_ties(tiny_cfg):
    """The tiny pair with every Linear packed: tied embeddings stay tied, the state_dict keeps its keys, and greedy
    decoding is token-identical to target-only for every exact policy (the real pair: test_decode's `real` check)."""
    from models.lm_head import PackedLinear, pack_linears
    from models.pair import load_pair
    from tests.test_decode import greedy_runs

    pair = load_pair(tiny_cfg)
    keys = set(pair.target.state_dict())
    assert pack_linears(pair.target, min_elements=0) > 0 and pack_linears(pair.draft, min_elements=0) > 0
    assert set(pair.target.state_dict()) == keys
    head = pair.target.get_output_embeddings()
    assert isinstance(head, PackedLinear)
    if pair.target.config.tie_word_embeddings:
        assert head.weight is pair.target.get_input_embeddings().weight
    for text, pol, res, ref in greedy_runs(pair, 24):
        assert res.tokens == ref.tokens, f"{pol.name} diverged on {text!r} with packed products"


def test_linear_setting_resolves_per_device(monkeypatch):
    import models.lm_head as lm_head
    from utils.cli import UserError

    monkeypatch.setattr(lm_head, "packed_available", lambda: True)
    assert lm_head.resolve_linear("auto", torch.device("cpu")) == "packed"
    assert lm_head.resolve_linear("auto", torch.device("cuda")) == "torch"
    assert lm_head.resolve_linear("torch", torch.device("cpu")) == "torch"
    with pytest.raises(UserError, match="pair.linear=packed needs a CPU"):
        lm_head.resolve_linear("packed", torch.device("cuda"))
    with pytest.raises(UserError, match="must be one of"):
        lm_head.resolve_linear("fast", torch.device("cpu"))
    monkeypatch.setattr(lm_head, "packed_bf16_available", lambda: False)  # a CPU oneDNN cannot pack bf16 on
    assert lm_head.resolve_linear("auto", torch.device("cpu"), torch.bfloat16) == "torch"
    assert lm_head.resolve_linear("auto", torch.device("cpu"), torch.float32) == "packed"
    with pytest.raises(UserError, match="pack bf16"):
        lm_head.resolve_linear("packed", torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(lm_head, "packed_available", lambda: False)
    assert lm_head.resolve_linear("auto", torch.device("cpu")) == "torch"


def subset_pair(tiny_cfg, tmp_path, n: int):
    from models.pair import load_pair

    freq = tmp_path / "freq.json"
    freq.write_text(json.dumps({"ids_by_frequency": list(range(3, 200))}))
    cfg = OmegaConf.merge(tiny_cfg, {"draft": {"vocab_subset": n, "vocab_freq": str(freq)}})
    return load_pair(cfg)


def test_subset_draft_scores_only_its_tokens(tiny_cfg, tmp_path):
    from models.lm_head import SubsetHead

    pair = subset_pair(tiny_cfg, tmp_path, 20)
    head = pair.draft.get_output_embeddings()
    assert isinstance(head, SubsetHead) and pair.vocab_size == head.out_features
    assert not isinstance(pair.target.get_output_embeddings(), SubsetHead)  # the target keeps the whole vocabulary
    logits = pair.draft(torch.tensor([[5, 6, 7]])).logits[0, -1]
    q = draft_probs(logits)
    keep = set(head.ids.tolist())
    assert keep >= set(range(3, 23))
    outside = [i for i in range(pair.vocab_size) if i not in keep]
    assert float(q[outside].sum()) == 0.0 and float(q.sum()) == pytest.approx(1.0)


def test_subset_draft_features_read_the_support(tiny_cfg, tmp_path):
    """The loop hands a subset draft's ids to DraftStep (models.lm.LM.support); top-k and entropy read only them and
    equal the full-vocabulary values (q is 0 elsewhere). A full draft has no support."""
    from models.features.signals import DraftStep
    from models.lm import LM

    pair = subset_pair(tiny_cfg, tmp_path, 20)
    lm = LM(pair.draft, pair.vocab_size)
    assert lm.support is not None and lm.support.tolist() == pair.draft.get_output_embeddings().ids.tolist()
    assert LM(pair.target, pair.vocab_size).support is None
    q = draft_probs(pair.draft(torch.tensor([[5, 6, 7]])).logits[0, -1, : pair.vocab_size])
    full = DraftStep(probs=q, token=0, hidden=None, position_in_round=0, position=0)
    sub = DraftStep(probs=q, token=0, hidden=None, position_in_round=0, position=0, support=lm.support)
    torch.testing.assert_close(sub.topk(10), full.topk(10), rtol=0, atol=0)
    torch.testing.assert_close(sub.entropy, full.entropy, rtol=1e-6, atol=1e-6)
    tiny = DraftStep(probs=q, token=0, hidden=None, position_in_round=0, position=0, support=lm.support[:3])
    assert tiny.topk(10).shape == (10,)  # a support smaller than k still gives k values


def assert_greedy_lossless(pair):
    """Greedy speculative output of three policies equals target-only greedy on two prompts."""
    for text in ("def add(a, b):\n    return", "The quick brown fox"):
        ids = pair.tokenizer(text)["input_ids"]
        ref = autoregressive(pair, ids, 24, eos=pair.eos_ids)
        for name in ("constant", "svip", "max_confidence"):
            res = speculative(pair, ids, build_policy(name, {}), 24, eos=pair.eos_ids)
            assert res.tokens == ref.tokens, name


def test_subset_draft_is_lossless_greedy(tiny_cfg, tmp_path):
    assert_greedy_lossless(subset_pair(tiny_cfg, tmp_path, 12))


def test_subset_draft_sampling_follows_the_target(tiny_cfg, tmp_path):
    """Exact sampling with a subset draft: the first emitted token follows p (chi-square, α = 0.001), although
    q is zero on most of the vocabulary."""
    assert_first_token_follows_target(subset_pair(tiny_cfg, tmp_path, 8))


def assert_first_token_follows_target(pair, n: int = 800):
    """Exact sampling with a constant-K policy: the first emitted token's counts over n seeds match the target's p
    (chi-square, α = 0.001; rare tokens pooled)."""
    ids = pair.tokenizer("The quick brown fox")["input_ids"]
    with torch.no_grad():
        p = draft_probs(pair.target(torch.tensor([ids])).logits[0, -1, : pair.vocab_size], 1.0).double()
    counts = torch.zeros_like(p)
    pol = build_policy("constant", {"k": 3})
    for s in range(n):
        res = speculative(pair, ids, pol, 1, temperature=1.0, generator=torch.Generator().manual_seed(s))
        counts[res.tokens[0]] += 1
    expected = p * n
    big = expected >= 15
    obs = np.append(counts[big].numpy(), counts[~big].sum().item())
    exp = np.append(expected[big].numpy(), expected[~big].sum().item())
    assert big.sum() >= 3
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3


def test_subset_errors_are_one_line(tiny_cfg, tmp_path):
    from models.pair import load_pair
    from utils.cli import UserError

    with pytest.raises(UserError, match="vocab_freq"):
        load_pair(OmegaConf.merge(tiny_cfg, {"draft": {"vocab_subset": 10}}))
    with pytest.raises(UserError, match="not found"):
        load_pair(OmegaConf.merge(tiny_cfg, {"draft": {"vocab_subset": 10, "vocab_freq": str(tmp_path / "x")}}))
    with pytest.raises(UserError, match="must be in 1.."):
        subset_pair(tiny_cfg, tmp_path, 10 ** 7)


# ------------------------------------------------------------------------------------------- int8 draft weights


def int8_pair(tiny_pair):
    """The tiny pair with a draft that owns its (copied) weights, every Linear an Int8Linear (the kernel runs in
    float32 too, only slowly)."""
    import dataclasses

    from models.lm_head import quantize_linears

    draft = copy.deepcopy(tiny_pair.draft)
    assert quantize_linears(draft, keep={id(p) for p in tiny_pair.target.parameters()}, only_where_fast=False) > 0
    return dataclasses.replace(tiny_pair, draft=draft)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_the_dequantized_product(dtype):
    from models.lm_head import Int8Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 40, bias=True).to(dtype)
    q = Int8Linear(lin.weight, lin.bias)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() >= 126
    x = torch.randn(2, 3, 48, dtype=dtype)
    deq = q.qweight.float() * q.scale.float()[:, None]
    ref = torch.nn.functional.linear(x.float(), deq, lin.bias.float())
    tol = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(q(x).float(), ref, atol=tol, rtol=tol)
    # half the bytes, and close to the float weight: one scale per row keeps each row's error below scale/2
    assert float((deq - lin.weight.float()).abs().max()) <= float(q.scale.float().max()) * 0.51


def test_int8_linear_switches_to_a_bf16_copy_for_many_rows():
    """From `float_rows` rows a bf16 CPU call multiplies by the dequantized weight rounded to bf16 (torch's int8
    kernel is no GEMM: a prefill or a tree level ran ~2x slower through it), below that by the int8 kernel; both agree
    to bf16 resolution, and the copy is neither saved nor carried through a deepcopy."""
    import models.lm_head as lm_head

    torch.manual_seed(0)
    lin = torch.nn.Linear(576, 96, bias=True).to(torch.bfloat16)
    q = lm_head.Int8Linear(lin.weight, lin.bias)
    n = q.float_rows
    assert n == lm_head.INT8_FLOAT_ROWS
    x = torch.randn(n, 576, dtype=torch.bfloat16)
    kernel = torch.ops.aten._weight_int8pack_mm(x, q.qweight, q.scale) + lin.bias.detach()
    deq = (q.qweight.float() * q.scale.float()[:, None]).to(torch.bfloat16)
    assert torch.equal(q(x), torch.nn.functional.linear(x, deq) + lin.bias.detach())  # the copy, not the kernel
    assert torch.equal(q(x[: n - 1]), kernel[: n - 1])  # below the switch: the int8 kernel, bit for bit
    torch.testing.assert_close(q(x), kernel, atol=0.05, rtol=0.02)
    assert "_float" in q.__dict__ and not any("float" in k for k in q.state_dict())
    assert "_float" not in copy.deepcopy(q).__dict__
    q.float_rows = lm_head.NEVER
    assert torch.equal(q(x), kernel)
    fused = lm_head.Int8Linear.stacked([lm_head.Int8Linear(lin.weight, float_rows=3),
                                        lm_head.Int8Linear(lin.weight, float_rows=9)])
    assert fused.float_rows == 3


def test_int8_float_rows_setting_reaches_every_int8_layer(tiny_pair):
    """`pair.draft.int8_float_rows`: absent → the default, null → never, a bad value → one clear error; load_pair
    passes it to quantize_linears, which gives it to every Int8Linear (bench.int8_rows' A/B relies on this)."""
    from models.lm_head import INT8_FLOAT_ROWS, NEVER, Int8Linear, int8_float_rows, quantize_linears
    from utils.cli import UserError

    assert int8_float_rows({}) == INT8_FLOAT_ROWS
    assert int8_float_rows({"int8_float_rows": None}) == NEVER
    assert int8_float_rows({"int8_float_rows": 12}) == 12
    for bad in (0, -3, 2.5, "five", True):
        with pytest.raises(UserError, match="int8_float_rows"):
            int8_float_rows({"int8_float_rows": bad})
    draft = copy.deepcopy(tiny_pair.draft).to(torch.bfloat16)
    quantize_linears(draft, keep={id(p) for p in tiny_pair.target.parameters()}, only_where_fast=False, float_rows=7)
    layers = [m for m in draft.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.float_rows == 7 for m in layers)


def test_int8_draft_is_lossless_greedy(tiny_pair):
    assert_greedy_lossless(int8_pair(tiny_pair))  # target-only runs the same (unquantized) target


def test_int8_draft_sampling_follows_the_target(tiny_pair):
    """Exact sampling with an int8 draft: the first emitted token follows the target's p (chi-square, α = 0.001)."""
    assert_first_token_follows_target(int8_pair(tiny_pair))


def test_int8_refuses_weights_shared_with_the_target_and_unknown_modes(tiny_cfg):
    """The tiny pair's draft is the target's layer 0 itself: quantizing it would quantize the target (and make
    verification inexact), so load_pair refuses it in one line; an unknown mode too."""
    from models.pair import load_pair
    from utils.cli import UserError

    with pytest.raises(UserError, match="shares with the target"):
        load_pair(OmegaConf.merge(tiny_cfg, {"draft": {"quantize": "int8"}}))
    with pytest.raises(UserError, match="draft.quantize must be int8 or null"):
        load_pair(OmegaConf.merge(tiny_cfg, {"draft": {"quantize": "int4"}}))


def test_int8_uses_the_kernel_only_where_it_is_fast():
    """pair.draft.quantize=int8 quantizes bf16 layers on CPU; float32 layers (where torch's int8 kernel is scalar
    code) keep their float weights untouched."""
    from models.lm_head import Int8Linear, quantize_linears

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    bf16 = copy.deepcopy(base).to(torch.bfloat16)
    assert quantize_linears(bf16) == 2 and all(type(bf16[i]) is Int8Linear for i in (0, 2))
    f32 = copy.deepcopy(base)
    assert quantize_linears(f32) == 0 and all(type(f32[i]) is torch.nn.Linear for i in (0, 2))
    torch.testing.assert_close(f32[0].weight, base[0].weight, rtol=0, atol=0)
