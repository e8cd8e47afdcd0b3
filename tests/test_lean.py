"""models.lean: the lean Llama forward gives transformers' numbers bit for bit (bf16's packed one-row attention: to
bf16 rounding), so decoding through it is the same decoding; pair.forward resolves and refuses as documented."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from decode.loop import speculative
from decode.policies import build_policy
from models.lean import LeanCache, LeanLlama, supports
from models.lm import LM, cache_kw
from models.pair import load_pair, resolve_forwards
from utils.cli import UserError

pytestmark = pytest.mark.usefixtures("one_thread")

# prefill, single rows, several rows after a cache (a verification, the draft after a full round), rollbacks, and
# enough positions to outgrow the cache's first buffer (capacity 8 below)
CALLS = [list(range(3, 14)), [20], [21, 22], "crop 1", [23], [24, 25, 26, 27], "crop 3", [28], [29, 30, 31],
         *[[40 + i] for i in range(12)], "crop 5", [60, 61, 62, 63, 64, 65, 66, 67, 68]]


def compare_over_calls(model, lean: LeanLlama, vocab: int, exact: bool) -> LeanCache:
    """Run CALLS through transformers' forward and the lean one side by side; every hidden state is the same bits
    (`exact`) or equal to a few bf16 ulps of its scale. Returns the lean cache."""
    ref, mine = LM(model, vocab).new_cache(), lean.new_cache(capacity=8)
    with torch.inference_mode():
        for call in CALLS:
            if isinstance(call, str):
                m = int(call.split()[1])
                ref.crop(-m)
                mine.crop(-m)
                continue
            x = torch.tensor([call])
            want = model.model(input_ids=x, **cache_kw(model.model, ref), use_cache=True).last_hidden_state
            got = lean.hidden(x[0], mine)
            assert got.dtype == want.dtype
            if exact:
                assert torch.equal(got, want), call
            else:
                assert torch.allclose(got.float(), want.float(), rtol=0.05, atol=0.05 * float(want.abs().max())), call
            assert mine.get_seq_length() == ref.get_seq_length()
    return mine


@pytest.mark.parametrize("dtype,pack", [(torch.float32, None), (torch.bfloat16, False), (torch.bfloat16, None)])
def test_lean_forward_is_transformers_bit_for_bit(tiny_cfg, dtype, pack):
    """Bit for bit, except bf16's packed one-row attention (the default there): equal to bf16 rounding."""
    cfg = OmegaConf.merge(tiny_cfg, {"dtype": str(dtype).replace("torch.", "")})
    pair = load_pair(cfg)
    exact = not LeanLlama(pair.target, pack).pack_one_row
    assert exact == (dtype == torch.float32 or pack is False)
    for model in (pair.target, pair.draft):
        assert supports(model)
        cache = compare_over_calls(model, LeanLlama(model, pack), pair.vocab_size, exact)
        assert cache.k[0].shape[2] >= 32  # the buffer grew


def test_int8_layers_fused_give_the_same_bits(tiny_cfg):
    """An int8 model (the default draft's weights): lean stacks q/k/v and gate/up into one int8 product each, and the
    hidden states stay transformers' bit for bit (bf16, packing off) over the decode above."""
    import copy

    from models.lm_head import Int8Linear, quantize_linears

    pair = load_pair(OmegaConf.merge(tiny_cfg, {"dtype": "bfloat16", "linear": "torch"}))
    model = copy.deepcopy(pair.target)
    assert quantize_linears(model) > 0
    parts = [model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.k_proj]
    x = torch.randn(3, parts[0].in_features, dtype=torch.bfloat16)
    assert torch.equal(Int8Linear.stacked(parts)(x), torch.cat([m(x) for m in parts], -1))
    compare_over_calls(model, LeanLlama(model, pack_one_row=False), pair.vocab_size, exact=True)


def test_decoding_through_lean_is_decoding_through_transformers(tiny_cfg):
    """Same tokens, same rounds: the lean forward changes the time a step takes, nothing else."""
    runs = {}
    for forward in ("lean", "hf"):
        pair = load_pair(OmegaConf.merge(tiny_cfg, {"forward": forward}))
        assert pair.forwards == {"draft": forward, "target": forward}
        policy = build_policy("max_confidence", {"lam": 0.3, "max_len": 6})
        res = speculative(pair, list(range(3, 20)), policy, max_new_tokens=40)
        runs[forward] = (res.tokens, res.rounds)
        assert LM.of(pair, "draft").lean is not None if forward == "lean" else LM.of(pair, "draft").lean is None
    assert runs["lean"] == runs["hf"]


def test_forward_setting_resolves_and_refuses(tiny_cfg, tiny_pair):
    assert tiny_pair.forwards == {"draft": "lean", "target": "lean"}  # auto, plain Llama blocks
    biased = LM(tiny_pair.target, tiny_pair.vocab_size)
    tiny_pair.target.config.attention_bias = True  # a block models.lean does not compute
    try:
        assert not supports(tiny_pair.target)
        assert resolve_forwards("auto", {"target": tiny_pair.target}) == {"target": "hf"}
        with pytest.raises(UserError, match="pair.forward=lean needs plain Llama blocks, which the target"):
            resolve_forwards("lean", {"target": tiny_pair.target})
    finally:
        tiny_pair.target.config.attention_bias = False
    assert biased.lean is None  # LM built without lean=True keeps transformers' forward
    with pytest.raises(UserError, match="pair.forward must be one of auto, lean, hf, got 'fast'"):
        load_pair(OmegaConf.merge(tiny_cfg, {"forward": "fast"}))


def test_requested_layers_are_transformers_hidden_states_on_both_forwards(tiny_cfg):
    """models.lm.LM(..., layers=...) returns the hidden states transformers' `hidden_states` holds at those indices
    (0 the embeddings, the last the final-norm output) at every new position, through the lean forward and
    transformers' alike, for chain calls after a cache and a token-tree call; a call asking for none is unchanged."""
    from models.lm import tree_attention

    pair = load_pair(OmegaConf.merge(tiny_cfg, {"dtype": "float32"}))
    model, n_layers = pair.target, len(pair.target.model.layers)
    layers = (0, 1, n_layers // 2, n_layers)
    lean, hf = LM(model, pair.vocab_size, lean=True), LM(model, pair.vocab_size)
    assert lean.lean is not None and hf.lean is None
    caches = {lm: lm.new_cache() for lm in (lean, hf)}
    ref_cache = hf.new_cache()
    with torch.inference_mode():
        for ids in (list(range(3, 14)), [20], [21, 22, 23]):
            want = model(input_ids=torch.tensor([ids]), **cache_kw(model, ref_cache), use_cache=True,
                         output_hidden_states=True).hidden_states
            for lm, cache in caches.items():
                logits, h, feats = lm(ids, cache, last=2, layers=layers)
                assert feats.shape == (len(layers), len(ids), model.config.hidden_size)
                for j, i in enumerate(layers):
                    assert torch.equal(feats[j], want[i][0]), (lm is lean, ids, i)
                assert torch.equal(h, want[-1][0, -2:])
        # a tree call: two children of the last token; the features are the masked pass's, per node
        for lm, cache in caches.items():
            start = cache.get_seq_length()
            pos, mask = tree_attention([-1, -1], [0, 1], start, start, None, lm.device)
            _, _, feats = lm([30, 31], cache, last=2, positions=pos, mask=mask, layers=(n_layers,))
            cache.crop(-2)
            plain = lm([30, 31], cache, last=2, positions=pos, mask=mask)
            assert len(plain) == 2 and torch.equal(feats[0], plain[1])
