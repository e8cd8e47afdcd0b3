"""Trace storage: atomic shards, checksums, load/verify, config hash, and sharded (multi-job) generation + merge."""

from __future__ import annotations

import numpy as np
import pytest
from datasets import Dataset, load_from_disk

from data_gen import store
from data_gen.run import generate, verify_cmd
from tests.test_data_gen import assert_same_rows, make_cfg, rows
from utils.cli import UserError


def fake_rows(n_prompts=2, n=3, k=10, d=4):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n_prompts):
        topk = np.sort(rng.random((n, k)).astype(np.float32), axis=-1)[:, ::-1]
        out.append({
            "prompt_id": f"p{i}", "split": "train", "kind": "target_ar", "n": n,
            "position": np.arange(n, dtype=np.int32), "draft_token": np.arange(n), "target_token": np.arange(n) % 2,
            "q_draft": topk[:, 0], "p_draft": topk[:, 1], "tvd": np.full(n, 0.25, np.float32),
            "draft_entropy": np.ones(n, np.float32), "target_entropy": np.ones(n, np.float32),
            "cross_entropy": np.full(n, 1.5, np.float32), "draft_topk": topk,
            "draft_hidden": rng.standard_normal((n, d)).astype(np.float16),
        })
    return out


def plan(folder, n):
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {"config_hash": "x", "num_shards_planned": n, "topk": 10, "hidden_size": 4}
    store.write_json_atomic(folder / store.MANIFEST, manifest)
    return manifest


def test_shard_round_trip_is_readable_both_ways(tmp_path):
    plan(tmp_path, 1)
    meta = store.write_shard(tmp_path, 0, fake_rows(), topk=10, hidden=4, extra={})
    assert meta["rows"] == 6 and meta["prompt_ids"] == ["p0", "p1"]
    assert not list(tmp_path.glob(".tmp-*"))  # the temp dir was renamed into place
    shard = tmp_path / "shard-00000"
    by_file = Dataset.from_file(str(next(shard.glob("*.arrow"))))
    by_dir = load_from_disk(str(shard))
    assert by_file.num_rows == by_dir.num_rows == 6
    assert by_dir.features["draft_hidden"].feature.dtype == "float16"
    assert by_dir.features["position"].dtype == "int32"
    ds, manifest = store.load_traces(tmp_path)
    assert manifest["complete"] and manifest["rows"] == 6
    np.testing.assert_array_equal(ds["position"], [0, 1, 2, 0, 1, 2])
    np.testing.assert_array_equal(ds["prompt_id"], ["p0"] * 3 + ["p1"] * 3)
    np.testing.assert_allclose(np.asarray(ds["draft_hidden"]), np.concatenate([r["draft_hidden"] for r in fake_rows()]))


def test_temp_dirs_are_invisible_and_missing_shards_are_named(tmp_path):
    manifest = plan(tmp_path, 3)
    store.write_shard(tmp_path, 0, fake_rows(), 10, 4, {})
    (tmp_path / ".tmp-shard-00001-dead").mkdir()  # what a SIGKILL mid-write leaves
    assert sorted(store.existing_shards(tmp_path)) == [0]
    assert store.missing_shards(manifest, store.existing_shards(tmp_path)) == [1, 2]
    with pytest.raises(UserError, match="incomplete"):
        store.load_traces(tmp_path)
    with pytest.raises(UserError, match="shard-00001, shard-00002"):
        store.verify(tmp_path)
    store.remove_stale_tmp(tmp_path, 1)
    assert not (tmp_path / ".tmp-shard-00001-dead").exists()


def test_checksum_catches_a_corrupt_shard(tmp_path):
    plan(tmp_path, 1)
    store.write_shard(tmp_path, 0, fake_rows(), 10, 4, {})
    arrow = next((tmp_path / "shard-00000").glob("*.arrow"))
    data = bytearray(arrow.read_bytes())
    data[-20] ^= 0xFF
    arrow.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"corrupt trace shard .*shard-00000.*delete"):
        store.existing_shards(tmp_path, full=True)
    with pytest.raises(UserError, match="no traces"):
        store.load_traces(tmp_path / "nothing")


def test_config_hash_ignores_what_never_changes_rows(tmp_path):
    base = make_cfg(tmp_path)
    same = make_cfg(tmp_path, "batch_size=1", "shard_id=1", "num_shards=3", "pair.device=cpu", "pair.forward=hf",
                    "pair.linear=torch", "+pair.draft.int8_float_rows=null")
    assert store.config_hash(same) == store.config_hash(base)
    assert store.config_hash(make_cfg(tmp_path, "pair.dtype=bfloat16")) != store.config_hash(base)
    assert store.config_hash(make_cfg(tmp_path, "trace.top_p=0.9")) != store.config_hash(base)
    # a new student at the same path (issue 29) is another draft: another hash, so old traces are never reused
    weights = tmp_path / "student.safetensors"
    weights.write_bytes(b"old draft")
    student = ("pair.draft.source=student", f"+pair.draft.weights={weights}")
    first = store.config_hash(make_cfg(tmp_path, *student))
    weights.write_bytes(b"the new draft")
    assert store.config_hash(make_cfg(tmp_path, *student)) != first != store.config_hash(base)
    assert store.hash_payload(make_cfg(tmp_path, *student))["pair"]["draft_files"]["weights"]
    assert "draft_files" not in store.hash_payload(base)["pair"]  # layer-subset drafts: the target's own files
    assert store.trace_folder(make_cfg(tmp_path, "trace=interleaved"), "test").name == (
        "tiny_random--mbpp--interleaved-t0-p1-n8-s0-h--test"
    )
    # per_task_limit picks other prompts: its own folder, not a refusal at the first run's folder
    assert store.trace_folder(make_cfg(tmp_path, "dataset=specbench", "+dataset.per_task_limit=8", "limit=3"),
                              "train").name == "tiny_random--specbench--target_ar-t0-p1-n8-s0--train-pt8-lim3"
    assert store.code_version()


