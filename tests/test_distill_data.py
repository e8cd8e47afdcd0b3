"""train.distill_data on the tiny pair: prompts never leak a test prompt, the recorded teacher top-k is the target's,
shards resume to the rows of an uninterrupted run, a mismatched folder is refused in one line, exported ids rebuild
a shard; and the distillation losses behave (train.distill_module)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from hydra import compose, initialize_config_dir

from tests.conftest import REPO, run_cli
from train import batch_gen
from train import distill_data as dd
from train import distill_prompts as dp
from train.distill_losses import distill_loss, topk_kl
from train.distill_module import subset_index
from utils.cli import CONF_DIR, UserError


def compose_data(tmp_path, *overrides: str, new_tokens: int = 5):
    """A tiny-pair distill_data config writing under tmp_path (tests/test_feature_cache.py adds its feature cache)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("distill_data", overrides=[
            "pair=tiny_random", f"out_root={tmp_path / 'out'}", f"seq_dir={tmp_path / 'seqs'}",
            f"gen_prompts.path={tmp_path / 'gen.jsonl'}", "gen_prompts.self_instruct=3", "gen_prompts.translations=2",
            "gen_prompts.max_new_tokens=6", f"responses.max_new_tokens={new_tokens}", "limit=6", "prompts_per_shard=2",
            "batch_size=3", "topk=4", "progress=false", "sources=[mbpp]", "max_prompt_tokens=400",
            *overrides])


def rows_of(folder):
    items, manifest = dd.load_items(folder)
    return [(it["ids"].tolist(), it["start"], it["idx"].tolist()) for it in items], manifest


def test_built_prompts_hold_no_test_prompt():
    guard = dp.TestGuard()
    from omegaconf import OmegaConf

    from data_gen.prompts import load_prompts

    test = load_prompts(OmegaConf.load(CONF_DIR / "dataset" / "mbpp.yaml"), "test")
    assert guard.leaks(test[0].text)  # the guard sees the test prompts it must keep out
    built = dp.built_prompts(OmegaConf.create({"sources": ["mbpp", "specbench", "wikitext"]}))
    assert built and not any(guard.leaks(p.text) for p in built)
    assert {p.source for p in built} >= {"mbpp", "specbench", "wikitext_summarize"}
    ids = {p.prompt_id for p in built}
    assert not any(i.startswith("mbpp-") and 11 <= int(i.split("-")[1]) <= 510 for i in ids)  # no MBPP test id


def test_stdlib_source_prompts_come_from_the_committed_file_not_the_interpreter(tmp_path, monkeypatch):
    """The prompt plan is the same on every Python: the functions are read from data/distill/stdlib_source.jsonl
    (CPython 3.11's), and scan_stdlib, which rewrites it, keeps short public top-level functions only."""
    rows = dp.stdlib_source_prompts(10_000)
    assert len(rows) > 500 and all(r.prompt_id.startswith("stdsrc-") and r.source == "stdlib_source" for r in rows)
    assert [r.prompt_id for r in dp.stdlib_source_prompts(3)] == [r.prompt_id for r in rows[:3]]
    lib = tmp_path / "Lib"
    lib.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(4))
    (lib / "mod.py").write_text(f"def keep(a):\n{body}\n\ndef _private(a):\n{body}\n\ndef short():\n    pass\n")
    found = dp.scan_stdlib(lib)
    assert [f.prompt_id for f in found] == ["stdsrc-mod.keep"] and "def keep(a):" in found[0].text
    monkeypatch.setattr(dp, "STDLIB_SOURCE", tmp_path / "missing.jsonl")
    with pytest.raises(UserError, match="missing.jsonl is missing"):
        dp.stdlib_source_prompts(10)


def test_recorded_topk_is_the_targets(tiny_pair):
    enc = [tiny_pair.tokenizer.encode("def f(x):"), tiny_pair.tokenizer.encode("assert g(1)")]
    for temp in (0.0, 1.0):
        outs = dd.generate(tiny_pair, enc, temp, 6, 5, seed=0)
        for e, o in zip(enc, outs):
            ids = torch.tensor([e + o["cont"]])
            with torch.no_grad():
                p = torch.softmax(tiny_pair.target(ids).logits[0, len(e) - 1 : -1].float(), -1)
            v, i = p.topk(5, -1)
            assert torch.equal(i[: len(o["cont"])].int(), o["idx"])
            torch.testing.assert_close(v[: len(o["cont"])].half(), o["vals"], atol=2e-3, rtol=0)
            if temp == 0:  # greedy: each generated token is the teacher's top-1
                assert o["cont"] == o["idx"][:, 0].tolist()


