"""models.heads: the three architectures, normalisation inside the head, checkpoint → HeadBundle round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models.distributions import topk_probs
from models.features.signals import DraftStep
from models.features.spec import FeatureSpec, features_from_columns
from models.features.trace import trace_round_positions
from models.heads import CKPT_KEY, HeadBundle, ResBlock, StopHead, build_head, load_head
from utils.cli import UserError


def test_architectures_shapes_and_kinds():
    disco = build_head("disco", FeatureSpec("disco", k=10), {"hidden": 16})
    assert disco(torch.randn(5, 12)).shape == (5,)
    assert len([m for m in disco.net.modules() if isinstance(m, torch.nn.Linear)]) == 2
    sprinter = build_head("sprinter", FeatureSpec("hidden", d=8))
    assert sprinter(torch.randn(3, 8)).shape == (3,)
    assert sum(p.numel() for p in sprinter.parameters()) == 9  # one linear layer
    spp = build_head("specdecpp", FeatureSpec("hidden", d=8), {"num_blocks": 3})
    blocks = [m for m in spp.modules() if isinstance(m, ResBlock)]
    assert len(blocks) == 3
    # independent weights per block
    assert len({id(b.linear.weight) for b in blocks}) == 3
    with pytest.raises(UserError, match="reads 'hidden' features"):
        build_head("sprinter", FeatureSpec("disco"))
    with pytest.raises(UserError, match="store_hidden"):
        build_head("specdecpp", FeatureSpec("hidden", d=0))


def test_normalisation_inside_head():
    head = StopHead("sprinter", 4)
    x = torch.randn(10, 4) * 5 + 3
    head.set_normalization(x.mean(0), torch.tensor([1.0, 2.0, 0.0, 4.0]))
    assert head.std[2] == 1.0  # constant column keeps std 1
    expected = head.net((x - head.mean) / head.std)
    torch.testing.assert_close(head(x), expected)


@pytest.mark.parametrize("shape", [(49152,), (3, 49152), (151936,), (1000,), (2, 5000 + 37)])
def test_topk_probs_equals_full_topk(shape):
    """The two-stage top-k returns exactly torch.topk's values: vocabularies with and without a partial last chunk,
    batched rows, ties (many equal probabilities) and a peaked distribution."""
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(shape) * 4, -1)
    assert torch.equal(topk_probs(probs, 10), probs.topk(10, -1).values)
    flat = torch.full(shape, 1.0 / shape[-1])
    assert torch.equal(topk_probs(flat, 10), flat.topk(10, -1).values)
    peaked = probs.clone()
    peaked[..., -1] = 5.0  # the largest value in the tail beyond the last full chunk
    assert torch.equal(topk_probs(peaked, 10), peaked.topk(10, -1).values)


@pytest.mark.parametrize("kind,spec,arch", [
    ("disco", FeatureSpec("disco", k=10), {"hidden": 16}),
    ("sprinter", FeatureSpec("hidden", d=8), None),
    ("specdecpp", FeatureSpec("hidden", d=8), {"num_blocks": 2}),
])
def test_scorer_matches_prob(kind, spec, arch):
    """decode's folded per-token scorer gives HeadBundle.prob's probability (normalisation fitted, weights random)."""
    torch.manual_seed(1)
    head = build_head(kind, spec, arch)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    head.set_normalization(torch.randn(spec.dim), torch.rand(spec.dim) + 0.5)
    bundle = HeadBundle(head=head.eval(), kind=kind, spec=spec, labels={}, threshold=0.5, pair_id="p", tokenizer_hash="t")
    score = bundle.scorer()
    for x in torch.randn(5, spec.dim) * 3:
        assert abs(score(x) - float(bundle.prob(x))) < 1e-5
    # the tree builders' batch form (numpy rows; a family without fast_rows falls back to the module), calibrated
    bundle.calibration = {"temperature": 1.7, "bias": -0.3, "mode": "platt"}
    x = torch.randn(7, spec.dim) * 3
    rows = bundle.row_scorer()(x.numpy())
    assert rows.shape == (7,)
    np.testing.assert_allclose(rows, bundle.prob(x).numpy(), atol=1e-5, rtol=1e-5)


def test_features_from_columns_disco_matches_decode_step():
    """A trace row's vector equals the DraftStep vector decode builds for the same distribution and round position."""
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(6, 30), -1)
    cols = {
        "draft_topk": probs.topk(10, -1).values.numpy(),
        "draft_entropy": (-(probs * probs.log()).sum(-1)).numpy(),
        "draft_token": [1, 2, 3, 4, 5, 6],
        "target_token": [1, 2, 0, 4, 0, 6],  # rejections after rows 2 and 4
        "position": [0, 1, 2, 3, 4, 5],
        "prompt_id": ["a"] * 6,
    }
    x = features_from_columns(cols, FeatureSpec("disco", k=10))
    assert x.shape == (6, 12)
    assert trace_round_positions(cols).tolist() == [0, 1, 2, 0, 1, 0]
    for i in range(6):
        step = DraftStep(probs=probs[i], token=cols["draft_token"][i], hidden=None,
                         position_in_round=int(trace_round_positions(cols)[i]), position=i)
        torch.testing.assert_close(x[i], step.disco(10))


