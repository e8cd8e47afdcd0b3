"""The EAGLE-3 draft (models.eagle3): training-time test computes what drafting computes, step for step; saving and
loading keep it; the drafter (decode.eagle3) is lossless greedy and in law, with chains and stop policies."""

from __future__ import annotations

import pytest
import torch

from models.eagle3 import Eagle3

pytestmark = pytest.mark.usefixtures("one_thread")


def draft_for(pair, seed: int = 0, n_ids: int = 60) -> Eagle3:
    torch.manual_seed(seed)
    ids = torch.randperm(pair.vocab_size)[:n_ids]
    model = Eagle3.from_target(pair.target, ids).float().eval()
    with torch.no_grad():  # a random draft, but not a silent one: scale the head up so its choices vary
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def target_features(pair, model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hs = pair.target(torch.tensor([seq]), output_hidden_states=True).hidden_states
    return torch.stack([hs[i][0] for i in model.cfg.layers], 1)  # (T, 3, H)


def test_ttt_steps_equal_drafting_with_a_cache(tiny_pair):
    """Step j of forward_steps at row i = drafting j tokens after the true-feature prefix through row i: the cache
    holds rows 0..i (true features), then the chain feeds its own outputs back."""
    model = draft_for(tiny_pair)
    seq = tiny_pair.tokenizer.encode("def add(a, b):\n    return a + b\nprint(add(1, 2))", add_special_tokens=False)
    T, steps = len(seq), 3
    feats = target_features(tiny_pair, model, seq)
    with torch.no_grad():
        ttt = [model.logits(h) for h in model.forward_steps(torch.tensor([seq]), feats[None], steps)]
        fused = model.fuse(feats)
        for i in (0, 3, T - 5):
            cache = model.new_cache()
            out = model.step(torch.tensor(seq[1 : i + 2]), fused[: i + 1], cache)[-1:]  # rows 0..i, true features
            assert torch.allclose(model.logits(out)[0], ttt[0][0, i], atol=1e-5)
            for j in range(1, steps):
                out = model.step(torch.tensor([seq[i + 1 + j]]), out, cache)
                assert torch.allclose(model.logits(out)[0], ttt[j][0, i], atol=1e-5), (i, j)


def chain_outs(m, seq, feats) -> list[torch.Tensor]:
    """The layer's outputs drafting seq[8:11] (teacher-forced) after seq[1:8] on true features: [prefix's last, the
    three steps']."""
    cache = m.new_cache(capacity=4)  # small: the cache grows on the way
    outs = [m.step(torch.tensor(seq[1:8]), m.fuse(feats[:7]), cache)[-1:]]
    for t in seq[8:11]:
        outs.append(m.step(torch.tensor([t]), outs[-1], cache))
    return outs


def test_prepared_products_and_tree_calls_compute_the_chain_step(tiny_pair):
    """`prepare` (stacked q/k/v and gate/up, oneDNN-packed products) changes no number beyond float rounding, and a
    tree call on a chain-shaped branch (models.lm.tree_attention's positions and mask, each node fed its parent's
    output) computes the chain's steps."""
    from models.lm import tree_attention
    from models.lm_head import packed_available

    plain, lean = draft_for(tiny_pair, seed=2), draft_for(tiny_pair, seed=2)
    lean.prepare("packed" if packed_available() else "torch")
    seq = tiny_pair.tokenizer.encode("for i in range(10):\n    print(i)", add_special_tokens=False)
    feats = target_features(tiny_pair, plain, seq)
    with torch.no_grad():
        ref = chain_outs(plain, seq, feats)
        assert all(torch.allclose(plain.logits(a), lean.logits(b), atol=1e-4)
                   for a, b in zip(ref, chain_outs(lean, seq, feats)))
        cache = plain.new_cache()
        plain.step(torch.tensor(seq[1:8]), plain.fuse(feats[:7]), cache)
        pos, mask = tree_attention([-1, 0, 1], [0, 1, 2], cache.length, cache.length)
        tree = plain.step(torch.tensor(seq[8:11]), torch.cat(ref[:3]), cache, pos, mask)
        assert torch.allclose(tree, torch.cat(ref[1:]), atol=1e-5)


def test_save_and_load_keep_the_draft(tiny_pair, tmp_path):
    model = draft_for(tiny_pair, seed=1)
    path = model.save(tmp_path / "e3.safetensors", {"command": "test"})
    back = Eagle3.load(path, tiny_pair.target).float()
    seq = tiny_pair.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    feats = target_features(tiny_pair, model, seq)[None]
    with torch.no_grad():
        a = [model.logits(h) for h in model.forward_steps(torch.tensor([seq]), feats, 2)]
        b = [back.logits(h) for h in back.forward_steps(torch.tensor([seq]), feats, 2)]
    assert torch.equal(model.ids, back.ids)
    assert all(torch.allclose(x, y, atol=0.05) for x, y in zip(a, b))  # bf16 storage
    with pytest.raises(Exception, match="not found"):
        Eagle3.load(tmp_path / "missing.safetensors", tiny_pair.target)


@pytest.fixture(scope="module")
def tiny_responses(tmp_path_factory, tiny_pair):
    """A response shard as train.distill_data commits it: the tiny target's own greedy continuations."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from decode.loop import autoregressive

    folder = tmp_path_factory.mktemp("responses") / "tiny-responses"
    folder.mkdir()
    rows = {"prompt_id": [], "source": [], "temperature": [], "ids": [], "start": []}
    words = "def add return print the quick brown fox for in range list x y 1 2 3".split()
    for i in range(60):
        prompt = tiny_pair.tokenizer.encode(" ".join(words[(i * 7 + j) % len(words)] for j in range(5 + i % 7)),
                                            add_special_tokens=False)
        out = autoregressive(tiny_pair, prompt, 40).tokens
        for key, v in (("prompt_id", f"p{i}"), ("source", "mbpp" if i % 2 else "wikitext_qa"), ("temperature", 0.0),
                       ("ids", prompt + out), ("start", len(prompt))):
            rows[key].append(v)
    pq.write_table(pa.table(rows), folder / "shard-00000.parquet")
    return folder


@pytest.fixture(scope="module")
def trained(tiny_responses, tmp_path_factory):
    """An EAGLE-3 draft of the tiny target trained for 60 steps by python -m train.eagle (it agrees with the target
    on some tokens, so drafted tokens are both accepted and rejected)."""
    from tests.conftest import run_cli

    d = tmp_path_factory.mktemp("eagle3")
    r = run_cli("train.eagle", "pair=tiny_random", f"data.folders=[{tiny_responses}]", "data.min_positions=100",
                "train.batch_tokens=600", "train.warmup_steps=5", "train.lr=3e-3", "data.heldout_pct=20", "threads=1",
                f"run_dir={d / 'run'}", f"out={d / 'e3.safetensors'}", "train.max_steps=60")
    assert r.returncode == 0, r.stderr[-2000:]
    return d / "e3.safetensors"


@pytest.fixture
def eagle3_drafter(tiny_pair, trained):
    from decode.drafter import build_drafter

    path = trained

    def make(policy):
        return build_drafter("eagle3", tiny_pair, policy, {"weights": str(path)})

    make.path = path
    return make


def test_eagle3_chains_are_lossless_with_every_chain_policy(tiny_pair, eagle3_drafter):
    from decode.loop import autoregressive, speculative
    from decode.policies import build_policy

    eos = {tiny_pair.tokenizer.eos_token_id}
    drafted = accepted = 0
    for text in ("def add(a, b):\n    return", "The quick brown fox", "1, 2, 3, 1, 2, 3"):
        ids = tiny_pair.tokenizer.encode(text, add_special_tokens=False)
        ref = autoregressive(tiny_pair, ids, 30, eos=eos)
        for name, params in (("constant", {"k": 4}), ("svip", {}), ("max_confidence", {}), ("oracle", {}),
                             ("expected_value", {"score": "max_q"})):
            pol = build_policy(name, params, pair=tiny_pair)
            res = speculative(tiny_pair, ids, eagle3_drafter(pol), 30, eos=eos, lookahead=ref.tokens)
            assert res.tokens == ref.tokens, (name, text)
            assert res.rounds[0] == (0, 0)  # the prefill round drafts nothing: no features yet
            drafted, accepted = drafted + res.drafted, accepted + res.accepted
    assert drafted > accepted > 0


def test_eagle3_sampling_matches_target_law(tiny_pair, eagle3_drafter):
    """T = 1: the first two tokens follow the target's joint law; the second is drafted by EAGLE-3 (3 new tokens:
    round 1 is the prefill, round 2 drafts one token and verifies it)."""
    from decode.loop import speculative
    from decode.policies import build_policy
    from tests.conftest import law_chisquare, two_token_law

    ids = tiny_pair.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    joint = two_token_law(tiny_pair, ids)
    v = joint.shape[0]
    drafter = eagle3_drafter(build_policy("constant", {"k": 3}))
    n, counts, drafted = 800, torch.zeros(v, v, dtype=torch.float64), 0
    for s in range(n):
        res = speculative(tiny_pair, ids, drafter, 3, temperature=1.0, generator=torch.Generator().manual_seed(s))
        counts[res.tokens[0], res.tokens[1]] += 1
        drafted += res.drafted
    assert drafted == n  # every run drafted the second token
    bins, pvalue = law_chisquare(counts, joint, n)
    assert bins >= 3
    assert pvalue > 1e-3


def test_eagle3_plus_lookup_is_lossless_and_keeps_the_draft_on_the_targets_features(tiny_pair, trained):
    """eagle3+lookup: greedy output equals target-only under every chain policy, with rounds of both drafters; after
    rounds lookup drafted, the EAGLE-3 draft's cache and pending feed still hold every committed token once, each run
    on the target's own feature at the position before it (what one call over the whole sequence computes)."""
    from decode.drafter import build_drafter
    from decode.loop import autoregressive, speculative
    from decode.policies import build_policy

    eos = {tiny_pair.tokenizer.eos_token_id}
    rounds_by = {"lookup": 0, "eagle3": 0}
    for text in ("a b c d a b c d a b c", "def f(x):\n    return x\ndef g(x):\n    return", "The quick brown fox"):
        ids = tiny_pair.tokenizer.encode(text, add_special_tokens=False)
        ref = autoregressive(tiny_pair, ids, 40, eos=eos)
        for name, params in (("constant", {"k": 3}), ("svip", {}), ("expected_value", {"score": "max_q"})):
            d = build_drafter("eagle3+lookup", tiny_pair, build_policy(name, params, pair=tiny_pair),
                              {"inner_params": {"weights": str(trained)}})
            for key, part in (("lookup", d.lookup), ("eagle3", d.inner)):  # count each one's drafted rounds
                def counted(budget, res, propose=part.propose, key=key):
                    rnd = propose(budget, res)
                    rounds_by[key] += bool(rnd.tokens)
                    return rnd

                part.propose = counted
            res = speculative(tiny_pair, ids, d, 40, eos=eos, lookahead=ref.tokens)
            assert res.tokens == ref.tokens, (name, text)
            e = d.inner
            toks, _ = e.feed
            assert e.cache.length + len(toks) == len(e.seq) - 1 and e.seq[-len(toks):] == toks
            fresh = e.model.new_cache()
            feats = target_features(tiny_pair, e.model, e.seq)[: e.cache.length]
            with torch.no_grad():
                e.model.step(torch.tensor(e.seq[1: e.cache.length + 1]), e.model.fuse(feats), fresh)
            assert torch.allclose(e.cache.k[:, : e.cache.length].float(), fresh.k[:, : e.cache.length].float(), atol=1e-4)
    assert rounds_by["lookup"] > 0 and rounds_by["eagle3"] > 0