def test_batched_rows_end_at_eos_and_match_generate_across_compaction(tiny_pair):
    """Rows finishing at different steps leave the batch (compact_every=0: at every finish); the rows still running
    must go on exactly as transformers' greedy generate does."""
    from collections import Counter

    from transformers import GenerationConfig

    enc = [tiny_pair.tokenizer.encode(s) for s in ("def f(x):", "assert g(1) == 2 and more words", "hi", "import os\n")]
    gc = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ref = [tiny_pair.target.generate(input_ids=torch.tensor([e]), generation_config=gc)[0, len(e):].tolist()
               for e in enc]
    eos = {Counter(t for r in ref for t in r[2:10]).most_common(1)[0][0]}  # a token that ends some rows early
    outs = batch_gen.respond(tiny_pair.target, enc, [0.0, 1.0, 0.0], 16, 4, 0, tiny_pair.vocab_size, eos,
                             compact_every=0.0)
    lengths = set()
    for r, o in zip(ref, outs):
        cut = next((i + 1 for i, t in enumerate(r) if t in eos), len(r))
        assert o[0]["cont"] == o[2]["cont"] == r[:cut]
        assert o[0]["idx"][:, 0].tolist() == r[:cut] and o[1]["idx"].shape == (len(o[1]["cont"]), 4)
        lengths.add(cut)
    assert len(lengths) > 1  # the rows did finish at different steps


def test_sampled_tokens_follow_the_tempered_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf")]]).repeat(40_000, 1)
    for t in (1.0, 0.5):
        draws = batch_gen._choose(logits, torch.full((40_000,), t), gen)
        freq = torch.bincount(draws, minlength=4).double() / 40_000
        torch.testing.assert_close(freq, torch.softmax(logits[0].double() / t, -1), atol=0.01, rtol=0)
    assert batch_gen._choose(logits[:3], torch.zeros(3), gen).tolist() == [2, 2, 2]


def test_job_resumes_to_the_uninterrupted_rows_and_rebuilds_from_ids(tmp_path):
    whole = compose_data(tmp_path / "a")
    dd.run(whole)
    ref, manifest = rows_of(dd.out_folder(whole))
    per_prompt = len(whole.responses.temperatures)  # greedy + the sampled responses
    assert manifest["complete"] and manifest["num_shards_planned"] == 3 and len(ref) == 6 * per_prompt
    parts = compose_data(tmp_path / "b", "max_shards=1")
    dd.run(parts)
    assert not json.loads((dd.out_folder(parts) / "manifest.json").read_text())["complete"]
    dd.run(compose_data(tmp_path / "b"))  # the rerun continues
    assert rows_of(dd.out_folder(parts))[0] == ref
    # a machine with the exported ids but no cache rebuilds the shards by a teacher-forced pass
    import shutil

    shutil.rmtree(tmp_path / "b" / "out")
    exported = next((tmp_path / "b" / "seqs").glob("*/manifest.json"))
    exported.write_text(json.dumps({**json.loads(exported.read_text()), "code_version": "older"}))
    dd.run(compose_data(tmp_path / "b"))
    rebuilt, _ = rows_of(dd.out_folder(parts))
    # the committed ids' manifest keeps the code version that made them: a rebuild does not rewrite it
    assert json.loads(exported.read_text())["code_version"] == "older"
    assert [r[:2] for r in rebuilt] == [r[:2] for r in ref]
    assert [r[2][0] for r in rebuilt] == [r[2][0] for r in ref]  # same teacher top-1 at every position


def test_max_shards_pins_the_data_of_a_growing_folder(tmp_path):
    cfg = compose_data(tmp_path, "max_shards=2")
    dd.run(cfg)
    folder = dd.out_folder(cfg)
    one, _ = dd.load_items(folder, 1)
    two, _ = dd.load_items(folder, 2)
    assert 0 < len(one) < len(two) == len(dd.load_items(folder)[0])
    with pytest.raises(UserError, match="not the first 3"):
        dd.load_items(folder, 3)  # the third shard is not made yet