def _reference_round_positions(accepted, starts):
    """The definition read literally, row by row: reset at a continuation start and after a rejected row."""
    pos, run = [], 0
    for acc, start in zip(accepted.tolist(), starts.tolist()):
        run = 0 if start else run
        pos.append(run)
        run = run + 1 if acc else 0
    return pos


def test_round_positions_vectorised_equals_reference():
    g = torch.Generator().manual_seed(1)
    n = 400
    cols = {"draft_token": torch.randint(0, 3, (n,), generator=g).numpy(),
            "target_token": torch.randint(0, 3, (n,), generator=g).numpy(),
            "position": [i % 50 for i in range(n)], "prompt_id": [f"p{i // 100}" for i in range(n)]}
    starts = torch.tensor([i % 50 == 0 for i in range(n)])
    ref = _reference_round_positions(torch.tensor(cols["draft_token"] == cols["target_token"]), starts)
    assert trace_round_positions(cols).tolist() == ref


def _bundle_ckpt(tmp_path, kind="specdecpp"):
    spec = FeatureSpec("hidden", d=8) if kind != "disco" else FeatureSpec("disco")
    head = build_head(kind, spec, {"num_blocks": 2} if kind == "specdecpp" else None)
    for p in head.parameters():
        torch.nn.init.normal_(p)
    head.set_normalization(torch.randn(spec.dim), torch.rand(spec.dim) + 0.5)
    bundle = HeadBundle(head, kind, spec, {"name": "accept_prob"}, 0.3, "tiny_random", "abc",
                        {"num_blocks": 2} if kind == "specdecpp" else {})
    path = tmp_path / "h.ckpt"
    torch.save({"state_dict": {f"head.{k}": v for k, v in head.state_dict().items()}, CKPT_KEY: bundle.meta()}, path)
    return bundle, path


def test_load_head_round_trip(tmp_path):
    bundle, path = _bundle_ckpt(tmp_path)
    loaded = load_head(path)
    x = torch.randn(7, 8)
    torch.testing.assert_close(loaded.prob(x), bundle.prob(x), rtol=0, atol=0)
    assert (loaded.kind, loaded.threshold, loaded.pair_id, loaded.spec) == ("specdecpp", 0.3, "tiny_random", bundle.spec)
    assert not loaded.head.training


def test_load_head_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_head(tmp_path / "missing.ckpt")
    bad = tmp_path / "bad.ckpt"
    torch.save({"state_dict": {}}, bad)
    with pytest.raises(UserError, match="not a stop-head checkpoint"):
        load_head(bad)
    junk = tmp_path / "junk.ckpt"
    junk.write_text("hello")
    with pytest.raises(UserError, match="not a readable checkpoint"):
        load_head(junk)


