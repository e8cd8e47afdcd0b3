"""File helpers shared by stages that must not import torch just to check a file (data_gen's store)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks (model parts are GBs)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def atomic_write(path: Path, write) -> Path:
    """Write a file so a reader never sees it half-written: `write(tmp)` fills a hidden sibling temp file (a unique
    name, created by `write` with the usual permissions), which then replaces `path` in one rename (removed if
    `write` fails). Parent folders are created."""
    import os
    import uuid

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: Path, text: str) -> Path:
    """`atomic_write` of a text file (UTF-8)."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def jsonl_text(rows, digits: int = 6) -> str:
    """One JSON object per line, floats rounded to `digits` significant digits and no space after separators:
    per-prompt rows (token lists most of all) are the bulk of results/, and digits past the sixth are timer noise."""
    import json

    def short(v):
        if isinstance(v, float):
            return float(f"{v:.{digits}g}")
        if isinstance(v, dict):
            return {k: short(x) for k, x in v.items()}
        if isinstance(v, list):
            return [short(x) for x in v]
        return v

    return "".join(json.dumps(short(r), separators=(",", ":")) + "\n" for r in rows)


def write_report(folder: Path, stem: str, res: dict, markdown: str) -> str:
    """`<stem>.json` (indent 2) and `<stem>.md` of a gathered result in `folder` (made if missing), each written
    atomically; returns the markdown (the bars print it)."""
    import json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(folder / f"{stem}.json", json.dumps(res, indent=2))
    write_text_atomic(folder / f"{stem}.md", markdown)
    return markdown


def json_text(obj, indent: int = 1) -> str:
    """`json.dumps(obj, indent=indent)` with each list of plain numbers on one line: a report's curves (eval's ROC
    and PR points) take one line per number otherwise, most of a report's size under results/."""
    import json
    import re

    number = r"(?:-?\d[\d.eE+-]*|null|NaN|-?Infinity)"

    def one_line(m):  # a list of numbers json.dumps spread over lines (a JSON string holds no raw newline)
        body = m.group(0)
        return "[" + ", ".join(v.strip() for v in body[1:-1].split(",")) + "]" if "\n" in body else body

    return re.sub(rf"\[\s*{number}(?:,\s*{number})*\s*\]", one_line, json.dumps(obj, indent=indent)) + "\n"


def read_json(path: Path):
    """A json file's contents, or None when there is no such file."""
    import json

    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else None


def write_jsonl(path: Path, rows, digits: int = 6) -> Path:
    """Per-prompt rows (`jsonl_text`) gzip-compressed at `path` + '.gz' — a decode or replay folder's prompts.jsonl,
    the bulk of results/ (a tenth of the bytes compressed). Deterministic: no name or time in the gzip header, so a
    rerun with the same rows writes the same bytes."""
    return write_gz_text(Path(str(path) + ".gz"), jsonl_text(rows, digits))


def write_gz_text(path: Path, text: str) -> Path:
    import gzip

    return atomic_write(path, lambda tmp: tmp.write_bytes(gzip.compress(text.encode("utf-8"), 9, mtime=0)))


def jsonl_path(path: Path) -> Path | None:
    """Where rows written as `path` (`write_jsonl`) are: `path` + '.gz', or `path` itself (written before rows were
    compressed); None when neither exists."""
    for p in (Path(str(path) + ".gz"), Path(path)):
        if p.is_file():
            return p
    return None


def read_jsonl(path: Path) -> list[dict]:
    """The rows `write_jsonl` wrote as `path` (compressed, or an older plain file); a FileNotFoundError when there
    are none."""
    import gzip
    import json

    found = jsonl_path(path)
    if found is None:
        raise FileNotFoundError(f"no {path} (or {path}.gz)")
    text = gzip.decompress(found.read_bytes()).decode("utf-8") if found.suffix == ".gz" else found.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]
