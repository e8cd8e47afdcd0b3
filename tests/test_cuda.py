"""The GPU paths on the tiny random pair: trace generation, `trainer=gpu` training and lossless decoding on CUDA
(models.lean's forward and transformers').

Marked `cuda` and skipped where torch sees no CUDA device, so the CPU suite (and CI) pass without one; on a GPU
machine run `python -m pytest -m cuda -q`. Each compares the CUDA result with what the CPU tests already pin.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")]


@pytest.fixture(scope="module")
def cuda_pair(tiny_cfg):
    from omegaconf import OmegaConf

    from models.pair import load_pair

    cfg = OmegaConf.merge(tiny_cfg, {"device": "cuda"})
    return load_pair(cfg)


def test_trace_generation_on_cuda_equals_cpu(tmp_path, tiny_pair, cuda_pair):
    from data_gen.run import generate
    from tests.test_data_gen import assert_same_rows, make_cfg, rows

    kw = ["limit=3", "trace.max_new_tokens=6", "batch_size=2"]
    cpu = generate(make_cfg(tmp_path / "cpu", *kw), "train", tiny_pair)
    gpu = generate(make_cfg(tmp_path / "gpu", *kw, "pair.device=cuda"), "train", cuda_pair)
    assert cuda_pair.device.type == "cuda"
    (a, _), (b, _) = rows(gpu), rows(cpu)
    assert_same_rows(a, b, atol=1e-4)  # fp32 on both; GPU kernels round differently from CPU ones


def test_trainer_gpu_trains_a_head_that_loads_on_cpu(tmp_path):
    from models.heads import load_head
    from tests.test_train import RESULT_KEYS, cfg_for, splits
    from train.job import run

    cfg = cfg_for("model=disco", "trainer=gpu", "trainer.max_epochs=2")
    assert cfg.trainer.accelerator == "gpu"
    res = run(cfg, tmp_path, *splits())
    assert RESULT_KEYS <= set(res) and 0.0 <= res["test/auroc"] <= 1.0
    bundle = load_head(res["ckpt_path"])  # decode on a CPU machine reads a GPU-trained head
    assert bundle.prob(torch.randn(4, bundle.spec.dim)).device.type == "cpu"


@pytest.mark.parametrize("forward", ["lean", "hf"])
def test_greedy_decoding_on_cuda_is_lossless(tiny_cfg, forward):
    from omegaconf import OmegaConf

    from models.pair import load_pair
    from tests.test_decode import greedy_runs

    pair = load_pair(OmegaConf.merge(tiny_cfg, {"device": "cuda", "forward": forward}))
    assert set(pair.forwards.values()) == {forward}
    for text, pol, res, ref in greedy_runs(pair, 32):
        assert res.tokens == ref.tokens, f"{pol.name} diverged from target-only decoding on CUDA ({forward}) for {text!r}"


@pytest.mark.parametrize("forward", ["lean", "hf"])
def test_tree_decoding_on_cuda_is_lossless(tiny_cfg, forward):
    """Sequoia, EAGLE-2 and a learned node head with context groups (the head moved to the GPU as decode moves it)
    decode exactly target-only greedy on CUDA, with trees that branch."""
    from omegaconf import OmegaConf

    from decode.learned_trees import LearnedTree
    from decode.tree_builders import Eagle2, Sequoia
    from models.pair import load_pair
    from tests.test_decode import make_head
    from tests.test_decode_tree import _profile, assert_branching_lossless

    pair = load_pair(OmegaConf.merge(tiny_cfg, {"device": "cuda", "forward": forward, "draft": {"layers": [0, 1, 2]}}))
    bundle = make_head(pair, "tree_node_plus", seed=2)
    bundle.calibration = {"temperature": 0.3, "bias": 2.0, "mode": "platt"}  # a confident random head: trees grow
    bundle.head.to(pair.device)
    prof = _profile(c=0.01)
    builders = [Sequoia(rank_probs=[0.5, 0.3, 0.2], max_nodes=10, max_depth=4, profile=prof),
                Eagle2(topk=3, max_depth=3, max_nodes=12, profile=prof),
                LearnedTree(bundle=bundle, topk=3, max_depth=4, max_nodes=12, profile=prof)]
    for builder in builders:
        assert_branching_lossless(pair, builder, f"(CUDA, {forward})")
