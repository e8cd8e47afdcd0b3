"""data_gen on the tiny pair: batch invariance, p from generation = teacher-forced p, SIGKILL resume, config refusal,
bad-input one-liners."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from data_gen.run import generate
from data_gen.store import load_traces, trace_folder
from tests.conftest import REPO
from utils.cli import UserError

# Batched matmuls round differently from batch-1 ones; fp32 tiny models stay far inside this.
ATOL = 1e-5
FLOATS = ("q_draft", "p_draft", "tvd", "draft_entropy", "target_entropy", "cross_entropy")


def make_cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(
            "data_gen",
            [*(["pair=tiny_random"] if not any(o.startswith("pair=") for o in overrides) else []),
             "dataset=mbpp", f"trace_root={tmp_path}", "progress=false", "trace.max_new_tokens=8",
             "max_prompt_tokens=40", *overrides],
        )


def rows(folder):
    ds, manifest = load_traces(folder)
    cols = ds.with_format("numpy")[:]
    order = np.lexsort((cols["position"], cols["kind"], cols["prompt_id"]))
    return {k: np.asarray(v)[order] for k, v in cols.items()}, manifest


def assert_same_rows(a, b, atol=ATOL):
    assert set(a) == set(b)
    assert len(a["prompt_id"]) == len(b["prompt_id"]) > 0
    for key in ("prompt_id", "kind", "split", "position", "draft_token", "target_token"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    for key in FLOATS + ("draft_topk",):
        np.testing.assert_allclose(a[key], b[key], atol=atol, err_msg=key)
    if "draft_hidden" in a:
        np.testing.assert_allclose(a["draft_hidden"].astype(np.float32), b["draft_hidden"].astype(np.float32), atol=2e-3)


@pytest.mark.parametrize(
    "trace, extra",
    [("target_ar", ["trace.store_hidden=true"]), ("interleaved", ["trace.temperature=0.7"])],
)
def test_batch8_equals_batch1(tmp_path, tiny_pair, trace, extra):
    # 6 untruncated prompts of different lengths (char tokens): one left-padded batch vs six unpadded batches of 1
    common = [f"trace={trace}", "limit=6", "prompts_per_shard=8", "max_prompt_tokens=null", *extra]
    a = generate(make_cfg(tmp_path / "b8", "batch_size=8", *common), "train", tiny_pair)
    b = generate(make_cfg(tmp_path / "b1", "batch_size=1", *common), "train", tiny_pair)
    ra, ma = rows(a)
    rb, _ = rows(b)
    assert_same_rows(ra, rb)
    if trace == "interleaved":
        assert sorted(set(ra["kind"])) == ["draft", "mixed", "prompt", "target"]
        assert ma["hidden_size"] == tiny_pair.draft.config.hidden_size == ra["draft_hidden"].shape[1]
    else:
        assert set(ra["kind"]) == {"target_ar"}
    # rows of one continuation are stored in position order, starting at 0
    ds, _ = load_traces(a)
    pos, pid = np.asarray(ds["position"]), np.asarray(ds["prompt_id"])
    starts = np.r_[True, pid[1:] != pid[:-1]]
    assert (pos[starts] == 0).all() and (np.diff(pos)[~starts[1:]] == 1).all()
    # statistics are internally consistent: q(x) ≤ top-1 of q, 0 ≤ tvd ≤ 1
    assert (ra["q_draft"] <= ra["draft_topk"][:, 0] + 1e-6).all()
    assert ((ra["tvd"] >= -1e-6) & (ra["tvd"] <= 1 + 1e-6)).all()
    # Gibbs: H_{q,p} ≥ H_q (KL(q‖p) ≥ 0)
    assert (ra["cross_entropy"] >= ra["draft_entropy"] - 1e-4).all()


def test_p_from_generation_equals_teacher_forced(tmp_path, tiny_pair):
    common = ["trace=target_ar", "limit=4", "batch_size=4", "max_prompt_tokens=null"]  # unequal lengths: padding
    a = generate(make_cfg(tmp_path / "gen", *common), "train", tiny_pair)
    b = generate(make_cfg(tmp_path / "tf", *common, "trace.p_source=teacher_forced"), "train", tiny_pair)
    ra, _ = rows(a)
    rb, _ = rows(b)
    assert_same_rows(ra, rb, atol=1e-4)


def test_sigkill_then_rerun_gives_the_uninterrupted_rows(tmp_path, tiny_pair, cli):
    args = ["data_gen", "pair=tiny_random", "dataset=mbpp", "trace=target_ar", "split=train", "limit=40",
            "prompts_per_shard=8", "batch_size=8", "trace.max_new_tokens=4", "max_prompt_tokens=16", f"trace_root={tmp_path / 'killed'}",
            "progress=false", f"log_dir={tmp_path / 'logs'}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    kw = ["trace=target_ar", "limit=40", "prompts_per_shard=8", "trace.max_new_tokens=4", "max_prompt_tokens=16"]
    folder = trace_folder(make_cfg(tmp_path / "killed", *kw), "train")
    deadline = time.time() + 120
    while not (folder / "shard-00000").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = sorted(p.name for p in folder.glob("shard-*"))
    assert 1 <= len(done) < 5, f"the kill should land mid-run, found {done}"
    with pytest.raises(UserError, match="incomplete"):
        load_traces(folder)
    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stdout
    assert not list(folder.glob(".tmp-*"))
    ref = generate(make_cfg(tmp_path / "clean", *kw, "batch_size=5"), "train", tiny_pair)
    ra, ma = rows(folder)
    rb, mb = rows(ref)
    assert_same_rows(ra, rb)
    assert ma["rows"] == mb["rows"] == len(ra["prompt_id"])
    assert len(set(ra["prompt_id"])) == 40


def test_changed_config_is_refused_unless_overwrite(tmp_path, tiny_pair):
    folder = generate(make_cfg(tmp_path, "limit=2"), "train", tiny_pair)
    assert generate(make_cfg(tmp_path, "limit=2"), "train", tiny_pair) == folder  # same config: reused
    changed = make_cfg(tmp_path, "limit=2", "pair.target.initializer_range=0.3")
    with pytest.raises(UserError, match="overwrite=true"):
        generate(changed, "train", tiny_pair)
    changed.overwrite = True
    generate(changed, "train", tiny_pair)
    _, manifest = load_traces(folder)
    assert manifest["config"]["pair"]["target"]["initializer_range"] == 0.3


def test_edited_prompt_files_are_refused_unless_overwrite(tmp_path, tiny_pair, monkeypatch):
    """The config hash names the data set; the manifest's prompts hash catches edited data files."""
    import dataclasses

    import data_gen.run as run

    folder = generate(make_cfg(tmp_path, "limit=2"), "train", tiny_pair)
    real = run.load_prompts

    def edited(*args, **kwargs):
        prompts = real(*args, **kwargs)
        return [dataclasses.replace(prompts[0], text=prompts[0].text + " edited"), *prompts[1:]]

    monkeypatch.setattr(run, "load_prompts", edited)
    with pytest.raises(UserError, match="other mbpp prompts than data/ holds now"):
        generate(make_cfg(tmp_path, "limit=2"), "train", tiny_pair)
    before = load_traces(folder)[1]["prompts_hash"]
    generate(make_cfg(tmp_path, "limit=2", "overwrite=true"), "train", tiny_pair)
    assert load_traces(folder)[1]["prompts_hash"] != before


