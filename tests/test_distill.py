"""train.distill on the tiny pair: the job runs, the student file round-trips, shared weights stay shared and frozen."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from models.pair import load_pair
from models.student import STUDENT_META, layer_subset, load_student
from train.distill_corpus import weighted
from train.distill_eval import leviathan_speedup
from train.distill_losses import DistillLoss, ForwardKL, topk_kl
from train.distill_student import make_student, save_student
from train.distill_module import collate
from utils.cli import UserError


def test_student_shares_frozen_embeddings_and_head(tiny_pair):
    target = tiny_pair.target
    before = {k: v.clone() for k, v in target.state_dict().items()}
    student = make_student(target, [0, 2], own_norm=True)
    assert student.get_input_embeddings() is target.get_input_embeddings()
    assert student.lm_head is target.lm_head
    assert not student.lm_head.weight.requires_grad and not student.get_input_embeddings().weight.requires_grad
    trainable = {n for n, p in student.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("model.layers.", "model.norm.")) for n in trainable)
    # a step on the student never moves the target
    opt = torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=1.0)
    ids = torch.tensor([tiny_pair.tokenizer.encode("def f(x): return x")])
    student(ids).logits.float().logsumexp(-1).sum().backward()
    opt.step()
    for k, v in target.state_dict().items():
        torch.testing.assert_close(v, before[k])


def test_student_file_roundtrip_identical_logits(tiny_pair, tmp_path):
    student = make_student(tiny_pair.target, [1, 3], own_norm=True)
    with torch.no_grad():
        for p in student.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn_like(p))
    path = save_student(student, tmp_path / "s.safetensors",
                        {"layers": [1, 3], "own_modules": ["norm"], "target": "tiny_random"}, torch.float32)
    with safe_open(str(path), "pt") as fh:
        keys = list(fh.keys())
        assert json.loads(fh.metadata()[STUDENT_META])["layers"] == [1, 3]
    assert all(k.startswith(("model.layers.", "model.norm.")) for k in keys)  # nothing shared is stored
    loaded = load_student(tiny_pair.target, path)
    ids = torch.tensor([tiny_pair.tokenizer.encode("assert f(2) == 4")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, student.eval()(ids).logits)
    assert loaded.lm_head is tiny_pair.target.lm_head


def test_topk_kl_is_exact_kl_when_k_covers_vocab():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(5, 11), -1)
    logits = torch.randn(5, 11)
    vals, idx = p.topk(11, -1)
    kl, _ = topk_kl(logits, vals, idx)
    exact = (p * (p.log() - torch.log_softmax(logits, -1))).sum(-1)
    torch.testing.assert_close(kl, exact, atol=1e-5, rtol=1e-4)
    kl4, _ = topk_kl(logits, vals[:, :4], idx[:, :4])  # grouping the tail can only lower KL (log-sum inequality)
    assert (kl4 <= kl + 1e-6).all()


def test_collate_aligns_teacher_with_continuation():
    item = {"ids": torch.tensor([5, 6, 7, 8, 9], dtype=torch.int32), "start": 3,
            "vals": torch.tensor([[0.9], [0.8]], dtype=torch.float16), "idx": torch.tensor([[8], [9]], dtype=torch.int32)}
    b = collate([item, {**item, "ids": item["ids"][:4], "vals": item["vals"][:1], "idx": item["idx"][:1]}], pad_id=0)
    assert b["x"].tolist() == [[5, 6, 7, 8], [5, 6, 7, 0]]
    assert b["mask"].tolist() == [[False, False, True, True], [False, False, True, False]]
    assert b["idx"][:, 0].tolist() == [8, 9, 8]  # the position before token t holds the teacher's guess for t


def test_source_weights_repeat_drop_and_refuse():
    items = [{"source": s} for s in ["specbench"] * 100 + ["self_instruct_qa"] * 100 + ["mbpp"] * 100] + [{"ids": 0}]
    out = weighted(items, {"specbench": 3, "self_instruct": 0.5, "self_instruct_qa": 2, "mbpp": 0}, seed=0)
    count = Counter(it.get("source", "text") for it in out)
    # the longest matching key wins (self_instruct_qa: 2, not self_instruct: 0.5); unlisted items keep weight 1
    assert count == {"specbench": 300, "self_instruct_qa": 200, "text": 1}
    half = Counter(it.get("source") for it in weighted(items, {"mbpp": 0.5}, seed=0))
    assert 30 < half["mbpp"] < 70 and half["specbench"] == 100
    assert weighted(items, {}, seed=0) is items
    for bad in ({"mbpp": -1}, {"mbpp": "x"}, {"mbpp": "inf"}):
        with pytest.raises(UserError, match="mbpp"):
            weighted(items, bad, seed=0)
    with pytest.raises(UserError, match="every training item"):
        weighted(items[:100], {"specbench": 0}, seed=0)


def test_repeated_items_land_in_different_batches():
    """A weight-3 item's copies have its length; sorted by length alone they filled one batch (3 of 4 slots the
    same sequence). The copy index sorts first, so each batch holds distinct sequences."""
    from train.distill_module import LengthBatches

    items = [{"source": "specbench", "ids": list(range(10 + i))} for i in range(8)]
    out = weighted(items, {"specbench": 3}, seed=0)
    assert sorted(it.get("round", 0) for it in out) == [0] * 8 + [1] * 8 + [2] * 8
    sampler = LengthBatches([len(it["ids"]) for it in out], 4, seed=0, rounds=[it.get("round", 0) for it in out])
    batches = list(sampler)
    assert len(batches) == 6 and all(len({len(out[i]["ids"]) for i in b}) == 4 for b in batches)
    plain = LengthBatches([len(it["ids"]) for it in out], 4, seed=0)  # the old order: copies side by side
    assert any(len({len(out[i]["ids"]) for i in b}) < 4 for b in plain)


def test_distill_recipes_compose_with_a_cap_per_folder():
    """Each conf/distill_recipe file composes onto conf/distill.yaml and pins every data folder's shard count, so a
    top-up that grows later does not change the data a recipe names."""
    from hydra import compose, initialize_config_dir

    from utils.cli import CONF_DIR

    recipes = sorted(p.stem for p in (CONF_DIR / "distill_recipe").glob("*.yaml"))
    assert "chat2mix" in recipes
    for name in recipes:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("distill", overrides=[f"+distill_recipe={name}"])
        assert cfg.name == name and cfg.student.init
        assert len(cfg.data.max_shards) == len(cfg.data.responses) and None not in list(cfg.data.max_shards)


def test_leviathan_speedup():
    assert leviathan_speedup(0.0, 0.1) == {"speedup": 1.0, "gamma": 0}  # no draft beats a useless one
    r = leviathan_speedup(0.8, 0.1)
    assert r["gamma"] > 1 and r["speedup"] == pytest.approx((1 - 0.8 ** (r["gamma"] + 1)) / (0.2 * (r["gamma"] * 0.1 + 1)))


def test_distill_cli_tiny(cli, tmp_path):
    out = tmp_path / "student.safetensors"
    res = cli("train.distill", "pair=tiny_random", "student.layers=[0]", "data.max_new_tokens=8", "data.gen_batch_size=4",
              "data.sources=[{dataset: mbpp, split: train, limit: 6}]", "data.text.chunks=2",
              "data.heldout=[{dataset: mbpp, split: validation, limit: 2}]", "data.heldout_text_chunks=2",
              "train.max_steps=3", "train.val_every=2", "train.batch_size=2", "measure_cost=false",
              f"data.cache_dir={tmp_path / 'cache'}", f"out={out}", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "after" in res.stdout and out.is_file()
    pair = load_pair("tiny_random")
    student = load_student(pair.target, out)
    assert student.student_info["layers"] == [0] and student.student_info["steps_run"] == 3
    # trained: the student's layer moved away from the target layer it was copied from
    init = layer_subset(pair.target, [0])
    assert not torch.equal(student.model.layers[0].mlp.up_proj.weight, init.model.layers[0].mlp.up_proj.weight)
    assert len(list((tmp_path / "cache").rglob("*.pt"))) == 3  # continuations, text, held-out cached for reruns
    # a warm start from that file begins where it ended: its `before` row is the first run's `after`
    again = tmp_path / "again.safetensors"
    common = [a for a in res.args[3:] if not a.startswith(("out=", "hydra.run.dir="))]
    res2 = cli("train.distill", *common, f"student.init={out}", f"out={again}", f"hydra.run.dir={tmp_path / 'run2'}")
    assert res2.returncode == 0, res2.stderr[-2000:]
    first, second = (json.loads(p.with_suffix(".json").read_text()) for p in (out, again))
    assert first["before"]["heldout_sum_min"] != pytest.approx(first["after"]["heldout_sum_min"], abs=1e-3)
    assert second["before"] == pytest.approx(first["after"], abs=1e-4)  # float noise between the two evaluations
    assert second["info"]["recipe"]["student"]["init"] == str(out)
    res3 = cli("train.distill", *common, "student.layers=[1]", f"student.init={out}", f"hydra.run.dir={tmp_path / 'run3'}")
    assert res3.returncode == 2 and "student.init" in res3.stderr and "Traceback" not in res3.stderr


def test_distill_rejects_test_split_and_bad_layers(cli, tmp_path):
    res = cli("train.distill", "pair=tiny_random", "data.sources=[{dataset: mbpp, split: test, limit: 2}]",
              f"data.cache_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 2 and "test split" in res.stderr
    res = cli("train.distill", "pair=tiny_random", "student.layers=[7]", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 2 and "student.layers" in res.stderr


def test_export_student_stores_bf16_with_the_source_recorded(tiny_pair, tmp_path, cli):
    import hashlib

    from train.export_student import export_student

    student = make_student(tiny_pair.target, [0], own_norm=True)
    src = save_student(student, tmp_path / "f32.safetensors", {"layers": [0], "own_modules": ["norm"], "step": 7},
                       torch.float32)
    info = export_student(src, tmp_path / "bf16.safetensors", "bfloat16")
    with safe_open(str(tmp_path / "bf16.safetensors"), "pt") as fh:
        assert {fh.get_tensor(k).dtype for k in fh.keys()} == {torch.bfloat16}
        assert json.loads(fh.metadata()[STUDENT_META]) == info
    assert info["step"] == 7 and info["stored_from"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    loaded = load_student(tiny_pair.target, tmp_path / "bf16.safetensors")  # loads in the pair's dtype (float32)
    ids = torch.tensor([tiny_pair.tokenizer.encode("assert f(2) == 4")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, student.eval()(ids).logits, atol=0.05, rtol=0.05)
    res = cli("train.export_student", f"src={tmp_path / 'nope.safetensors'}", f"out={tmp_path / 'x.safetensors'}")
    assert res.returncode == 2 and "src=" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.real
def test_shipped_student_is_the_default_draft():
    from models.pair import REPO_ROOT

    cfg = OmegaConf.load(REPO_ROOT / "conf" / "pair" / "smollm2_135m.yaml")
    weights = REPO_ROOT / cfg.draft.weights
    assert cfg.draft.source == "student" and weights.stat().st_size <= 40 * 2**20
    pair = load_pair(cfg)
    assert pair.draft.student_info["layers"] == [0, 1, 2, 3]
    # the FR-Spec head holds the target's output rows for the subset (int8: cfg.draft.quantize), not another matrix
    from models.lm_head import Int8Linear, SubsetHead

    head = pair.draft.lm_head
    assert isinstance(head, SubsetHead) and cfg.draft.vocab_subset <= len(head.ids) < cfg.draft.vocab_subset + 64
    assert cfg.draft.quantize == "int8"
    rows = pair.target.lm_head.weight[head.ids].float()
    if pair.dtype == torch.bfloat16:  # int8 applies where its kernel is fast (bf16 on CPU); float32 keeps the rows
        assert isinstance(head.proj, Int8Linear)
        deq = head.proj.qweight.float() * head.proj.scale.float()[:, None]
        assert bool(((deq - rows).abs().amax(1) <= 0.51 * head.proj.scale.float()).all())
    else:
        assert torch.equal(head.proj.weight.float(), rows)
    assert pair.draft.get_input_embeddings() is pair.target.get_input_embeddings()
    text = ('"""Write a function to find the maximum of two numbers.\nassert max_of_two(3, 5) == 5\n"""\n'
            "def max_of_two(a, b):\n    if a > b:\n        return a\n    else:\n        return b\n\n"
            "def min_of_two(a, b):\n    if a < b:\n        return a\n    return b\n")
    ids = pair.tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        p = pair.target(ids).logits[0, :, : pair.vocab_size].argmax(-1)
        agree = {name: (d(ids).logits[0, :, : pair.vocab_size].argmax(-1) == p).float().mean().item()
                 for name, d in [("student", pair.draft), ("untrained", layer_subset(pair.target, [0, 1, 2, 3]))]}
    assert agree["student"] > agree["untrained"] + 0.2, agree  # trained: far closer to the target than its init


class HalfKL(DistillLoss):
    """A loss only this test knows: half the forward KL (the same optimum, half the gradient)."""

    def divergence(self, p, logq):
        return 0.5 * ForwardKL().divergence(p, logq)


def test_a_new_loss_trains_through_the_distill_command(cli, tmp_path):
    """`python -m train.distill train.loss=half_kl hydra.searchpath=[file://DIR]` with distill_loss/half_kl.yaml (this
    module's class) in the user's conf dir: the student trains on it and logs it under its name; an unknown loss is
    one line naming the known ones."""
    conf = tmp_path / "conf"
    (conf / "distill_loss").mkdir(parents=True)
    (conf / "distill_loss" / "half_kl.yaml").write_text(f"_target_: {__name__}.HalfKL\n")
    search = f"hydra.searchpath=[file://{conf}]"
    out = tmp_path / "student.safetensors"
    common = ("pair=tiny_random", "student.layers=[0]", "data.max_new_tokens=8", "data.gen_batch_size=4",
              "data.sources=[{dataset: mbpp, split: train, limit: 4}]", "data.text.chunks=2",
              "data.heldout=[{dataset: mbpp, split: validation, limit: 2}]", "data.heldout_text_chunks=2",
              "train.max_steps=3", "train.val_every=3", "train.batch_size=2", "measure_cost=false",
              f"data.cache_dir={tmp_path / 'cache'}")
    res = cli("train.distill", *common, "train.loss=half_kl", f"out={out}", search, f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-2000:]
    info = json.loads(out.with_suffix(".json").read_text())["info"]
    assert info["recipe"]["train"]["loss"] == "half_kl" and out.is_file()
    bad = cli("train.distill", *common, "train.loss=nope", search, f"hydra.run.dir={tmp_path / 'run2'}")
    assert bad.returncode == 2 and "unknown train.loss=nope; known: fkl, half_kl, jsd, tv" in bad.stderr


def test_sigterm_saves_where_the_run_stands(tmp_path):
    """A SIGTERM (a kill from the shell or a scheduler) ends a long run with a checkpoint at the step it reached:
    Lightning raises SystemExit past the caller's own save, so the stop rules save on the way out."""
    import os
    import signal

    from lightning import Callback, LightningModule, Trainer

    from train.distill import stop_rules

    class Tiny(LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def training_step(self, batch, i):
            return self.lin(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class KillAt(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    last = tmp_path / "last.ckpt"
    trainer = Trainer(max_steps=50, callbacks=[KillAt(), *stop_rules(None, last)], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(torch.randn(40, 2), batch_size=2)
    with pytest.raises(SystemExit):
        trainer.fit(Tiny(), loader)
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 3
