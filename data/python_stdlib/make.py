"""Write tasks.jsonl: MBPP-style code tasks made from the documented public functions of CPython's standard library.

Why: the shipped draft was distilled on MBPP 601-974, which leaves heads 60 MBPP train prompts (issue 16). These
tasks are code prompts no draft was distilled on. A task is MBPP's wording around the function's docstring summary
("Write a function to return ..."; only summaries that open with a verb, so the sentence reads as MBPP's do) and
the function's `def` line, in MBPP's prompt layout (data_gen/prompts.py), so the target answers with code as on
MBPP rather than with prose about the function.
The jsonl is committed (SOURCE.md names the Python version) so the set does not change with the local Python.

    python data/python_stdlib/make.py [--stdlib DIR]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import sysconfig
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "pydoc_data", "site-packages",
             "__pycache__", "venv"}
MIN_WORDS, MAX_WORDS = 6, 80
# verbs a PEP 257 summary opens with ("Return the ..."); third-person forms ("Returns") are mapped to these
VERBS = set("""add append apply build calculate call change check clear close collapse compare compile compute construct
convert copy count create decode decide define delete detect determine disassemble display do dump emit encode ensure
escape evaluate execute expand extract fetch fill filter find fix flush format generate get guess handle increment
indent initialize insert install iterate join list load look make map match merge move normalize open pack parse pop
print process produce put quote raise read recalculate register remove rename replace represent reset resolve restore
retrieve return run save scan search send set show skip sort split start store strip submit take test transform
translate truncate try turn unpack unquote update validate walk wrap write yield""".split())


def verb(word: str) -> str | None:
    """The base form of a summary's first word when it is one of VERBS ("Returns" -> "return"), else None."""
    w = word.lower()
    for base in (w, w[:-1] if w.endswith("s") else "", w[:-2] if w.endswith("es") else "",
                 w[:-3] + "y" if w.endswith("ies") else ""):
        if base in VERBS:
            return base
    return None


def summary(doc: str) -> str | None:
    """MBPP's wording around the first sentence of the docstring's first paragraph, or None when that is not a plain verb-first sentence."""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    para = re.split(r"(?<!e\.g)(?<!i\.e)(?<!etc)\.\s", para)[0].rstrip(".") + "."  # its first sentence, as MBPP's
    words = para.split()
    if not (MIN_WORDS <= len(words) <= MAX_WORDS) or ">>>" in para or para.endswith(":"):
        return None
    base = verb(words[0])
    if base is None:
        return None
    return " ".join(["Write a function to", base] + words[1:])


def def_line(node: ast.FunctionDef) -> str:
    return f"def {node.name}({ast.unparse(node.args)}):"


def tasks(stdlib: Path) -> list[dict]:
    out, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-"))
        for fname in sorted(filenames):
            path = Path(dirpath) / fname
            if not fname.endswith(".py") or fname.startswith("_"):
                continue
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            module = ".".join(path.relative_to(stdlib).with_suffix("").parts)
            for node in tree.body:  # module-level functions only: a task a function answers on its own
                if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node)
                text = summary(doc) if doc else None
                if text is None or text in seen:
                    continue
                seen.add(text)
                out.append({"task_id": f"{module}.{node.name}", "text": text, "def": def_line(node)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    args = ap.parse_args()
    rows = tasks(Path(args.stdlib))
    out = Path(__file__).with_name("tasks.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} tasks from Python {platform.python_version()} at {args.stdlib} -> {out}")


if __name__ == "__main__":
    main()
