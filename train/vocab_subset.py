"""`python -m train.vocab_subset pair=NAME`: token frequencies for a reduced-vocabulary draft (FR-Spec).

FR-Spec (arXiv 2502.14856) lets the draft score only the N most frequent tokens: its LM head — two thirds of a
4-layer SmolLM2 draft step — shrinks by V/N while the target keeps the full vocabulary, so verification stays
exact. This job counts tokens in the target's own greedy continuations of non-test prompts (what the draft must
propose), in human text of the same domains and in Python standard-library source (code tokens: indentation
runs, identifiers; conf/vocab_subset.yaml), and writes the ids by frequency to
`out` (JSON: ids_by_frequency, counts, sources, coverage). `models.pair.reduce_draft_vocab` reads it.
`coverage.traces` scores, for each size in `coverage.sizes`, the share of a trace folder's target tokens the subset
contains (an upper bound on greedy acceptance of a subset draft relative to the full one).
"""

from __future__ import annotations

import json
import platform
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import torch
from omegaconf import DictConfig

from utils.cli import hydra_entry
from utils.files import write_text_atomic


def _strings(x) -> list[str]:
    """A reference as flat strings (Spec-Bench's are a string, a list, or a list of lists)."""
    if x is None:
        return []
    if isinstance(x, str):
        return [x]
    return [s for item in x for s in _strings(item)]


def count_tokens(pair, cfg: DictConfig) -> tuple[Counter, list[dict]]:
    """Token counts over the target's continuations and the human text the config names."""
    from models.sources import cache_root
    from train.distill_corpus import cache_key, cached, dataset_prompts, generate_continuations

    counts: Counter = Counter()
    sources = []
    if cfg.get("responses"):  # the distillation data (python -m train.distill_data): the target's own responses
        from train.distill_data import load_items

        items, _ = load_items(Path(str(cfg.responses)))
        n = 0
        for it in items:
            new = it["ids"][int(it["start"]):].tolist()
            counts.update(new)
            n += len(new)
        sources.append({"kind": "distill_responses", "folder": str(cfg.responses), "sequences": len(items), "tokens": n})
    g = cfg.generate
    for src in g.sources:
        # never a test split (dataset_prompts refuses one)
        prompts, texts = dataset_prompts(pair, src.dataset, src.split, src.get("limit"), splits=src.get("splits"))
        key = cache_key(pair.pair_id, pair.tokenizer_hash, str(pair.dtype), src.dataset, src.split, src.get("limit"),
                        int(g.max_new_tokens), int(cfg.seed))
        items = cached(cache_root(pair.cfg) / "vocab_subset" / f"gen-{src.dataset}-{src.split}-{key}.pt",
                       lambda: generate_continuations(pair, texts, int(g.max_new_tokens), int(g.batch_size), 0.0, 1,
                                                      4096, int(cfg.seed),
                                                      f"target continuations {src.dataset}/{src.split}"))
        n = 0
        for it in items:
            new = it["ids"][int(it["start"]):].tolist()
            counts.update(new)
            n += len(new)
        sources.append({"kind": "target_greedy", "dataset": src.dataset, "split": src.split, "prompts": len(texts),
                        "tokens": n})
    for src in cfg.text:
        n = 0
        for p in dataset_prompts(pair, src.dataset, src.split, src.get("limit"), splits=src.get("splits"))[0]:
            for text in [p.text, *_strings(p.reference)]:
                ids = pair.tokenizer(text, add_special_tokens=False)["input_ids"]
                counts.update(ids)
                n += len(ids)
        sources.append({"kind": "text", "dataset": src.dataset, "split": src.split, "tokens": n})
    if cfg.get("python_source_files"):
        files = python_sources(int(cfg.python_source_files))
        n = 0
        for path in files:
            ids = pair.tokenizer(path.read_text(encoding="utf-8", errors="ignore"), add_special_tokens=False)["input_ids"]
            counts.update(ids)
            n += len(ids)
        # the running interpreter's modules: another Python version counts other files (the record says which)
        sources.append({"kind": "python_stdlib", "python": platform.python_version(), "files": len(files), "tokens": n})
    return counts, sources


def python_sources(limit: int) -> list[Path]:
    """The first `limit` modules of this interpreter's standard library (sorted by path, tests excluded): real
    Python source that ships with every install and overlaps no prompt set."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"test", "tests", "idlelib", "site-packages"} & set(p.parts))
    return files[:limit]


def coverage(ids_by_freq: list[int], sizes: list[int], folders: list[str]) -> dict:
    """Share of each trace folder's target tokens inside the top-N subset, per N."""
    from data_gen.store import load_traces

    out = {}
    for folder in folders:
        ds, _ = load_traces(folder)
        tokens = torch.as_tensor(ds.with_format("numpy")["target_token"])
        rank = torch.full((max(ids_by_freq + [int(tokens.max())]) + 1,), len(ids_by_freq), dtype=torch.long)
        rank[torch.tensor(ids_by_freq)] = torch.arange(len(ids_by_freq))
        r = rank[tokens]
        out[Path(folder).name] = {str(n): float((r < n).float().mean()) for n in sizes}
    return out


def main(cfg: DictConfig) -> dict:
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    from models.pair import load_pair

    pair = load_pair(cfg.pair)
    counts, sources = count_tokens(pair, cfg)
    ids = [i for i, _ in counts.most_common()]
    result = {
        "pair": pair.pair_id, "tokenizer_hash": pair.tokenizer_hash, "vocab": pair.vocab_size,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "sources": sources,
        "distinct_tokens": len(ids), "total_tokens": sum(counts.values()),
        "coverage": coverage(ids, list(cfg.coverage.sizes), list(cfg.coverage.traces or [])),
        "ids_by_frequency": ids, "counts": [counts[i] for i in ids],
    }
    out = Path(str(cfg.out))
    write_text_atomic(out, json.dumps(result))
    print(f"{len(ids)} distinct tokens of {result['total_tokens']} counted; coverage {json.dumps(result['coverage'])}")
    print(f"wrote {out}")
    return result


@hydra_entry("vocab_subset")
def _entry(cfg):
    main(cfg)


if __name__ == "__main__":
    _entry()
