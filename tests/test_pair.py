"""models.pair: every source loads into one kind of model; mismatched tokenizers and bad names fail in one line."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from models.lm import cache_kw
from models.pair import check_same_tokenizer, load_pair, load_tokenizer, tokenizer_hash
from models.sources import PairSource
from models.student import layer_subset
from models.tiny import tiny_tokenizer
from tests.conftest import REPO
from utils.cli import UserError


def test_tiny_pair_shares_vocab_and_embeddings(tiny_pair):
    assert tiny_pair.vocab_size == len(tiny_pair.tokenizer)
    assert tiny_pair.draft.get_input_embeddings() is tiny_pair.target.get_input_embeddings()
    assert tiny_pair.draft.lm_head is tiny_pair.target.lm_head
    assert tiny_pair.draft.config.num_hidden_layers == 1


def test_layer_subset_matches_manual_model_and_kv_cache(tiny_pair):
    target = tiny_pair.target
    draft = layer_subset(target, [1, 3])
    manual = copy.deepcopy(target)
    manual.model.layers = torch.nn.ModuleList([manual.model.layers[1], manual.model.layers[3]])
    for j, layer in enumerate(manual.model.layers):
        layer.self_attn.layer_idx = j
    manual.config.num_hidden_layers = 2
    ids = torch.tensor([tiny_pair.tokenizer.encode("def f(x): return x")])
    with torch.no_grad():
        full = draft(ids).logits
        torch.testing.assert_close(full, manual(ids).logits)
        # incremental decoding with the (re-indexed) KV cache gives the same logits as one full pass
        out = draft(ids[:, :5], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(5, ids.shape[1]):
            out = draft(ids[:, t : t + 1], **cache_kw(draft, cache), use_cache=True)
            steps.append(out.logits)
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-4)
    # the target is untouched by building a draft from it
    assert target.model.layers[1].self_attn.layer_idx == 1


def test_hf_local_directory_roundtrip(tiny_pair, tmp_path):
    target_dir = tmp_path / "target"
    tiny_pair.target.save_pretrained(target_dir)
    tiny_pair.tokenizer.save_pretrained(target_dir)
    cfg = OmegaConf.create(
        {"name": "local", "target": {"source": "hf", "path": str(target_dir)},
         "draft": {"source": "hf", "path": str(target_dir)}, "dtype": "float32", "device": "cpu"}
    )
    pair = load_pair(cfg)
    assert pair.tokenizer_hash == tiny_pair.tokenizer_hash
    # the weight-free tokenizer load (train's text group) reads the same tokenizer
    assert tokenizer_hash(load_tokenizer(cfg)) == tiny_pair.tokenizer_hash
    with pytest.raises(UserError, match="cannot load the tokenizer"):
        load_tokenizer(OmegaConf.create({"target": {"source": "hf", "path": str(tmp_path / "missing")}}))
    ids = torch.tensor([pair.tokenizer.encode("abc")])
    with torch.no_grad():
        torch.testing.assert_close(pair.target(ids).logits, tiny_pair.target(ids).logits)


def test_mismatched_tokenizers_refused_naming_both():
    a = tiny_tokenizer()
    b = tiny_tokenizer()
    b.add_tokens(["<extra>"])
    with pytest.raises(UserError, match=r"target A .*draft B"):
        check_same_tokenizer(a, b, "A", "B")
    check_same_tokenizer(a, tiny_tokenizer(), "A", "A")
    assert tokenizer_hash(a) != tokenizer_hash(b)


def test_unknown_pair_name_lists_known():
    with pytest.raises(UserError, match="known: .*smollm2_135m.*tiny_random"):
        load_pair("no_such_pair")


def test_cli_errors_are_one_line(cli):
    res = cli("models", "pair=no_such_pair")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]
    assert "unknown pair 'no_such_pair'" in res.stderr and "tiny_random" in res.stderr
    assert "Traceback" not in res.stderr


def test_cli_mismatched_pair_one_line(cli, tmp_path):
    """A hub/local-dir draft whose tokenizer differs from the target's: one line naming both."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    tok.add_tokens(["<extra>"])
    other = tmp_path / "other"
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(other)
    tok.save_pretrained(other)
    res = cli("models", "pair=tiny_random", "pair.draft.source=hf", f"+pair.draft.path={other}")
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1 and "tokenizers differ" in line and str(other) in line and "tiny_random" in line


@pytest.mark.real
def test_default_pair_loads_with_identical_tokenizers():
    pair = load_pair(OmegaConf.load("conf/pair/smollm2_135m.yaml"))
    assert pair.vocab_size == 49152
    assert pair.draft.get_input_embeddings() is pair.target.get_input_embeddings()
    ids = pair.tokenizer("def add(a, b):", return_tensors="pt").input_ids.to(pair.device)
    with torch.no_grad():
        p = pair.target(ids).logits.float().softmax(-1)
        q = pair.draft(ids).logits.float().softmax(-1)
    assert torch.isfinite(p).all() and torch.isfinite(q).all()


@pytest.mark.parametrize("name", ["pythia_6.9b_160m", "vicuna_13b_68m", "starcoder_tiny", "gptneo_1.3b_125m",
                                  "gpt2xl_gpt2", "qwen2.5_14b_0.5b"])
def test_hub_pair_configs_name_hub_ids(name):
    cfg = OmegaConf.load(f"conf/pair/{name}.yaml")
    assert cfg.name == name
    for role in ("target", "draft"):
        assert cfg[role].source == "hf" and "/" in cfg[role].path


