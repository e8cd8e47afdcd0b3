"""Prompt sets load with their official (or documented) split sizes; bad names and empty selections fail clearly."""

from __future__ import annotations

from collections import Counter

import pytest
from omegaconf import OmegaConf

from data_gen.prompts import load_prompts, render
from models.tiny import tiny_tokenizer
from utils.cli import UserError


def ds(name, **over):
    cfg = OmegaConf.load(f"conf/dataset/{name}.yaml")
    cfg.update(over)
    return cfg


def test_mbpp_official_splits_and_disco_format():
    prompts = load_prompts(ds("mbpp", splits="official"))
    assert Counter(p.split for p in prompts) == {"train": 374, "validation": 90, "test": 500, "prompt": 10}
    first = load_prompts(ds("mbpp"), "test")[0]
    assert first.prompt_id == "mbpp-11" and first.text.startswith('"""') and "assert " in first.text
    assert first.reference


def test_mbpp_heads_scheme_keeps_the_distilled_prompts_out():
    """The default scheme: heads' train/validation are official validation, official train (where the shipped draft
    was distilled) is `distill`, test is unchanged — no prompt in two of them."""
    official = {p.prompt_id: p.split for p in load_prompts(ds("mbpp", splits="official"))}
    heads = {p.prompt_id: p.split for p in load_prompts(ds("mbpp"))}
    assert Counter(heads.values()) == {"train": 60, "validation": 30, "test": 500, "distill": 374, "prompt": 10}
    assert {official[i] for i, s in heads.items() if s in ("train", "validation")} == {"validation"}
    assert {i for i, s in heads.items() if s == "distill"} == {i for i, s in official.items() if s == "train"}
    assert [i for i, s in heads.items() if s == "test"] == [i for i, s in official.items() if s == "test"]
    with pytest.raises(UserError, match="split scheme"):
        load_prompts(ds("mbpp", splits="random"))


def test_humaneval_164():
    assert len(load_prompts(ds("humaneval"), "test")) == 164


def test_specbench_480_and_categories():
    prompts = load_prompts(ds("specbench"))
    assert len(prompts) == 480
    cats = Counter(p.meta["category"] for p in prompts)
    assert all(cats[c] == 80 for c in ["translation", "summarization", "qa", "math_reasoning", "rag"])
    mt = load_prompts(ds("mtbench"))
    assert len(mt) == 80 and len({p.meta["category"] for p in mt}) == 8
    assert all(v == 10 for v in Counter(p.meta["category"] for p in mt).values())
    assert len(load_prompts(ds("specbench", category="summarization"))) == 80
    # hash splits are disjoint and deterministic
    plain = ds("specbench", splits="plain")
    ids = {s: {p.prompt_id for p in load_prompts(plain, s)} for s in ("train", "validation", "test")}
    assert not (ids["train"] & ids["test"]) and not (ids["validation"] & ids["test"])
    assert sum(map(len, ids.values())) == 480


def test_specbench_heads_scheme_keeps_the_distilled_questions_out():
    """The default scheme: the draft's distillation questions (train.distill_prompts reads the `distill` split) are
    the `plain` scheme's train; the heads' train and validation are the plain validation questions; test is the same."""
    from train.distill_prompts import specbench_prompts

    plain = {p.prompt_id: p.split for p in load_prompts(ds("specbench", splits="plain"))}
    heads = {p.prompt_id: p.split for p in load_prompts(ds("specbench"))}
    assert Counter(heads.values()) == {"distill": 281, "train": 44, "validation": 54, "test": 101}
    assert {i for i, s in heads.items() if s == "distill"} == {i for i, s in plain.items() if s == "train"}
    assert {p.prompt_id for p in specbench_prompts()} == {i for i, s in plain.items() if s == "train"}
    assert {plain[i] for i, s in heads.items() if s in ("train", "validation")} == {"validation"}
    assert [i for i, s in heads.items() if s == "test"] == [i for i, s in plain.items() if s == "test"]
    with pytest.raises(UserError, match="split scheme"):
        load_prompts(ds("specbench", splits="random"))


def test_wikitext2_prefixes_have_references_and_disjoint_splits():
    prompts = load_prompts(ds("wikitext2"))
    assert {p.split for p in prompts} == {"train", "validation", "test"}
    p = prompts[0]
    assert len(p.text.split()) == 64 and len(p.reference.split()) == 64
    titles = {s: {q.meta["title"] for q in prompts if q.split == s and not q.prompt_id.startswith("wt2-test")}
              for s in ("train", "validation")}
    assert not titles["train"] & titles["validation"]


def test_bad_split_category_and_empty():
    with pytest.raises(UserError, match="no split 'dev'"):
        load_prompts(ds("mbpp"), "dev")
    with pytest.raises(UserError, match="unknown Spec-Bench category"):
        load_prompts(ds("specbench", category="poetry"))
    with pytest.raises(UserError, match="no prompts"):
        load_prompts(ds("mbpp"), "test", limit=0)


def test_render_without_template_is_raw():
    p = load_prompts(ds("mbpp"), "test", limit=1)[0]
    assert render(p, tiny_tokenizer(), chat_template=True) == p.text


def test_specbench_tasks_and_per_task_limit():
    """Spec-Bench prompts carry SVIP Table 1's task (MT-Bench categories grouped); per_task_limit keeps the first N
    of each task in the split, so a small run still covers all six columns."""
    from omegaconf import OmegaConf

    from data_gen.prompts import load_prompts

    cfg = OmegaConf.create({"name": "specbench", "loader": "specbench", "category": "all", "per_task_limit": 3})
    prompts = load_prompts(cfg, "test")
    tasks = [p.meta["task"] for p in prompts]
    assert sorted(set(tasks)) == ["math_reasoning", "mt_bench", "qa", "rag", "summarization", "translation"]
    assert all(tasks.count(t) == 3 for t in set(tasks))
    assert {p.split for p in prompts} == {"test"}


def test_python_stdlib_tasks_in_mbpp_layout():
    """The standard-library code tasks read like MBPP's (task sentence + a code line in a docstring), split 8/2."""
    prompts = load_prompts(ds("python_stdlib"))
    assert Counter(p.split for p in prompts) == {"train": 514, "validation": 130}
    first = prompts[0]
    assert first.prompt_id.startswith("stdlib-") and first.text.startswith('"""Write a function to ')
    assert "\ndef " in first.text and first.text.endswith('"""\n')
    assert len({p.prompt_id for p in prompts}) == len(prompts)