def test_eagle3_trees_are_lossless_with_the_builders(tiny_pair, eagle3_drafter):
    """Trees on EAGLE-3 (`eagle3` hands a builder to `eagle3_tree`): greedy output = the target's, with nodes both
    accepted and rejected, for EAGLE-2's builder, a static tree and Sequoia's."""
    from decode.drafter import for_policy
    from decode.loop import autoregressive, speculative
    from decode.policies import build_policy

    eos = {tiny_pair.tokenizer.eos_token_id}
    drafted = accepted = 0
    for text in ("def add(a, b):\n    return", "1, 2, 3, 1, 2, 3"):
        ids = tiny_pair.tokenizer.encode(text, add_special_tokens=False)
        ref = autoregressive(tiny_pair, ids, 30, eos=eos)
        for name, params in (("eagle2", {}), ("tree_static", {"max_depth": 4}), ("sequoia", {"rank_probs": [0.5, 0.2, 0.1], "max_nodes": 12, "max_depth": 5})):
            drafter = for_policy("eagle3", tiny_pair, build_policy(name, params, pair=tiny_pair),
                                 {"weights": str(eagle3_drafter.path)})
            assert drafter.name == "eagle3_tree"
            res = speculative(tiny_pair, ids, drafter, 30, eos=eos, lookahead=ref.tokens)
            assert res.tokens == ref.tokens, (name, text)
            drafted, accepted = drafted + res.drafted, accepted + res.accepted
    assert drafted > accepted > 0