@pytest.mark.slow
def test_ablation_trains_every_variant_on_the_same_shards_and_names_a_winner(tmp_path):
    """bench.distill_ablation end to end on the tiny pair: one train.distill run per variant, a table, a winner."""
    cfg = compose_data(tmp_path, "max_shards=1")
    dd.run(cfg)
    runs = ["pair=tiny_random", "student.layers=[0]", "train.batch_size=2", "train.val_every=1000",
            "train.precision=32-true", "data.heldout=[{dataset: mbpp, split: validation, limit: 2}]",
            "data.heldout_text_chunks=2"]
    base = "base=[" + ",".join(f"'{o}'" for o in runs) + "]"  # overrides every train.distill run gets
    out = run_cli("bench.distill_ablation", f"responses={dd.out_folder(cfg)}", "shards=1", "steps=3",
                  "variants=[fkl,tv]", base, f"log_dir={tmp_path / 'logs'}", f"out_dir={tmp_path / 'res'}")
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((tmp_path / "res" / "distill_ablation.json").read_text())
    assert set(res["variants"]) == {"fkl", "tv"} and res["winner"] in res["variants"]
    assert all(v["steps"] == 3 for v in res["variants"].values())
    assert "Winner" in (tmp_path / "res" / "distill_ablation.md").read_text()
    again = run_cli("bench.distill_ablation", f"responses={dd.out_folder(cfg)}", "shards=1", "steps=3",
                    "variants=[fkl,tv]", base, f"log_dir={tmp_path / 'logs'}", f"out_dir={tmp_path / 'res'}")
    assert again.returncode == 0 and "$ " not in again.stdout  # finished runs of this recipe are reused
    other = run_cli("bench.distill_ablation", f"responses={dd.out_folder(cfg)}", "shards=1", "steps=4",
                    "variants=[fkl]", base, f"log_dir={tmp_path / 'logs'}", f"out_dir={tmp_path / 'res2'}")
    assert other.returncode != 0 and "another recipe (train.max_steps 3 (want 4))" in other.stderr
    assert not (tmp_path / "res2").exists()


def test_job_refuses_a_folder_of_other_settings(tmp_path):
    dd.run(compose_data(tmp_path, "max_shards=1"))
    with pytest.raises(UserError, match="another config.*overwrite=true"):
        dd.run(compose_data(tmp_path, "responses.max_new_tokens=7"))
    dd.run(compose_data(tmp_path, "responses.max_new_tokens=7", "overwrite=true", "max_shards=1"))


def test_losses_are_the_exact_divergences_when_k_covers_the_vocabulary():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(6, 9), -1)
    logits = torch.randn(6, 9)
    q = torch.softmax(logits, -1)
    vals, idx = p.topk(9, -1)
    torch.testing.assert_close(distill_loss("tv")(logits, vals, idx), 0.5 * (p - q).abs().sum(-1), atol=1e-5, rtol=0)
    m = 0.5 * (p + q)
    jsd = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    torch.testing.assert_close(distill_loss("jsd")(logits, vals, idx), jsd, atol=1e-5, rtol=0)
    torch.testing.assert_close(distill_loss("fkl")(logits, vals, idx), topk_kl(logits, vals, idx)[0])


def test_subset_head_loss_puts_unreachable_teacher_mass_in_the_rest_bucket():
    subset = torch.tensor([0, 2, 3])
    position = torch.full((5,), -1)
    position[subset] = torch.arange(3)
    idx = torch.tensor([[4, 2]])  # the teacher's top token (4) is outside the subset
    sub = subset_index(idx, position)
    assert sub.tolist() == [[-1, 1]]
    vals = torch.tensor([[0.7, 0.2]])
    loss = distill_loss("fkl")(torch.zeros(1, 3), vals, sub)
    # buckets: {token 2: p 0.2, q 1/3}, rest: {p 0.8, q 2/3}
    want = 0.2 * torch.log(torch.tensor(0.2 / (1 / 3))) + 0.8 * torch.log(torch.tensor(0.8 / (2 / 3)))
    torch.testing.assert_close(loss, want.reshape(1), atol=1e-5, rtol=0)