def test_check_pair(tmp_path, tiny_pair):
    bundle, _ = _bundle_ckpt(tmp_path)
    with pytest.raises(UserError, match="trained on pair tiny_random .*this run uses pair tiny_random"):
        bundle.check_pair(tiny_pair)  # tokenizer hash "abc" differs
    bundle.tokenizer_hash = tiny_pair.tokenizer_hash
    with pytest.raises(UserError, match="hidden states of size 8"):
        bundle.check_pair(tiny_pair)
    bundle.spec = FeatureSpec("hidden", d=64)
    bundle.check_pair(tiny_pair)
    with pytest.raises(UserError, match="expects features of size 64"):
        bundle.prob(torch.randn(2, 8))


def test_export_keeps_only_what_decode_reads(tmp_path):
    """train.export drops optimizer/loop state; the copy loads to the same head (same probabilities, same meta)."""
    from train.export import export

    spec = FeatureSpec("disco", k=10)
    head = build_head("disco", spec, {"hidden": 8}).eval()
    bundle = HeadBundle(head=head, kind="disco", spec=spec, labels={"name": "greedy_match"}, threshold=0.4,
                        pair_id="p", tokenizer_hash="t", arch={"hidden": 8})
    run = tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    state = {f"head.{k}": v for k, v in head.state_dict().items()}
    torch.save({CKPT_KEY: bundle.meta(), "state_dict": state, "optimizer_states": [{"big": torch.zeros(1000)}]},
               run / "best.ckpt")
    (run.parent / "results.json").write_text('{"test/auroc": 0.7}')
    dst = export(run / "best.ckpt", tmp_path / "out" / "h.ckpt")
    assert set(torch.load(dst, weights_only=False)) == {CKPT_KEY, "state_dict"}
    again = load_head(dst)
    x = torch.randn(3, 12)
    torch.testing.assert_close(again.prob(x), bundle.prob(x))
    assert again.threshold == 0.4
    # the record beside it has the shipped heads' form (models/weights/heads/<name>.json): export command + metrics
    card = json.loads((tmp_path / "out" / "h.json").read_text())
    assert card["export"].startswith("python -m train.export ") and card["test/auroc"] == 0.7
    assert "command" not in card  # no Hydra record of the run → no training command to give
    assert "traces" not in torch.load(dst, weights_only=False)[CKPT_KEY]  # no run config → nothing to record
    # with the run's config, the copy records its trace folders, so eval finds them after logs/ is gone
    (run.parent / ".hydra").mkdir()
    (run.parent / ".hydra" / "config.yaml").write_text("trace_dirs: {train: tr, validation: va, test: te}\n")
    (run.parent / ".hydra" / "hydra.yaml").write_text(
        "hydra:\n  overrides:\n    hydra: [hydra.mode=RUN, hydra.run.dir=runs/h2]\n"
        "    task: [+experiment=disco_mbpp, 'model.groups=[copy,token]']\n")
    dst = export(run / "best.ckpt", tmp_path / "out" / "h2.ckpt")
    assert torch.load(dst, weights_only=False)[CKPT_KEY]["traces"] == {"train": "tr", "validation": "va", "test": "te"}
    card = json.loads((tmp_path / "out" / "h2.json").read_text())
    assert card["command"] == "python -m train hydra.run.dir=runs/h2 +experiment=disco_mbpp 'model.groups=[copy,token]'"