def test_eagle3_tree_sampling_matches_target_law(tiny_pair, eagle3_drafter):
    """T = 1 through an EAGLE-2 tree on EAGLE-3 (SpecInfer's walk): the first two tokens follow the target's law."""
    from decode.drafter import for_policy
    from decode.loop import speculative
    from decode.policies import build_policy
    from tests.conftest import law_chisquare, two_token_law

    ids = tiny_pair.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    joint = two_token_law(tiny_pair, ids)
    v = joint.shape[0]
    drafter = for_policy("eagle3", tiny_pair, build_policy("eagle2", {"nodes": 4}, pair=tiny_pair),
                         {"weights": str(eagle3_drafter.path)})
    n, counts, drafted = 800, torch.zeros(v, v, dtype=torch.float64), 0
    for s in range(n):
        res = speculative(tiny_pair, ids, drafter, 3, temperature=1.0, generator=torch.Generator().manual_seed(s))
        counts[res.tokens[0], res.tokens[1]] += 1
        drafted += res.drafted
    assert drafted >= n  # every run verified a tree for the second token
    bins, pvalue = law_chisquare(counts, joint, n)
    assert bins >= 3
    assert pvalue > 1e-3


def test_train_eagle_learns_resumes_and_decodes_losslessly(cli, tiny_responses, tmp_path):
    import json

    out, run = tmp_path / "e3.safetensors", tmp_path / "run"
    args = ["train.eagle", "pair=tiny_random", f"data.folders=[{tiny_responses}]", "data.min_positions=100",
            "train.batch_tokens=600", "train.warmup_steps=5", "train.lr=3e-3", "data.heldout_pct=20", "threads=1",
            f"run_dir={run}", f"out={out}"]
    r = cli(*args, "train.max_steps=30")
    assert r.returncode == 0, r.stderr[-2000:]
    first = json.loads(out.with_suffix(".train.json").read_text())
    assert first["steps"] == 30 and first["ttt_steps"] == 3
    assert set(first["heldout_top1_agreement_by_step"]) >= {"all", "code", "qa"}
    assert len(first["heldout_top1_agreement_by_step"]["all"]) == 5
    import pandas as pd

    def losses():
        return pd.read_csv(run / "csv" / "metrics.csv").dropna(subset=["train/loss"])["train/loss"]

    start = losses().iloc[:2].mean()
    for want in (31, 32):  # a time budget is each invocation's own: a resumed run goes on even past the sum
        r = cli(*args, "train.max_steps=60", "train.max_minutes=0.00001")
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(out.with_suffix(".train.json").read_text())["steps"] == want
    r = cli(*args, "train.max_steps=60")  # the same run, continued
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming from" in r.stdout
    second = json.loads(out.with_suffix(".train.json").read_text())
    assert second["steps"] == 60
    assert losses().iloc[-2:].mean() < start  # it learns, across the resume
    kept = pd.read_csv(run / "csv" / "metrics-1.csv").dropna(subset=["train/loss"])["train/loss"]
    assert kept.iloc[:2].mean() == start  # each invocation's curve kept: metrics-1.csv is the first's
    dec = tmp_path / "dec"
    r = cli("decode", "pair=tiny_random", "dataset=mbpp", "split=test", "limit=3", "max_new_tokens=24", "threads=1",
            "plots=false", "drafters=[eagle3,student]", "policies=[constant,svip]", f"drafter.eagle3.weights={out}",
            f"out_dir={dec}")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((dec / "summary.json").read_text())
    assert all(summary[k]["lossless"] is True for k in ("eagle3/constant", "eagle3/svip"))
    assert summary["eagle3/constant"]["acceptance_rate"] > 0
    from models.pair import file_fingerprint  # which draft decoded a row: the weights' content, recorded per method

    assert summary["eagle3/svip"]["draft_weights"] == {"path": str(out), "fingerprint": file_fingerprint(out)}
    assert second["fingerprint"] == file_fingerprint(out)  # the json names its weights, built or not
    assert "draft_weights" not in summary["student/constant"]
    assert summary["eagle3/constant"]["measured_c"] != summary["student/constant"]["measured_c"]
    r = cli("eval.wall_gap", str(dec))  # the run's wall clock against its cost model, by part
    assert r.returncode == 0, r.stderr[-2000:]
    gap = json.loads((dec / "wall_gap.json").read_text())["methods"]
    assert set(gap) == set(summary)
    assert all(v["target_s"] > 0 and v["target_model_s"] > 0 and 0 <= v["draft_share"] < 1 for v in gap.values())
    assert gap["target"]["draft_share"] == 0 and gap["eagle3/constant"]["draft_share"] > 0
    # EAGLE-3's draft part is priced on its own curves, which its summary records (the student's on the pair's)
    assert "own_profile" in summary["eagle3/constant"] and "own_profile" not in summary["student/constant"]
    assert summary["eagle3/constant"]["own_profile"]["draft_ms"] != json.loads((dec / "run.json").read_text())[
        "cost_profile"]["draft_ms"]
    assert gap["eagle3/constant"]["draft_vs_model"] is not None and gap["student/svip"]["draft_vs_model"] is not None
    r = cli("eval.wall_gap", str(tmp_path))
    assert r.returncode == 2 and "no run.json" in r.stderr and "Traceback" not in r.stderr


