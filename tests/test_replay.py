"""eval.replay: replaying a policy on greedy traces gives the decoder's own rounds where the replay is exact (policies
that do not read the draft's features after a rejection), the cost-model numbers follow from those rounds, and the
synthetic heads have the AUROC they are asked for."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import REPO
from utils.files import read_jsonl
from utils.cli import UserError

N_PROMPTS, NEW = 3, 16


def cfg_of(name, *overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(name, list(overrides))


@pytest.fixture(scope="module")
def traces(tmp_path_factory, tiny_pair):
    from data_gen.run import generate

    root = tmp_path_factory.mktemp("replay_traces")
    out = {}
    for split in ("validation", "test"):
        cfg = cfg_of("data_gen", "pair=tiny_random", "dataset=mbpp", f"trace_root={root}", "progress=false",
                     f"trace.max_new_tokens={NEW}", f"split={split}", f"limit={N_PROMPTS}")
        out[split] = generate(cfg, split, tiny_pair)
    sampled = cfg_of("data_gen", "pair=tiny_random", "dataset=mbpp", f"trace_root={root}", "progress=false",
                     "trace.max_new_tokens=4", "trace.temperature=1.0", "split=test", "limit=1")
    out["sampled"] = generate(sampled, "test", tiny_pair)
    return out


def test_rounds_equal_decoding(traces, tiny_pair, tmp_path):
    """Constant K and the oracle never read features after a rejection, so their replayed rounds are the decoder's.
    A threshold rule sees the decoder's features up to a round's first rejection: its accepted counts are exact in every
    round and its draft length wherever it stopped by that rejection (k ≤ n + 1); beyond, the replay approximates."""
    from decode.policies import build_policy
    from decode.runner import main as decode
    from eval.continuations import load_continuations
    from eval.replay import replay_one

    params = {"constant": {"k": 3}, "oracle": {}, "svip": {"h": 0.9}, "max_confidence": {"lam": 0.2}}
    decode(cfg_of("decode", "pair=tiny_random", "dataset=mbpp", "split=test", f"limit={N_PROMPTS}",
                  f"max_new_tokens={NEW}", "plots=false", "warmup=false", "++policy.constant.k=3", "++policy.svip.h=0.9",
                  "++policy.max_confidence.lam=0.2", f"policies=[{','.join(params)}]", f"out_dir={tmp_path}"))
    rows = read_jsonl(tmp_path / "prompts.jsonl")
    conts, _, _ = load_continuations(traces["test"])
    assert len(conts) == N_PROMPTS
    past = 0
    for method, p in params.items():
        decoded = [[tuple(r) for r in row["rounds"]] for row in rows if row["method"] == method]
        replayed = [replay_one(build_policy(method, p), c) for c in conts]
        if method in ("constant", "oracle"):
            assert replayed == decoded, method
            continue
        for dec, rep in zip(decoded, replayed):
            assert [n for _, n in rep] == [n for _, n in dec], method
            for (kd, n), (kr, _) in zip(dec, rep):
                assert (kd <= n + 1) == (kr <= n + 1) and (kd == kr or kd > n + 1), method
                past += kd > n + 1
    assert past > 0  # some rounds did draft past their first rejection, so the last check had something to check
    oracle = [replay_one(build_policy("oracle", {}), c) for c in conts]
    assert all(k - n <= 1 for rs in oracle for k, n in rs)  # the oracle drafts at most the one rejected token
    assert any(n > 0 for rs in oracle for _, n in rs)  # some drafted tokens were accepted


def test_replay_table_synthetic_heads_and_bad_input(traces, tmp_path):
    from eval.replay import run
    from eval.replay_report import gap_closed

    base = ["+experiment=study/disco_mbpp", "pair=tiny_random", f"replay.tune={traces['validation']}",
            f"replay.eval={traces['test']}", "policies=[constant,static_opt,svip,max_confidence,oracle,hf_assisted]",
            "tune.grid.static_opt.k=[1,2,3]", "replay.c=0.3", "replay.synthetic_auroc=[0.7,0.99]"]
    res = run(cfg_of("replay", *base, f"replay.out_dir={tmp_path / 'r'}"))
    table = res["eval"]
    assert res["chosen"]["static_opt"]["k"] in (1, 2, 3) and res["skipped"] == {"hf_assisted": "runs transformers' own loop"}
    # every method generates every token of every continuation, whatever its rounds
    assert len({r["tokens"] for r in table.values()}) == 1
    # cost model by hand: tokens ÷ (rounds + c · drafted), rounds = tokens ÷ mean accepted length
    r = table["svip"]
    rounds = r["tokens"] / r["mean_accepted_length"]
    assert r["cost_model_speedup"] == pytest.approx(r["tokens"] / (rounds + 0.3 * r["draft_calls_per_token"] * r["tokens"]))
    assert res["gap"] == gap_closed(table)
    t = {"static_opt": {"cost_model_speedup": 1.2}, "oracle": {"cost_model_speedup": 1.6}, "h": {"cost_model_speedup": 1.3}}
    assert gap_closed(t) == {"h": pytest.approx(0.25)}
    assert gap_closed({**t, "oracle": {"cost_model_speedup": 1.1}}) == {}  # no gap to close
    assert table["synthetic[auroc=0.99]"]["realised_auroc"] > table["synthetic[auroc=0.7]"]["realised_auroc"]
    # the scores' AUROC, recomputed from the trace files without the replay's code
    from data_gen.store import load_traces
    from sklearn.metrics import roc_auc_score

    cols = load_traces(traces["test"])[0].with_format("numpy")[:]
    y = np.asarray(cols["draft_token"]) == np.asarray(cols["target_token"])
    assert table["svip"]["score_auroc"] == pytest.approx(roc_auc_score(y, -np.asarray(cols["draft_entropy"])))
    assert table["max_confidence"]["score_auroc"] == pytest.approx(roc_auc_score(y, np.stack(cols["draft_topk"])[:, 0]))
    assert table["static_opt"]["score_auroc"] is None
    for f in ("replay.json", "replay.md", "replay_auroc.png", "tuned.json"):
        assert (tmp_path / "r" / f).is_file()

    # tuned.json drives a real decode of the eval prompts; replay.compare then sets replayed against decoded counts:
    # accepted lengths agree exactly for stateless policies, draft calls too where nothing reads past a rejection
    from decode.runner import main as decode

    decode(cfg_of("decode", "pair=tiny_random", "dataset=mbpp", "split=test", f"limit={N_PROMPTS}",
                  f"max_new_tokens={NEW}", "plots=false", "warmup=false", f"tuned={tmp_path / 'r' / 'tuned.json'}",
                  "policies=[static_opt,svip,max_confidence,oracle]", f"out_dir={tmp_path / 'dec'}"))
    cmp = run(cfg_of("replay", *base, f"replay.compare={tmp_path / 'dec'}", f"replay.out_dir={tmp_path / 'r2'}"))["compare"]
    assert set(cmp) == {"static_opt", "svip", "max_confidence", "oracle"}
    for r in cmp.values():
        assert r["mean_accepted_length_replay"] == pytest.approx(r["mean_accepted_length_decode"])
    for k in ("static_opt", "oracle"):
        assert cmp[k]["draft_calls_per_token_replay"] == pytest.approx(cmp[k]["draft_calls_per_token_decode"])
    assert "Replayed vs decoded" in (tmp_path / "r2" / "replay.md").read_text()
    # the decode run's measured cost profile drives the replay's cost model when given instead of a constant c
    prof = run(cfg_of("replay", *base, "replay.c=null", f"replay.c_from={tmp_path / 'dec' / 'run.json'}",
                      "replay.synthetic_auroc=[]", f"replay.out_dir={tmp_path / 'r3'}"))
    assert prof["settings"]["c_from"].startswith("cost profile of")
    assert prof["settings"]["cost_profile"]["target_ms"] == json.loads(
        (tmp_path / "dec" / "run.json").read_text())["cost_profile"]["target_ms"]
    # draft_scale: the same profile with a costlier draft; the target's curve untouched, the draft steps doubled
    dbl = run(cfg_of("replay", *base, "replay.c=null", f"replay.c_from={tmp_path / 'dec' / 'run.json'}",
                     "replay.draft_scale=2", "replay.synthetic_auroc=[]", f"replay.out_dir={tmp_path / 'r4'}"))
    assert dbl["settings"]["c"] == pytest.approx(2 * prof["settings"]["c"])
    assert dbl["settings"]["cost_profile"]["target_ms"] == prof["settings"]["cost_profile"]["target_ms"]
    assert dbl["eval"]["oracle"]["cost_model_speedup"] < prof["eval"]["oracle"]["cost_model_speedup"]
    with pytest.raises(UserError, match="draft_scale must be > 0"):
        run(cfg_of("replay", *base, "replay.draft_scale=0", f"replay.out_dir={tmp_path / 'x'}"))

    with pytest.raises(UserError, match="no summary.json"):
        run(cfg_of("replay", *base, f"replay.compare={tmp_path / 'nowhere'}", f"replay.out_dir={tmp_path / 'x'}"))
    with pytest.raises(UserError, match="greedy target_ar"):
        run(cfg_of("replay", *base, f"replay.eval={traces['sampled']}", f"replay.out_dir={tmp_path / 'x'}"))
    with pytest.raises(UserError, match="cost ratio"):
        run(cfg_of("replay", *base, "replay.c=null", f"replay.out_dir={tmp_path / 'x'}"))
    with pytest.raises(UserError, match="strictly between 0 and 1"):
        run(cfg_of("replay", *base, "replay.synthetic_auroc=[0.9,1.0]", f"replay.out_dir={tmp_path / 'x'}"))
    with pytest.raises(UserError, match="trace folders"):
        run(cfg_of("replay", *base, "replay.tune=null", f"replay.out_dir={tmp_path / 'x'}"))
    assert not (tmp_path / "x").exists()  # a refused run writes nothing


def test_synthetic_scores_have_the_asked_auroc():
    from sklearn.metrics import roc_auc_score

    from eval.continuations import Continuation
    from eval.replay import synthetic_scores

    rng = np.random.default_rng(0)
    y = rng.random(20000) < 0.6
    cont = Continuation(None, None, None, y.astype(np.int64), np.ones(len(y), dtype=np.int64))
    for a in (0.6, 0.8, 0.95):
        s = synthetic_scores([cont], a, seed=1)[0]
        assert roc_auc_score(y, s) == pytest.approx(a, abs=0.01)


def test_cli_refuses_a_training_experiment(cli):
    r = cli("eval.replay", "+experiment=disco_mbpp", "replay.c=0.3")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        r.stderr.strip().splitlines()[-1]] and "trains a head" in r.stderr


def test_replay_logger_wandb_offline_run_holds_the_table(tmp_path):
    """eval.replay with logger=wandb: what run() hands to decode.wandb_log (its replay.json dict) lands in an offline
    run under replay.out_dir as the replay table and the synthetic-head curve."""
    from decode import wandb_log
    from tests.test_decode import wandb_run_dir, wandb_table

    row = {"cost_model_speedup": 1.2, "acceptance_rate": 0.5, "mean_accepted_length": 2.0, "draft_calls_per_token": 0.6,
           "mean_draft_length": 2.5, "past_rejection": 0.1}
    result = {"settings": {"c": 0.3}, "chosen": {"svip": {"h": 0.3}}, "gap": {"svip": 0.2},
              "eval": {"constant": row, "svip": {**row, "cost_model_speedup": 1.3, "score_auroc": 0.8},
                       "synthetic[auroc=0.8]": {**row, "realised_auroc": 0.79}}}
    out = tmp_path / "r"
    cfg = cfg_of("replay", "+experiment=study/disco_mbpp", "logger=wandb", f"replay.out_dir={out}")
    with wandb_log.session(cfg, out, "replay"):
        wandb_log.log_replay(result, out)
    run_dir = wandb_run_dir(out)
    table = wandb_table(run_dir, "replay/table")
    got = {r[0]: dict(zip(table["columns"], r)) for r in table["data"]}
    assert set(got) == set(result["eval"])
    assert got["svip"]["cost_model_speedup"] == 1.3 and got["svip"]["score_auroc"] == 0.8
    assert got["synthetic[auroc=0.8]"]["score_auroc"] == 0.79  # a synthetic head's realised AUROC
    assert wandb_table(run_dir, "replay/speedup_vs_auroc_table")["data"] == [[0.79, 1.2]]


def test_grid_is_a_product_space_or_a_union_of_them():
    """tune.grid.<policy> with `also`: the points of several product spaces joined, repeats dropped, every swept key
    known."""
    from omegaconf import OmegaConf

    from decode.methods import Method
    from decode.tune import grid_params, tune_grid

    cfg = OmegaConf.create({"tune": {"grid": {"learned": {"threshold": [None, 0.5],
                                                          "also": [{"rule": ["expected_value"], "b": [0.0, 1.0]},
                                                                   {"threshold": [0.5]}]},
                                              "svip": {"h": [0.2, 0.3]}}}})
    methods = [Method("learned", "learned:x.ckpt", {"rule": "auto"}), Method("svip", "svip", {}), Method("oracle", "oracle", {})]
    keys = [m.key for m in tune_grid(cfg, methods)]
    assert keys == ["learned[threshold=None]", "learned[threshold=0.5]", "learned[rule=expected_value,b=0.0]",
                    "learned[rule=expected_value,b=1.0]", "svip[h=0.2]", "svip[h=0.3]", "oracle"]
    assert grid_params(OmegaConf.to_container(cfg.tune.grid)["learned"]) == ["threshold", "rule", "b"]
    assert [m.key for m in tune_grid(cfg, methods, untuned=False)][-1] == "svip[h=0.3]"


def test_drafters_replay_as_they_decode(traces, cli, tmp_path):
    """A drafter defined in a test file (tests/test_drafters.py Toy) and prompt lookup, picked up by their yamls in
    both `python -m decode` and `python -m eval.replay`: neither needs the draft LM, so the replay's rounds are
    the decoder's and so is every summary number built from them; student+lookup replays with the traces' greedy
    student chains inside it, which are the chains its student drafts in decode."""
    conf = tmp_path / "conf" / "drafter"
    conf.mkdir(parents=True)
    (conf / "toy.yaml").write_text("_target_: test_drafters.Toy\nk: 3\n")
    common = ["pair=tiny_random", "dataset=mbpp", "drafters=[toy,lookup,student+lookup]", "policies=[constant,svip]",
              "policy.constant.k=3", f"hydra.searchpath=[file://{tmp_path / 'conf'}]"]
    r = cli("decode", *common, "split=test", f"limit={N_PROMPTS}", f"max_new_tokens={NEW}", "plots=false",
            "warmup=false", "threads=1", f"out_dir={tmp_path / 'dec'}")
    assert r.returncode == 0, r.stderr[-2000:]
    r = cli("eval.replay", *common, f"replay.tune={traces['validation']}", f"replay.eval={traces['test']}",
            "replay.c=0.3", "replay.synthetic_auroc=[]", f"replay.out_dir={tmp_path / 'rep'}")
    assert r.returncode == 0, r.stderr[-2000:]
    decoded = json.loads((tmp_path / "dec" / "summary.json").read_text())
    replayed = json.loads((tmp_path / "rep" / "replay.json").read_text())["eval"]
    for key in ("toy/constant", "toy/svip", "lookup/constant", "lookup/svip", "student+lookup/constant",
                "student+lookup/svip"):
        assert decoded[key]["lossless"] is True
        assert replayed[key]["mean_accepted_length"] == pytest.approx(decoded[key]["mean_accepted_length"]), key
        assert replayed[key]["acceptance_rate"] == pytest.approx(decoded[key]["acceptance_rate"]), key


def test_synthetic_heads_read_eagle_chain_rows_by_round():
    """On an eagle_chain continuation (one row per round start and step, each its own agreement) a synthetic head of
    AUROC → 1 stops every round at its first rejected step: its scores are read by (start, step), not by position."""
    import torch
    from scipy.stats import norm

    from eval.continuations import _chains
    from eval.replay import SyntheticHead, synthetic_scores
    from eval.replay_rounds import replay_one

    rng = np.random.default_rng(0)
    n, K = 14, 4
    start, step = np.repeat(np.arange(n), K), np.tile(np.arange(K), n)
    start, step = start[start + step < n], step[start + step < n]
    path = rng.integers(0, 5, n)
    ok = rng.random(len(start)) < 0.8
    cols = {"start": start, "step": step, "target_token": path[start + step],
            "draft_token": np.where(ok, path[start + step], 9), "prompt_id": np.array(["p"] * len(start))}
    cont = _chains(cols, torch.zeros(len(start), 3), torch.zeros(len(start)), None, 0, len(start))
    auroc = 1 - 1e-12
    (scores,) = synthetic_scores([cont], auroc, seed=0)
    head = SyntheticHead(threshold=np.sqrt(2.0) * norm.ppf(auroc) / 2, max_len=K)
    want, t = [(0, 0)], 1  # EAGLE-3's first round drafts nothing
    while t < n:
        k = 0
        for j in range(min(K, n - t - 1)):
            k += 1
            if not ok[cont.rows[t, j]]:
                break
        acc = k if all(ok[cont.rows[t, j]] for j in range(k)) else k - 1
        want.append((k, acc))
        t += acc + 1
    assert replay_one(head, cont, synthetic=scores) == want
    assert any(a == k - 1 for k, a in want) and any(a == k > 0 for k, a in want)