def test_resume_refuses_traces_started_in_another_dtype(tmp_path, tiny_pair):
    """pair.dtype=auto can resolve differently on another machine: a folder started in bf16 is not continued in fp32."""
    import json

    folder = generate(make_cfg(tmp_path, "limit=2"), "train", tiny_pair)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["dtype"] == "float32"
    manifest.update(complete=False, dtype="bfloat16")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="pair.dtype=bfloat16 to resume"):
        generate(make_cfg(tmp_path, "limit=2"), "train", tiny_pair)


def test_resume_refuses_traces_started_with_another_linear(tmp_path, tiny_pair):
    """pair.linear=auto packs on CPU (models.lm_head); a folder started with torch's product is not continued with
    another, and folders from before the setting count as torch's."""
    import json

    folder = generate(make_cfg(tmp_path, "limit=2"), "train", tiny_pair)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["linear"] == tiny_pair.linear
    other = "torch" if tiny_pair.linear == "packed" else "packed"
    manifest.update(complete=False, linear=other)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=f"pass pair.linear={other} to resume"):
        generate(make_cfg(tmp_path, "limit=2"), "train", tiny_pair)


def _one_error_line(proc):
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, cli, tiny_pair):
    root = tmp_path / "root"
    base = ["data_gen", "pair=tiny_random", f"trace_root={root}", "progress=false", "trace.max_new_tokens=8",
            f"log_dir={tmp_path / 'logs'}"]
    assert "unknown dataset" in _one_error_line(cli(*base, "dataset=nope"))
    assert "no split 'train'" in _one_error_line(cli(*base, "dataset=humaneval", "split=train"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert "not writable" in _one_error_line(cli(*base[:2], *base[3:], f"trace_root={blocker / 'sub'}", "limit=2"))
    # the same UserError path (one line via hydra_entry), checked in-process to keep the suite fast
    with pytest.raises(UserError, match="no prompts"):
        generate(make_cfg(root, "limit=0"), "train", tiny_pair)
    with pytest.raises(UserError, match="3 of 3 prompts are longer than 20 tokens.*prompt_overflow=truncate or skip"):
        generate(make_cfg(root, "limit=3", "max_prompt_tokens=20", "prompt_overflow=error"), "train", tiny_pair)
    assert not root.exists() or not any(root.rglob("*"))


def test_overflow_is_counted_and_corrupt_shard_is_named(tmp_path, tiny_pair, capsys):
    cfg = make_cfg(tmp_path, "limit=3", "max_prompt_tokens=20", "prompt_overflow=skip")
    with pytest.raises(UserError, match="no prompts left"):
        generate(cfg, "train", tiny_pair)
    cfg = make_cfg(tmp_path, "limit=3", "max_prompt_tokens=20", "prompts_per_shard=1")
    folder = generate(cfg, "train", tiny_pair)
    assert "3 of 3 prompts truncated to their last 20 tokens" in capsys.readouterr().out
    arrow = next((folder / "shard-00001").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:-40] + b"\0" * 40)
    (folder / "shard-00002").rename(folder / "gone")  # one shard missing → a resume is needed
    (folder / "gone").rename(folder / ".tmp-shard-00002-x")
    with pytest.raises(UserError, match="corrupt trace shard .*shard-00001.*delete"):
        generate(cfg, "train", tiny_pair)


@pytest.mark.parametrize("trace", ["target_ar", "interleaved"])
def test_draft_equal_to_target_gives_full_acceptance(tmp_path, tiny_cfg, trace):
    """A draft made of all the target's layers is the target: TVD 0, q(x) = p(x), greedy drafts always match.

    An off-by-one between the continuation and the positions q/p are read at would break all three."""
    from omegaconf import OmegaConf

    from models.pair import load_pair

    pair = load_pair(OmegaConf.merge(tiny_cfg, {"draft": {"layers": [0, 1, 2, 3]}}))
    cfg = make_cfg(tmp_path, f"trace={trace}", "limit=4", "pair.draft.layers=[0,1,2,3]")
    r, manifest = rows(generate(cfg, "train", pair))
    np.testing.assert_allclose(r["tvd"], 0, atol=1e-5)
    np.testing.assert_allclose(r["q_draft"], r["p_draft"], atol=1e-5)
    # q = p ⇒ H_{q,p} = H_q (KL(q‖p) = 0)
    np.testing.assert_allclose(r["cross_entropy"], r["draft_entropy"], atol=1e-4)
    assert manifest["mean_acceptance"] > 0.9999
    if trace == "target_ar":
        np.testing.assert_array_equal(r["draft_token"], r["target_token"])


@pytest.mark.real
def test_real_pair_interleaved_rows(tmp_path):
    """The packaged SmolLM2 pair (bf16, padded-vocab slicing, chat template): rows and hidden states are well formed."""
    cfg = make_cfg(tmp_path, "pair=smollm2_135m", "trace=interleaved", "split=test", "limit=4", "batch_size=4",
                   "trace.max_new_tokens=4", "max_prompt_tokens=null")
    folder = generate(cfg, "test", None)
    r, manifest = rows(folder)
    assert manifest["hidden_size"] == 576 == r["draft_hidden"].shape[1]
    assert load_traces(folder)[0].features["draft_hidden"].feature.dtype == "float16"  # stored fp16
    assert sorted(set(r["kind"])) == ["draft", "mixed", "prompt", "target"]
    assert (r["draft_token"] < manifest["vocab_size"]).all() and (r["target_token"] < manifest["vocab_size"]).all()
    assert np.isfinite(r["draft_hidden"].astype(np.float32)).all() and ((r["tvd"] >= 0) & (r["tvd"] <= 1 + 1e-5)).all()
    np.testing.assert_allclose(r["draft_topk"].sum(-1), np.minimum(1, r["draft_topk"].sum(-1)), atol=1e-4)