def _distill_args(tmp_path, run: str) -> list[str]:
    return ["-m", "train.distill", "pair=tiny_random", "student.layers=[0]", "data.max_new_tokens=8",
            "data.gen_batch_size=4", "data.sources=[{dataset: mbpp, split: train, limit: 8}]", "data.text.chunks=0",
            "data.heldout=[{dataset: mbpp, split: validation, limit: 2}]", "data.heldout_text_chunks=2",
            "train.max_steps=400", "train.val_every=1000", "train.batch_size=2", "train.ckpt_minutes=0.002",
            "train.precision=32-true", "measure_cost=false", f"data.cache_dir={tmp_path / 'cache'}",
            f"out={tmp_path / 'student.safetensors'}", f"hydra.run.dir={tmp_path / run}"]


@pytest.mark.slow
def test_distill_resumes_after_a_kill(tmp_path):
    """SIGKILL mid-training, rerun the same command: it continues from the last checkpoint to max_steps."""
    import os

    env = dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    args = [sys.executable, *_distill_args(tmp_path, "run")]
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while not last.is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1.0)  # a few more steps and checkpoints
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert last.is_file(), "no checkpoint before the kill"
    killed_at = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert 0 < killed_at < 400
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming from" in done.stdout
    info = json.loads((tmp_path / "student.json").read_text())["info"]
    assert info["steps_run"] == 400
    # another recipe in the same run folder is refused in one line
    other = subprocess.run([*args, "train.lr=0.5"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert other.returncode == 2 and "another recipe" in other.stderr and "Traceback" not in other.stderr


def test_on_policy_batch_is_the_students_continuation_scored_by_the_teacher(tiny_pair):
    from omegaconf import OmegaConf

    from train.distill_student import make_student
    from train.distill_module import DistillModule, collate

    student = make_student(tiny_pair.target, [0], own_norm=True)
    tcfg = OmegaConf.create({"loss": "fkl", "on_policy": 1.0, "on_policy_tokens": 5, "ce_weight": 0.0, "max_steps": 1})
    module = DistillModule(student, tiny_pair.vocab_size, tcfg, teacher=tiny_pair)
    prompt = tiny_pair.tokenizer.encode("def f(x):")
    item = {"ids": torch.tensor(prompt + [5, 6], dtype=torch.int32), "start": len(prompt),
            "vals": torch.full((2, 3), 0.2, dtype=torch.float16), "idx": torch.zeros((2, 3), dtype=torch.int32)}
    batch = module.student_batch(collate([item], tiny_pair.tokenizer.pad_token_id))
    assert batch["prompts"] == [prompt]
    x = batch["x"][0][batch["att"][0].bool()].tolist()
    assert x[: len(prompt)] == prompt and len(x) > len(prompt)  # the student wrote a continuation
    with torch.no_grad():
        p = torch.softmax(tiny_pair.target(torch.tensor([x])).logits[0].float(), -1)
    n = int(batch["mask"].sum())
    top = p[len(prompt) - 1 : len(prompt) - 1 + n].topk(3, -1)
    assert torch.equal(batch["idx"].long(), top.indices)  # the teacher's top-k on the student's tokens
    assert torch.isfinite(module.training_step(batch, 0))


def test_text_chunks_take_the_responses_topk(tmp_path, tiny_pair):
    """With data.responses the WikiText-2 text is teacher-scored at the responses' top-k: a batch holds one width
    (a 32-wide responses folder beside 64-wide text failed in collate on the real pair)."""
    from omegaconf import OmegaConf

    from train.distill_corpus import build_data

    cfg = compose_data(tmp_path, "max_shards=1")
    dd.run(cfg)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        dcfg = compose("distill", overrides=[
            "pair=tiny_random", f"data.responses={dd.out_folder(cfg)}", f"data.cache_dir={tmp_path / 'cache'}",
            "data.text.chunks=2", "data.text.chunk_tokens=16", "data.heldout=[{dataset: mbpp, split: validation, limit: 1}]",
            "data.heldout_text_chunks=1"])
    assert int(dcfg.data.topk) != 4
    train, *_ = build_data(tiny_pair, dcfg)
    sources = {str(it["source"]) for it in train}
    assert "text_wikitext2" in sources and len(sources) > 1  # responses and text (re-weightable by that name)
    assert sum(s == "text_wikitext2" for s in (it["source"] for it in train)) == 2
    assert {int(it["vals"].shape[-1]) for it in train} == {4}
    assert OmegaConf.select(dcfg, "data.topk") == 64


def test_responses_list_adds_a_top_up_set_of_the_same_width(tmp_path, tiny_pair):
    """data.responses may list folders (the main set, then top-ups made with another out_root): their items add up,
    and a top-up of another top-k width is refused in one line (a batch holds one width)."""
    from train.distill_corpus import build_data

    main = compose_data(tmp_path, "max_shards=1")
    extra = compose_data(tmp_path, "max_shards=2", f"out_root={tmp_path / 'extra'}", f"seq_dir={tmp_path / 'seqs2'}",
                         "responses.temperatures=[1.0]", "seed=1")
    wide = compose_data(tmp_path, "max_shards=1", f"out_root={tmp_path / 'wide'}", f"seq_dir={tmp_path / 'seqs3'}",
                        "topk=6")
    folders = [dd.run(c) for c in (main, extra, wide)]

    def data(*chosen, caps="null"):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            dcfg = compose("distill", overrides=[
                "pair=tiny_random", f"data.responses=[{','.join(str(f) for f in chosen)}]", f"data.max_shards={caps}",
                f"data.cache_dir={tmp_path / 'cache'}", "data.text.chunks=0",
                "data.heldout=[{dataset: mbpp, split: validation, limit: 1}]", "data.heldout_text_chunks=1"])
        return build_data(tiny_pair, dcfg)[0]

    sizes = [len(dd.load_items(f)[0]) for f in folders[:2]]
    assert len(data(*folders[:2])) == sum(sizes) and min(sizes) > 0
    # a list caps each folder (a top-up that grows later still gives a finished run its data back)
    first = len(dd.load_items(folders[1], 1)[0])
    assert 0 < first < sizes[1] and len(data(*folders[:2], caps="[null,1]")) == sizes[0] + first
    with pytest.raises(UserError, match="3 caps for 2"):
        data(*folders[:2], caps="[1,1,1]")
    with pytest.raises(UserError, match="top-6"):
        data(folders[0], folders[2])


def test_translations_from_plans_other_sentences_under_their_own_ids(tmp_path):
    """A top-up set (gen_prompts.translations_from=N) translates the sentences after the main set's N, and its ids
    name them, so a file made with another start is refused by the id check rather than silently continued."""
    main = [r for r in dd._gen_requests(compose_data(tmp_path)) if r["source"] == "translation"]
    top = [r for r in dd._gen_requests(compose_data(tmp_path, "gen_prompts.translations_from=2"))
           if r["source"] == "translation"]
    sentences = dp.english_sentences(4)
    assert [r["id"] for r in main] == ["tr-0", "tr-1"] and [r["id"] for r in top] == ["tr-2", "tr-3"]
    assert [r["request"] for r in top] == [dp.translation_request(s) for s in sentences[2:]]


def test_text_chunks_per_article_reaches_the_rest_of_the_train_articles(tiny_pair):
    """data.text.chunks_per_article overrides the dataset's 4 chunks an article: more raw train text, still only
    train-split articles; a setting the dataset lacks is one UserError line."""
    from train.distill_corpus import dataset_prompts

    few, _ = dataset_prompts(tiny_pair, "wikitext2", "train", None)
    many, _ = dataset_prompts(tiny_pair, "wikitext2", "train", None, chunks_per_article=1000)
    assert len(many) > 2 * len(few) and {p.prompt_id for p in few} < {p.prompt_id for p in many}
    assert {p.split for p in many} == {"train"}
    with pytest.raises(UserError, match="no setting 'chunk_per_article'"):
        dataset_prompts(tiny_pair, "wikitext2", "train", None, chunk_per_article=8)


def test_wikitext_from_asks_new_questions_of_the_same_paragraphs():
    """A top-up set (wikitext_from = the main set's wikitext_per_paragraph) wraps the same paragraphs in templates the
    main set did not use, so no prompt id repeats; asking past the last template is refused."""
    main, top = dp.wikitext_prompts(2), dp.wikitext_prompts(1, skip=2)
    assert len(top) * 2 == len(main) and not {p.prompt_id for p in main} & {p.prompt_id for p in top}
    assert {p.prompt_id.rsplit("-", 1)[0] for p in top} == {p.prompt_id.rsplit("-", 1)[0] for p in main}
    with pytest.raises(UserError, match="within the 6 templates"):
        dp.wikitext_prompts(2, skip=len(dp.WIKI_TEMPLATES) - 1)