def test_unreachable_hub_id_is_one_clear_error(monkeypatch):
    """Without a hub (as on CI), a hub id fails with a UserError that says what to do, not an HTTP stack."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cfg = OmegaConf.load("conf/pair/gpt2xl_gpt2.yaml")
    cfg.device = "cpu"
    with pytest.raises(UserError, match="cannot load model 'openai-community/gpt2-xl'.*local directory"):
        load_pair(cfg)


def test_dtype_auto_resolves_per_device(monkeypatch):
    """dtype=auto: bf16 on CUDA (fp16 without bf16 support); on CPU bf16 exactly when the CPU's flags list a native
    bf16 instruction set, else fp32 — read from the flags, so CPU load cannot change it; a misspelt dtype is a
    one-line error that lists auto."""
    import models.pair as mp

    zen4 = {"avx2", "avx512f", "avx512_bf16"}
    spr = {"avx2", "avx512f", "amx_tile", "amx_bf16"}
    zen3 = {"avx2", "fma", "sse4_2"}
    arm_v86 = {"fp", "asimd", "bf16", "i8mm"}
    assert mp.cpu_has_native_bf16(zen4) and mp.cpu_has_native_bf16(spr) and mp.cpu_has_native_bf16(arm_v86)
    assert not mp.cpu_has_native_bf16(zen3) and not mp.cpu_has_native_bf16(set())
    monkeypatch.setattr(mp, "cpu_flags", lambda: zen3)
    assert mp.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setattr(mp, "cpu_flags", lambda: zen4)
    assert mp.resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # an AVX2-only machine emulated: auto is what it would pick there
    assert mp.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert mp.resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert mp.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    from models.cost import machine

    assert machine().endswith("kernels capped by ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16") \
        or torch.cuda.is_available()  # the cap is named in every result's machine
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert mp.resolve_dtype("auto", torch.device("cuda")) == torch.float16
    assert mp.resolve_dtype("float32") == torch.float32
    with pytest.raises(UserError, match="known: auto, bfloat16"):
        mp.resolve_dtype("bf16")


def test_dtype_auto_ignores_cpu_load():
    """The same answer idle and with both cores busy (the old 20 ms timing probe flipped under load)."""
    import multiprocessing as mpr
    import time

    import models.pair as mp

    idle = [mp.resolve_dtype("auto", torch.device("cpu")) for _ in range(3)]
    ctx = mpr.get_context("spawn")
    burners = [ctx.Process(target=_burn, args=(3.0,)) for _ in range(2)]
    for b in burners:
        b.start()
    time.sleep(1.0)  # let the spawned burners reach their loops
    try:
        busy = [mp.resolve_dtype("auto", torch.device("cpu")) for _ in range(3)]
    finally:
        for b in burners:
            b.terminate()
    assert set(idle) == set(busy) and len(set(idle)) == 1
    assert idle[0] == (torch.bfloat16 if mp.cpu_has_native_bf16() else torch.float32)


def _burn(seconds: float) -> None:
    import time

    end = time.time() + seconds
    while time.time() < end:
        pass


def test_gguf_cache_key_follows_content_not_path(tmp_path):
    """A reinstalled package (new path, new mtime) reuses the dequantized cache; a different file does not."""
    import os

    from models.sources import _gguf_key

    blob = os.urandom(40_000)
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (a, b):
        path.parent.mkdir()
        path.write_bytes(blob)
    os.utime(b, (1, 1))
    assert _gguf_key(a, edge=1024) == _gguf_key(b, edge=1024)
    b.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))  # the last byte: inside the hashed tail
    assert _gguf_key(a, edge=1024) != _gguf_key(b, edge=1024)
    b.write_bytes(blob[:20_000] + b"x" + blob[20_000:])  # the same first and last 1024 bytes, another size
    assert _gguf_key(a, edge=1024) != _gguf_key(b, edge=1024)


# ---------------------------------------------------------------------------- a new source: one class + one yaml


class LastLayers(PairSource):
    """A source only this test knows: a draft of the target's last `count` layers (sharing its weights)."""

    roles, derived = ("draft",), True

    def load(self, src, cfg, dtype, target=None, target_tok=None):
        n = len(target.model.layers)
        return layer_subset(target, list(range(n - int(src.count), n))), target_tok


def test_a_new_pair_source_decodes_through_the_decode_command(cli, tmp_path):
    """`python -m decode pair=tiny_last hydra.searchpath=[file://DIR]` with pair_source/last_layers.yaml (this
    module's class) and pair/tiny_last.yaml in the user's conf dir: the pair loads through the class, decodes
    losslessly, and a target node naming a draft-only source is one line."""
    import json

    conf = tmp_path / "conf"
    (conf / "pair_source").mkdir(parents=True)
    (conf / "pair_source" / "last_layers.yaml").write_text(f"_target_: {__name__}.LastLayers\n")
    (conf / "pair").mkdir()
    pair = OmegaConf.load(REPO / "conf" / "pair" / "tiny_random.yaml")
    pair.name, pair.draft = "tiny_last", {"source": "last_layers", "count": 2}
    (conf / "pair" / "tiny_last.yaml").write_text(OmegaConf.to_yaml(pair))
    out = tmp_path / "run"
    search = f"hydra.searchpath=[file://{conf}]"
    done = cli("decode", "pair=tiny_last", "limit=2", "max_new_tokens=8", "warmup=false", "policies=[constant]",
               f"out_dir={out}", search)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["constant"]["lossless"] is True and summary["constant"]["acceptance_rate"] < 1
    bad = cli("models", "pair=tiny_last", "pair.target.source=last_layers", search)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: target.source=last_layers cannot be the target; the target needs one of: gguf, hf, tiny_random"]
