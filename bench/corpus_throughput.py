"""A distillation corpus's throughput (issue 54): response positions generated per second and feature positions cached
per second, per shard and in all, with the cache's disk cost.

    python -m bench.corpus_throughput [corpus=traces/distill/<pair>-responses]

`python -m train.distill_data features.cache=true` times each shard as it makes it (its generation seconds in the
shard's metadata, its feature pass in the feature file's) and rebuilds the manifest's `feature_shards` table from
them at the end of every run; this script reads that table and the manifest's machine, so the numbers are the run's
own, not a re-measurement. Writes results/bench/corpus_throughput.{json,md}, one entry per corpus folder.
"""

from __future__ import annotations

import time

from omegaconf import DictConfig

from bench import command, repo_path, write_result
from utils.cli import UserError, hydra_entry


def summary(manifest: dict) -> dict:
    """Totals of the manifest's per-shard timings (shards made before the timings are left out, and counted)."""
    shards = manifest.get("feature_shards") or {}
    timed = {k: v for k, v in shards.items() if v.get("gen_seconds") and v.get("feature_seconds")}
    pos = sum(v["positions"] for v in timed.values())
    fpos = sum(v["feature_positions"] for v in timed.values())
    gen, feat = (sum(float(v[k]) for v in timed.values()) for k in ("gen_seconds", "feature_seconds"))
    spec = manifest.get("features") or {}
    return {"shards": len(shards), "timed_shards": len(timed), "response_positions": pos,
            "feature_positions": fpos, "gen_seconds": gen, "feature_seconds": feat,
            "gen_positions_per_s": pos / gen if gen else None, "feature_positions_per_s": fpos / feat if feat else None,
            "feature_share": feat / (gen + feat) if gen + feat else None,
            "bytes_per_position": spec.get("bytes_per_position"),
            "cache_gb": fpos * int(spec.get("bytes_per_position") or 0) / 1e9,
            "layers": spec.get("layers"), "pair": manifest.get("pair_id"),
            # the shards' own records: a corpus resumed across sessions may have run on several machines
            "machine": ", ".join(sorted({f"{v.get('machine')} ({v.get('threads')} threads)" for v in timed.values()})),
            "dtype": ", ".join(sorted({str(v.get("dtype")) for v in timed.values()}))}


def table(entries: dict) -> list[str]:
    lines = ["| corpus | machine, dtype | timed shards | response positions | generated / s | feature positions / s "
             "| feature pass share | cache (GB) |", "|---|---|---|---|---|---|---|---|"]
    for name, e in entries.items():
        def num(x, fmt):
            return "–" if x is None else format(x, fmt)
        lines.append(f"| {name} | {e['machine']}, {e['dtype']} | {e['timed_shards']} / {e['shards']} | "
                     f"{e['response_positions']:,} | {num(e['gen_positions_per_s'], '.1f')} | "
                     f"{num(e['feature_positions_per_s'], '.0f')} | {num(e['feature_share'], '.1%')} | "
                     f"{e['cache_gb']:.2f} |")
    return lines


def run(cfg: DictConfig) -> dict:
    from data_gen import store

    folder = repo_path(cfg.corpus)
    manifest = store.read_manifest(folder)
    if manifest is None:
        raise UserError(f"corpus={folder}: no manifest.json there; make the corpus with python -m train.distill_data")
    if not manifest.get("feature_shards"):
        raise UserError(f"corpus={folder} records no shard timings (made without features.cache=true, or before "
                        "them); rerun its python -m train.distill_data command with features.cache=true")
    entry = {**summary(manifest), "command": command("corpus_throughput"),
             "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return write_result(cfg.out_dir, "corpus_throughput", entry, table, key=folder.name)


if __name__ == "__main__":
    hydra_entry("bench/corpus_throughput")(run)()