def test_disco_plus_starts_as_max_q_and_embeds_token_ids():
    """A fresh disco_plus head scores exactly logit(max q), so training starts from the confidence baseline."""
    spec = FeatureSpec("disco_plus", k=10, groups=["verify", "copy", "token"])
    head = build_head("disco_plus", spec, {"hidden": 8})
    x = torch.rand(6, spec.dim)
    x[:, spec.token_columns()] = torch.tensor([[3.0, 49151.0]]).expand(6, 2)
    torch.testing.assert_close(head(x), torch.logit(x[:, 0]))
    torch.nn.init.normal_(head.net.ffn[-1].weight)
    y = x.clone()
    y[:, spec.token_columns()[0]] = 7.0  # another drafted token id moves the score once the FFN is trained
    assert not torch.allclose(head(x), head(y))
    assert spec.names[-2:] == ["draft_token_id", "prev_token_id"] and spec.dim == 22


def test_calibration_fit_and_scorer():
    from models.calibration import fit_calibration
    from models.heads import DiscoFFN

    g = torch.Generator().manual_seed(0)
    z = torch.randn(4000, generator=g) * 3
    y = (torch.rand(4000, generator=g) < torch.sigmoid(z / 2.0 + 0.5)).float()
    cal = fit_calibration(z, y, "platt")
    assert abs(cal["temperature"] - 2.0) < 0.3 and abs(cal["bias"] - 0.5) < 0.2
    only_t = fit_calibration(z, y, "temperature")
    assert only_t["bias"] == 0.0 and fit_calibration(z, y, "none")["temperature"] == 1.0
    with pytest.raises(UserError, match="calibration"):
        fit_calibration(z, y, "isotonic")
    head = StopHead("disco", 12, {"hidden": 8})
    assert isinstance(head.net, DiscoFFN)
    bundle = HeadBundle(head=head, kind="disco", spec=FeatureSpec("disco"), labels={}, threshold=0.5, pair_id="p",
                        tokenizer_hash="t", calibration=cal)
    x = torch.randn(12)
    torch.testing.assert_close(torch.tensor(bundle.scorer()(x)), bundle.prob(x), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(bundle.prob(x), torch.sigmoid(bundle.logit(x) / cal["temperature"] + cal["bias"]))


def test_disco_plus_scorer_equals_prob():
    """decode's folded disco_plus scorer gives the module's calibrated probability."""
    spec = FeatureSpec("disco_plus", k=10, groups=["verify", "copy", "token"])
    head = build_head("disco_plus", spec, {"hidden": 8, "buckets": 64})
    torch.nn.init.normal_(head.net.ffn[-1].weight)
    x = torch.rand(20, spec.dim) * 2
    x[:, spec.token_columns()] = torch.randint(0, 49152, (20, 2)).float()
    head.set_normalization(x.mean(0), x.std(0))
    bundle = HeadBundle(head=head, kind="disco_plus", spec=spec, labels={}, threshold=0.5, pair_id="p",
                        tokenizer_hash="t", calibration={"temperature": 1.7, "bias": -0.3})
    score = bundle.scorer()
    x[:, 0] = x[:, 0].clamp(0.01, 0.99)
    got = torch.tensor([score(row) for row in x])
    torch.testing.assert_close(got, bundle.prob(x).double(), atol=1e-5, rtol=1e-4, check_dtype=False)


def test_disco_plus_ignores_columns_constant_in_training():
    """The all-accepted flag is 0 on every target_ar trace row; a 1 at decode must not move the score."""
    spec = FeatureSpec("disco_plus", k=10, groups=["verify"])
    head = build_head("disco_plus", spec, {"hidden": 8})
    torch.nn.init.normal_(head.net.ffn[-1].weight)
    x = torch.rand(30, spec.dim)
    flag = spec.names.index("last_all_accepted")
    x[:, flag] = 0.0
    head.set_normalization(x.mean(0), x.std(0))
    y = x.clone()
    y[:, flag] = 1.0
    torch.testing.assert_close(head(y), head(x))
    bundle = HeadBundle(head=head, kind="disco_plus", spec=spec, labels={}, threshold=0.5, pair_id="p", tokenizer_hash="t")
    assert abs(bundle.scorer()(y[0]) - float(bundle.prob(x[0]))) < 1e-5