def test_train_eagle_starts_from_a_saved_draft(cli, tiny_responses, trained, tmp_path):
    """init= begins a new run from a saved draft: at a zero learning rate its held-out agreement is the saved one's
    (up to the bf16 rounding of the saved weights), far above a fresh draft's; a draft of other layers is refused in
    one line, as is a missing file."""
    import json

    args = ["train.eagle", "pair=tiny_random", f"data.folders=[{tiny_responses}]", "data.min_positions=100",
            "train.batch_tokens=600", "train.warmup_steps=1", "train.lr=0", "data.heldout_pct=20", "threads=1",
            "train.max_steps=1"]
    out = tmp_path / "w.safetensors"
    r = cli(*args, f"run_dir={tmp_path / 'run'}", f"out={out}", f"init={trained}")
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(out.with_suffix(".train.json").read_text())
    saved = json.loads(trained.with_suffix(".train.json").read_text())
    assert info["init"] == str(trained) and info["steps"] == 1
    got, want = info["heldout_top1_agreement_by_step"]["all"], saved["heldout_top1_agreement_by_step"]["all"]
    assert abs(got[0] - want[0]) < 0.02
    r = cli(*args, f"run_dir={tmp_path / 'run0'}", f"out={tmp_path / 'fresh.safetensors'}")
    fresh = json.loads((tmp_path / "fresh.train.json").read_text())["heldout_top1_agreement_by_step"]["all"]
    assert fresh[0] < got[0] / 2 and fresh[1] < got[1] / 2
    r = cli(*args, f"run_dir={tmp_path / 'run2'}", f"out={tmp_path / 'x.safetensors'}", f"init={trained}",
            "model.layers=[1,1,1]")
    assert r.returncode != 0 and "init=" in r.stderr and "layers" in r.stderr and "Traceback" not in r.stderr
    r = cli(*args, f"run_dir={tmp_path / 'run3'}", f"out={tmp_path / 'y.safetensors'}", f"init={tmp_path / 'no'}")
    assert r.returncode != 0 and "no such EAGLE-3 weights" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "y.safetensors").exists()