def test_two_shard_jobs_then_verify_equal_one_job(tmp_path, tiny_pair, capsys):
    kw = ["limit=4", "prompts_per_shard=1", "trace.max_new_tokens=4", "max_prompt_tokens=16"]
    whole = generate(make_cfg(tmp_path / "one", *kw), "train", tiny_pair)
    split_root = tmp_path / "two"
    folder = generate(make_cfg(split_root, *kw, "num_shards=2", "shard_id=1"), "train", tiny_pair)
    assert "verify=true" in capsys.readouterr().out
    assert sorted(p.name for p in folder.glob("shard-*")) == ["shard-00001", "shard-00003"]
    with pytest.raises(UserError, match="incomplete"):
        verify_cmd(make_cfg(split_root, *kw, "num_shards=2"), "train")
    generate(make_cfg(split_root, *kw, "num_shards=2", "shard_id=0"), "train", tiny_pair)
    verify_cmd(make_cfg(split_root, *kw, "num_shards=2"), "train")
    ra, ma = rows(folder)
    rb, mb = rows(whole)
    assert_same_rows(ra, rb)
    assert ma["rows"] == mb["rows"] and ma["complete"]


def test_create_manifest_has_exactly_one_winner(tmp_path):
    """Jobs that create a folder's manifest at the same instant: one writes it, every job gets that one back."""
    import threading

    barrier = threading.Barrier(8)
    got = [None] * 8

    def job(i):
        barrier.wait()
        got[i] = store.create_manifest(tmp_path, {"config_hash": "x", "who": i})

    threads = [threading.Thread(target=job, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    on_disk = store.read_manifest(tmp_path)
    assert all(g == on_disk for g in got)
    assert sum(g is not None and g["who"] == i for i, g in enumerate(got)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [store.MANIFEST]  # no temp files left behind


def test_shard_job_that_loses_the_manifest_race_adopts_it(tmp_path, tiny_pair, monkeypatch):
    """Shard 1 finds no manifest, but shard 0 (started at the same moment) writes manifest and shards before shard 1
    creates its own: shard 1 checks and adopts shard 0's manifest (it used to fail with 'exists without a valid
    manifest'); the merged rows equal one unsharded job's."""
    kw = ["limit=4", "prompts_per_shard=1", "trace.max_new_tokens=4", "max_prompt_tokens=16"]
    whole = generate(make_cfg(tmp_path / "one", *kw), "train", tiny_pair)
    root = tmp_path / "two"
    real = store.create_manifest

    def other_job_first(folder, data):
        monkeypatch.setattr(store, "create_manifest", real)
        generate(make_cfg(root, *kw, "num_shards=2", "shard_id=0"), "train", tiny_pair)
        return real(folder, data)

    monkeypatch.setattr(store, "create_manifest", other_job_first)
    folder = generate(make_cfg(root, *kw, "num_shards=2", "shard_id=1"), "train", tiny_pair)
    verify_cmd(make_cfg(root, *kw, "num_shards=2"), "train")
    ra, ma = rows(folder)
    rb, mb = rows(whole)
    assert_same_rows(ra, rb)
    assert ma["complete"] and ma["rows"] == mb["rows"]
    # a job of another config arriving second is still refused, in one line
    with pytest.raises(UserError, match="another config"):
        generate(make_cfg(root, *kw, "num_shards=2", "shard_id=1", "trace.topk=5"), "train",
                 tiny_pair)


@pytest.mark.slow
def test_submitit_fanout_then_verify_equals_one_job(tmp_path, tiny_pair, cli):
    """The README's scale-out path on a real executor: `-m hydra/launcher=submitit_local shard_id=0,1 num_shards=2`
    starts both shard jobs at once as separate processes managed by submitit (the code path of submitit_slurm),
    then `verify=true` merges; the rows equal an unsharded run's."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[dev]' (hydra-submitit-launcher)")
    kw = ["limit=4", "prompts_per_shard=1", "trace.max_new_tokens=4", "max_prompt_tokens=16", "split=test"]
    whole = generate(make_cfg(tmp_path / "one", *kw), "test", tiny_pair)
    root = tmp_path / "two"
    base = ["data_gen", "pair=tiny_random", "dataset=mbpp", "progress=false", *kw, f"trace_root={root}",
            "batch_size=2", f"log_dir={tmp_path / 'logs'}"]
    res = cli(*base[:1], "-m", "hydra/launcher=submitit_local", *base[1:], "shard_id=0,1", "num_shards=2")
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = sorted((tmp_path / "logs").rglob("*_log.out"))
    assert len(jobs) == 2  # two submitit jobs ran
    res = cli(*base, "num_shards=2", "verify=true")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "verified traces" in res.stdout
    ra, ma = rows(whole.parent.parent / "two" / whole.name)
    rb, mb = rows(whole)
    assert_same_rows(ra, rb)
    assert ma["complete"] and ma["rows"] == mb["rows"]