def test_resumed_batches_go_on_where_the_steps_left_off():
    """The data position is a function of the optimizer steps alone: a run restored at step k iterates the batches an
    uninterrupted run would from step k on, across epoch boundaries (Lightning restores a run stopped by its time
    budget as a finished epoch, so its epoch counter cannot say where the data was)."""
    from train.eagle import ResumableBatches

    sampler = ResumableBatches([3, 5, 2, 7, 4, 6, 1, 8, 5, 3], tokens=10, seed=4)
    n = len(sampler.batches)
    straight = []
    for epoch in range(3):
        sampler.step_of = lambda e=epoch: e * n
        straight += list(sampler)
    assert len(straight) == 3 * n and straight[:n] != straight[n : 2 * n]  # each epoch its own order
    for k in (0, 3, n, n + 2, 2 * n - 1):
        sampler.step_of = lambda k=k: k
        assert len(sampler) == n - k % n
        assert list(sampler) == straight[k : (k // n + 1) * n]


def test_eagle_chain_traces_replay_what_decode_runs(tmp_path, tiny_pair, trained):
    """trace=eagle_chain (data_gen.eagle_traces): per start position the chain EAGLE-3 drafts from there. A replay of
    those rows (eval.replay's rounds) runs the rounds decode runs with the EAGLE-3 drafter (each round starts where
    decode's does; past a round's first rejection the rows read the target's token, not the rejected one — here the
    policies' decisions there agree): the same (drafted,
    accepted) per round for stop policies that read q, with the trace's step-0 rows reading what decode's rounds
    read — and reach weights, round positions and continuations read (start, step), not the row order."""
    import numpy as np
    from hydra import compose, initialize_config_dir

    from data_gen.labels import make_weights
    from data_gen.run import generate
    from data_gen.store import load_traces
    from decode.loop import speculative
    from decode.policies import build_policy
    from eval.continuations import load_continuations
    from eval.replay_rounds import replay_one
    from models.features.trace import continuation_starts, trace_round_positions
    from tests.conftest import REPO

    import shutil

    from utils.cli import UserError

    weights = tmp_path / "e3.safetensors"
    shutil.copy(trained, weights)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("data_gen", ["pair=tiny_random", "dataset=mbpp", f"trace_root={tmp_path}", "progress=false",
                                   "trace=eagle_chain", f"trace.weights={weights}", "trace.steps=4",
                                   "trace.max_new_tokens=20", "max_prompt_tokens=40", "limit=3", "split=train"])
    folder = generate(cfg, "train", tiny_pair)
    ds, manifest = load_traces(folder)
    assert manifest["drafter"] == "eagle3" and manifest["hidden_size"] == 2 * tiny_pair.target.config.hidden_size
    assert manifest["cost_profile"]["key"]["drafter"] == "eagle3"  # rounds priced on EAGLE-3's own step
    cols = {k: np.asarray(v) for k, v in ds.with_format("numpy")[:].items()}
    assert (trace_round_positions(cols) == cols["step"]).all()
    assert continuation_starts(cols).sum() == 3
    w = make_weights(cols, {"name": "greedy_match", "reach_weight": 0.0})  # 1 where every earlier step matched
    ok = cols["draft_token"] == cols["target_token"]
    reach = [all(ok[i - j : i]) for i, j in enumerate(cols["step"])]
    assert w.tolist() == [float(r) for r in reach] and 0 < sum(reach) < len(reach)
    conts, _, _ = load_continuations(folder)
    eos = {tiny_pair.tokenizer.eos_token_id}
    compared = 0
    for cont in conts:
        prompt = [int(x) for x in ds.filter(lambda r: r["prompt_id"] == cont.prompt_id)[0]["prompt_tokens"]]
        n = len(cont.target_path)
        for name, params in (("constant", {"k": 3}), ("max_confidence", {"lam": 0.3})):
            dec = speculative(tiny_pair, prompt, _drafter(tiny_pair, trained, name, params), n, eos=eos)
            assert dec.tokens[:n] == cont.target_path.tolist()
            rep = replay_one(build_policy(name, params, pair=tiny_pair), cont)
            assert rep == dec.rounds, (name, cont.prompt_id)
            compared += len(rep)
    assert compared > 10
    draft_for(tiny_pair, seed=5).save(weights, {})  # another draft at the same path: its traces are not these
    with pytest.raises(UserError, match="another config"):
        generate(cfg, "train", tiny_pair)


def _drafter(pair, weights, name, params):
    from decode.drafter import build_drafter
    from decode.policies import build_policy

    return build_drafter("eagle3", pair, build_policy(name, params, pair=pair), {"weights": str(weights)})


def test_a_head_trained_on_eagle_traces_decodes_as_it_replays(tmp_path, tiny_pair, trained):
    """`python -m train` on trace=eagle_chain traces records the drafter in the head; EAGLE-3 runs it (reading
    [its output ‖ the round's start feature], as the traces store it) with the rounds the replay of the same head
    gives, and the student refuses it in one line."""
    from decode.drafter import build_drafter
    from decode.loop import speculative
    from decode.policies import build_policy
    from eval.continuations import load_continuations
    from eval.replay_rounds import replay_one
    from models.heads import load_head
    from tests.conftest import run_cli
    from utils.cli import UserError

    run = tmp_path / "run"
    r = run_cli("train", "+experiment=smoke", "trace=eagle_chain", f"trace.weights={trained}", "trace.steps=6",
                "logger=none", f"trace_root={tmp_path / 'traces'}", f"hydra.run.dir={run}", "model=disco_plus",
                "model.groups=[hidden]")
    assert r.returncode == 0, r.stderr[-2000:]
    ckpt = run / "checkpoints" / "best.ckpt"
    bundle = load_head(ckpt)
    assert bundle.drafter == "eagle3" and bundle.spec.reads_hidden
    spec = f"learned:{ckpt}"
    params = {"threshold": 0.02, "rule": "threshold", "max_len": 6}  # the traces hold 6 steps per round
    with pytest.raises(UserError, match="trained on eagle3's traces"):
        build_drafter("student", tiny_pair, build_policy(spec, params, pair=tiny_pair))
    from omegaconf import OmegaConf

    from decode.methods import Method, with_drafters

    side_by_side = with_drafters([Method("learned", spec, params)], OmegaConf.create({"drafters": ["student", "eagle3"]}))
    assert [m.key for m in side_by_side] == ["eagle3/learned"]  # the student's pairing left out, not a failed run
    folder = next((tmp_path / "traces").glob("*--test-*"))
    conts, _, _ = load_continuations(folder)
    from data_gen.store import load_traces

    ds, _ = load_traces(folder)
    rounds = 0
    for cont in conts:
        prompt = [int(x) for x in ds.filter(lambda row: row["prompt_id"] == cont.prompt_id)[0]["prompt_tokens"]]
        n = len(cont.target_path)
        drafter = build_drafter("eagle3", tiny_pair, build_policy(spec, params, pair=tiny_pair),
                                {"weights": str(trained)})
        dec = speculative(tiny_pair, prompt, drafter, n, eos={tiny_pair.tokenizer.eos_token_id})
        assert dec.rounds == replay_one(build_policy(spec, params, pair=tiny_pair), cont)
        rounds += sum(1 for k, _ in dec.rounds if k > 1)
    assert rounds > 0  # the head let some rounds run past one token


@pytest.mark.parametrize("name", ["eagle2", "learned_tree"])
def test_eagle_tree_traces_replay_what_decode_runs(tiny_pair, trained, name):
    """trace=eagle_tree (data_gen.eagle_traces.eagle_tree_batch): the candidate trees EAGLE-3 grows at every position
    of the target's continuation, fed as decode's eagle3_tree feeds it (committed tokens with the target's features,
    nodes with their parents' outputs). Replayed (eval.tree_replay), a builder's rounds are decode's — tokens per
    round and verified nodes, the first round drafting nothing in both — and a node head marked as trained on
    EAGLE-3's trees runs there (decode computing its inputs from its own tree, the replay reading the rows')."""
    import numpy as np
    from omegaconf import OmegaConf

    from data_gen.eagle_traces import eagle_tree_batch
    from data_gen.traces import Item
    from decode.drafter import build_drafter
    from decode.learned_trees import LearnedTree
    from decode.loop import speculative
    from decode.tree_builders import Eagle2
    from eval.tree_replay import candidates_from_columns, replay
    from models.features.spec import feature_kind
    from tests.test_decode import make_head
    from tests.test_decode_tree import _profile

    prof = _profile(slope=0.0, c=0.05)
    texts = ("import os\nclass A:", "def f(x):", "x = [1, 2, 3]\nprint(x)")  # 16 tokens before the tiny target's EOS
    items = [Item(f"p{i}", "test", "tree", tiny_pair.tokenizer.encode(t)) for i, t in enumerate(texts)]
    cfg = OmegaConf.create({"kind": "eagle_tree", "weights": str(trained), "max_new_tokens": 16, "tree_topk": 3,
                            "tree_depth": 3})
    rows = eagle_tree_batch(tiny_pair, items, cfg)
    cols = {k: np.concatenate([np.asarray(r[k]) if np.ndim(r[k]) else np.repeat(r[k], r["n"]) for r in rows])
            for k in rows[0] if k != "n"}
    cands = candidates_from_columns(cols)
    for c in cands:
        c.first_empty = True
    scores, make = None, lambda: Eagle2(topk=3, max_depth=3, max_nodes=12, profile=prof)
    if name == "learned_tree":
        bundle = make_head(tiny_pair, "tree_node", seed=1)
        bundle.drafter = "eagle3"
        bundle.calibration = {"temperature": 0.3, "bias": 1.0, "mode": "platt"}  # spread the random head's scores
        scores = bundle.prob(feature_kind("tree_node").from_columns(cols, bundle.spec)).reshape(-1).double().numpy()
        make = lambda: LearnedTree(bundle=bundle, topk=3, max_depth=3, max_nodes=12, profile=prof)  # noqa: E731
    accepted = 0
    for it, cand, rep in zip(items, cands, replay(make(), cands, prof, scores, name)):
        builder = make()
        drafter = build_drafter("eagle3_tree", tiny_pair, builder, {"weights": str(trained)})
        dec = speculative(tiny_pair, it.prefix, drafter, 16, eos={tiny_pair.tokenizer.eos_token_id})
        assert len(dec.tokens) == cand.n and dec.rounds[0] == (0, 0) and rep["levels"][0] == 0
        emitted, t = [], 0
        for k, n in dec.rounds:
            emitted.append(min(n + 1, cand.n - t))
            t += emitted[-1]
        # past the rounds grown to full depth decode grows no deeper than the tokens left (the recorded trees are
        # full-depth), so a selection there may differ
        full = [i for i, e in enumerate(np.cumsum([0] + emitted[:-1])) if cand.n - e - 1 >= builder.max_depth]
        assert len(full) > 2
        assert rep["tokens"][: len(full)] == emitted[: len(full)] and sum(rep["tokens"]) == cand.n
        assert [rep["nodes"][i] for i in full] == [dec.rounds[i][0] for i in full]
        accepted += sum(rep["accepted"])
    assert accepted > 0
    bundle = make_head(tiny_pair, "tree_node", seed=1)  # a head of the student's trees: refused on EAGLE-3's
    with pytest.raises(Exception, match="trained on student's traces"):
        build_drafter("eagle3_tree", tiny_pair, LearnedTree(bundle=bundle, topk=3, max_depth=3, max_nodes=12,
                                                            profile=prof), {"weights": str(trained)})


def test_the_pair_names_its_eagle3_weights(tiny_pair, trained):
    """Drafters eagle3 / eagle3_tree with no `weights` load the pair's `eagle3.weights` (the default pair's and the
    1.5B pair's yaml name theirs); a pair that names none is refused in one line naming both ways out."""
    import copy

    from omegaconf import OmegaConf

    from decode.drafter import build_drafter
    from decode.policies import build_policy
    from utils.cli import UserError

    with pytest.raises(UserError, match="names no EAGLE-3 draft.*drafter.eagle3.weights=PATH"):
        build_drafter("eagle3", tiny_pair, build_policy("constant"))
    named = copy.copy(tiny_pair)
    named.cfg = OmegaConf.merge(tiny_pair.cfg, {"eagle3": {"weights": str(trained)}})
    for name in ("eagle3", "eagle3_tree"):
        policy = build_policy("constant") if name == "eagle3" else build_policy("eagle2", {"nodes": 4}, pair=tiny_pair)
        assert build_drafter(name, named, policy).weights == str(trained)
    for pair in ("smollm2_135m", "qwen_coder_1.5b_eagle3"):
        assert OmegaConf.load(f"conf/pair/{pair}.yaml").eagle3.weights.startswith("models/weights/")


def test_a_pair_gives_its_eagle3_draft_its_own_reduced_vocabulary(tiny_pair, tmp_path):
    """`pair.eagle3.vocab_subset` of `pair.eagle3.vocab_freq` (train.vocab_subset's file) is the EAGLE-3 head's
    vocabulary (the 1.5B pair's self-draft has none to lend), EOS always in it; without the file, one line."""
    import copy
    import json

    from omegaconf import OmegaConf

    from train.eagle import subset_ids
    from utils.cli import UserError

    freq = tmp_path / "freq.json"
    freq.write_text(json.dumps({"ids_by_frequency": list(range(tiny_pair.vocab_size - 1, -1, -1))}))
    pair = copy.copy(tiny_pair)
    pair.cfg = OmegaConf.merge(tiny_pair.cfg, {"eagle3": {"vocab_subset": 10, "vocab_freq": str(freq)}})
    ids = subset_ids(pair).tolist()
    top = set(range(tiny_pair.vocab_size - 10, tiny_pair.vocab_size))
    assert top <= set(ids) and set(ids) - top <= set(tiny_pair.eos_ids) | set(tiny_pair.tokenizer.all_special_ids)
    pair.cfg = OmegaConf.merge(tiny_pair.cfg, {"eagle3": {"vocab_subset": 10}})
    with pytest.raises(UserError, match="needs pair.eagle3.vocab_freq"):
        subset_ids(pair)


def test_eagle3_profile_times_its_calls_after_a_target_pass(tiny_pair):
    """draft_profile replaces the pair's draft curves with EAGLE-3's own, timed as the loop runs them (after a
    target pass and, for the later calls, a round's first call): every curve the cost model reads is there, of the
    pair profile's lengths, positive, and the profile says whose it is."""
    from models.eagle3_pair import draft_profile
    from models.lm import LM
    from models.profiling import get_profile

    prof = get_profile(tiny_pair)
    own = draft_profile(draft_for(tiny_pair), "tiny-test", prof, LM.of(tiny_pair, "target"))
    assert own.key["drafter"] == "eagle3" and own.target_ms == prof.target_ms
    assert len(own.draft_ms) == len(prof.draft_ms) and len(own.draft_level_ms) == len(prof.draft_level_ms)
    assert len(own.prefill_draft_ms) == len(prof.prefill_draft_ms)
    assert own.draft_cold_ms > 0 and min(own.draft_ms + own.draft_level_ms + own.prefill_draft_ms) > 0


def test_tree_ceiling_ranks_eagle3_by_its_first_draft_call(tiny_pair, trained, cli, tmp_path):
    """eval.tree_ceiling draft=eagle3: its logits for a continuation token are a round's first draft call's (the
    cached drafting step on the target's features two positions back, -inf off the subset), and the command writes
    a ceiling for EAGLE-3 priced on its own draft curves."""
    import json

    from eval.tree_ceiling import eagle_logits

    model = draft_for(tiny_pair)
    seq = tiny_pair.tokenizer.encode("def add(a, b):\n    return a + b\nprint(add(1, 2))", add_special_tokens=False)
    T, n = len(seq), 5
    with torch.no_grad():
        full = eagle_logits(tiny_pair, model, seq, n)
        feats = target_features(tiny_pair, model, seq)
        z = model.logits(model.step(torch.tensor(seq[1:]), model.fuse(feats[:-1]), model.new_cache()))
    assert full.shape == (n, tiny_pair.vocab_size) and torch.isneginf(full).sum() == n * (tiny_pair.vocab_size - 60)
    assert torch.allclose(full[:, model.ids], z[T - n - 2 : T - 2], atol=1e-5)
    out = tmp_path / "ceiling"
    r = cli("eval.tree_ceiling", "pair=tiny_random", "draft=eagle3", f"eagle3_weights={trained}", "prompts=2",
            "tokens=8", "max_rank=4", "max_nodes=6", f"+pair.cache_dir={tmp_path}/cache", "profile.max_n=3",
            "profile.repeats=1", "profile.warmup=0", "profile.context=16", "profile.prefill_lengths=[8]",
            f"out_dir={out}", f"hydra.run.dir={tmp_path}/run")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "ceiling.json").read_text())
    assert res["draft"] == "eagle3" and sum(res["rank_vector"]) + res["beyond"] == pytest.approx(1.0)
    bad = cli("eval.tree_ceiling", "pair=tiny_random", "draft=lookup", f"hydra.run.dir={tmp_path}/run2")
    assert bad.returncode != 0 and "draft=lookup" in bad.stderr and "Traceback" not in bad.stderr
