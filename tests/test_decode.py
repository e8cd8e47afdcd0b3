"""The speculative loop on the tiny pair: lossless greedy for every exact policy, exact sampling law, SPRINTER,
features identical to data_gen's teacher-forced ones, the CLI and its one-line errors; a `real` MBPP check."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from decode.loop import autoregressive, speculative
from models.lm import LM
from decode.learned import Learned, Sprinter
from decode.policies import StopPolicy, build_policy
from models.distributions import draft_probs, entropy, topk_probs
from models.features.spec import FeatureSpec
from utils.files import read_jsonl

PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "x = [i * i for i in range(10)]\nprint("]


pytestmark = pytest.mark.usefixtures("one_thread")


def ids_of(pair, text):
    return pair.tokenizer.encode(text, add_special_tokens=False)


def make_head(pair, kind: str, threshold: float = 0.5, seed: int = 0):
    from models.heads import HeadBundle, build_head

    if kind in ("disco", "c2t", "tree_node", "tree_node_plus"):  # a chain DISCO head, or a token-tree node head
        spec = FeatureSpec(kind)
    else:
        spec = FeatureSpec("hidden", d=int(pair.draft.config.hidden_size))
    torch.manual_seed(seed)
    head = build_head(kind, spec).eval()
    return HeadBundle(head=head, kind=kind, spec=spec, labels={"name": "greedy_match"}, threshold=threshold,
                      pair_id=pair.pair_id, tokenizer_hash=pair.tokenizer_hash)


def save_head(bundle, path):
    torch.save({"specstop": bundle.meta(), "state_dict": {f"head.{k}": v for k, v in bundle.head.state_dict().items()}},
               path)
    return path


class FixedVerifier:
    """A SPRINTER verifier stub that always returns the same acceptance probability."""

    def __init__(self, pair, a: float):
        self.head, self.kind, self.spec, self.labels = torch.nn.Identity(), "sprinter", FeatureSpec("hidden", d=64), {}
        self.threshold, self.pair_id, self.tokenizer_hash, self.path, self.a = 0.5, pair.pair_id, "", None, a

    def prob(self, x):
        return torch.tensor(self.a)

    def scorer(self):
        return lambda x: self.a


def exact_policies(pair):
    pols = [build_policy("constant", {"k": k}) for k in (1, 3, 6)]
    pols += [build_policy("heuristic", {}), build_policy("oracle", {}), build_policy("svip", {}),
             build_policy("adaedl", {}), build_policy("svip", {"h": 0.9, "max_len": 12})]
    pols += [build_policy("max_confidence", {"adapt": a}) for a in ("none", "ema", "roc")]
    pols += [build_policy("expected_value", {"score": s}, pair=pair) for s in ("max_q", "neg_entropy")]
    pols += [Learned(make_head(pair, "disco")), Learned(make_head(pair, "specdecpp"), threshold=0.3)]
    pols.append(Sprinter(FixedVerifier(pair, 0.0)))  # a verifier that rejects everything = exact verification
    return pols


def greedy_runs(pair, max_new: int):
    """(prompt text, policy, speculative result, target-only result) for every exact policy on every prompt, greedy;
    the CPU test here and the CUDA one (tests/test_cuda.py) check them."""
    eos = {pair.tokenizer.eos_token_id}
    for text in PROMPTS:
        ids = ids_of(pair, text)
        ref = autoregressive(pair, ids, max_new, eos=eos)
        for pol in exact_policies(pair):
            yield text, pol, speculative(pair, ids, pol, max_new, eos=eos, lookahead=ref.tokens), ref


def test_greedy_lossless_every_exact_policy(tiny_pair):
    accepted_any = False
    for text, pol, res, ref in greedy_runs(tiny_pair, 40):
        assert res.tokens == ref.tokens, f"{pol.name} diverged on {text!r}"
        assert res.drafted >= res.accepted and len(res.tokens) == 40
        assert res.target_calls == len(res.rounds)
        accepted_any |= res.accepted > 0
    assert accepted_any  # both acceptance and rejection paths ran


class Recorder(StopPolicy):
    """Constant K=4 that keeps every DraftStep it saw."""

    name = "recorder"
    needs_hidden = True

    def __init__(self):
        super().__init__(max_len=4)
        self.steps = []

    def should_stop(self, step):
        self.steps.append((step.position, step.token, step.disco(10), step.hidden.clone()))
        return step.position_in_round + 1 >= 4


def test_features_equal_teacher_forced_draft_pass(tiny_pair):
    """DISCO features / hidden of a drafted position equal draft_probs/topk_probs/entropy on a teacher-forced pass."""
    ids = ids_of(tiny_pair, PROMPTS[0])
    for temperature in (0.0, 0.8):
        pol = Recorder()
        res = speculative(tiny_pair, ids, pol, 30, temperature=temperature, generator=torch.Generator().manual_seed(3))
        # teacher-forced draft pass over prompt + the continuation as emitted
        seq = ids + res.tokens
        with torch.no_grad():
            h = tiny_pair.draft.get_decoder()(input_ids=torch.tensor([seq])).last_hidden_state[0]
            logits = tiny_pair.draft.get_output_embeddings()(h)[:, : tiny_pair.vocab_size]
        q = draft_probs(logits, temperature)
        checked, idx = 0, 0
        for k, n in res.rounds:
            # steps 0..n of a round were drafted from the final output's prefix (the earlier ones were accepted)
            for j, (pos, tok, disco, hidden) in enumerate(pol.steps[idx : idx + k]):
                if j <= n:
                    i = len(ids) - 1 + pos
                    assert torch.allclose(disco[:10], topk_probs(q[i], 10), atol=1e-5)
                    assert torch.allclose(disco[10], entropy(q[i]), atol=1e-4)
                    assert float(disco[11]) == j
                    assert torch.allclose(hidden, h[i], atol=1e-4)
                    checked += 1
            idx += k
        assert checked >= 5


def test_sampling_matches_target_joint_law_of_two_tokens(tiny_pair):
    """Exact speculative sampling: the first two emitted tokens follow p(t1)·p(t2 | t1) (chi-square, α = 0.001).

    N = 1000 runs, bins = (t1, t2) pairs with expected count ≥ 15 plus one 'rest' bin. Power: the tiny pair's
    draft differs from the target by TVD ≈ 0.5, so a loop that leaked q (e.g. accepted without the p/q test or
    resampled from p instead of the residual) would shift ≥ 0.1 of mass, λ ≈ N·Σδ²/p ≫ 50 → power ≈ 1.
    """
    from tests.conftest import law_chisquare, two_token_law

    ids = ids_of(tiny_pair, PROMPTS[1])
    T = 1.0
    joint = two_token_law(tiny_pair, ids, T)
    V = joint.shape[0]
    n = 1000
    counts = torch.zeros(V, V, dtype=torch.float64)
    pol = build_policy("constant", {"k": 3})
    for s in range(n):
        res = speculative(tiny_pair, ids, pol, 2, temperature=T, generator=torch.Generator().manual_seed(s))
        counts[res.tokens[0], res.tokens[1]] += 1
    bins, pvalue = law_chisquare(counts, joint, n)
    assert bins >= 5
    assert pvalue > 1e-3


def test_sprinter_keeps_verifier_accepted_tokens_without_target(tiny_pair):
    ids = ids_of(tiny_pair, PROMPTS[0])
    pol = Sprinter(FixedVerifier(tiny_pair, 1.0), max_len=64)  # accepts everything
    res = speculative(tiny_pair, ids, pol, 20)
    draft_only = autoregressive(type("P", (), {"target": tiny_pair.draft, "vocab_size": tiny_pair.vocab_size})(),
                                ids, 19)
    assert res.target_calls == 1 and res.unchecked == 19
    assert res.tokens[:19] == draft_only.tokens
    assert res.tvd_sum > 0


def test_lm_wrapper_equals_full_forward(tiny_pair):
    ids = ids_of(tiny_pair, PROMPTS[2])
    lm = LM(tiny_pair.target, tiny_pair.vocab_size)
    logits, _ = lm(ids, lm.new_cache(), last=len(ids))
    with torch.no_grad():
        full = tiny_pair.target(torch.tensor([ids])).logits[0, :, : tiny_pair.vocab_size]
    assert torch.allclose(logits, full, atol=1e-5)


# --------------------------------------------------------------------------------------------------------------- CLI

BASE = ["decode", "pair=tiny_random", "dataset=mbpp", "split=test", "limit=2", "max_new_tokens=12", "threads=1",
        "plots=false"]


def test_cli_summary(cli, tmp_path, tiny_pair):
    ckpt = save_head(make_head(tiny_pair, "disco"), tmp_path / "disco.ckpt")
    out = tmp_path / "run"
    r = cli(*BASE, f"policies=[constant,svip,oracle,learned:{ckpt}]", f"out_dir={out}")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"target", "constant", "svip", "oracle", "learned"}
    for key in ("tokens_per_s", "speedup", "cost_model_speedup", "acceptance_rate", "mean_accepted_length",
                "target_calls_per_token", "draft_calls_per_token", "policy_overhead_frac", "lossless"):
        assert key in summary["svip"]
    assert all(summary[k]["lossless"] is True for k in ("constant", "svip", "oracle", "learned"))
    assert summary["oracle"]["oracle"] is True
    rows = read_jsonl(out / "prompts.jsonl")
    assert len(rows) == 2 * 5
    # lossless outputs are stored once, on the target's row
    assert all("tokens" in r and "text" in r for r in rows if r["method"] == "target")
    assert all(r["same_as_target"] and "tokens" not in r and "text" not in r for r in rows if r["method"] != "target")
    assert "| svip |" in (out / "summary.md").read_text()


def test_compact_rows_keeps_every_output_that_differs():
    from decode.report import compact_rows

    rows = [{"method": "target", "tokens": [1, 2], "text": "ab"},
            {"method": "a", "tokens": [1, 2], "text": "ab", "matches_target": True},
            {"method": "b", "tokens": [1, 3], "text": "ac", "matches_target": False},
            {"method": "c", "tokens": [1, 3], "text": "ac"}]  # sampling: no comparison made
    out = compact_rows(rows)
    assert out[0] == rows[0] and out[2] == rows[2] and out[3] == rows[3]
    assert out[1] == {"method": "a", "matches_target": True, "same_as_target": True}


def compose(*overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from utils.cli import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("decode", overrides=[o for o in BASE[1:] if o.split("=")[0] not in
                                                    {x.split("=")[0] for x in overrides}] + list(overrides))


def wandb_run_dir(out) -> Path:
    """The one offline W&B run under a folder (`<out>/wandb/offline-run-*`)."""
    runs = sorted((Path(out) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    return runs[0]


def wandb_table(run_dir: Path, key: str) -> dict:
    """A W&B Table logged under `key` in an offline run, read back from the run's files."""
    found = sorted((run_dir / "files" / "media" / "table").glob(f"{key}_*.table.json"))
    assert found, f"no table {key} in {run_dir}"
    return json.loads(found[-1].read_text())


def test_logger_wandb_offline_run_holds_the_table(tmp_path, tiny_pair):
    """logger=wandb: the job leaves one offline run under out_dir holding the summary table (the summary.json rows),
    the speedup, acceptance-by-position and draft-length data and run.json (machine and cost profile included)."""
    from decode import wandb_log
    from decode.runner import main

    out = tmp_path / "run"
    cfg = compose("policies=[constant,svip]", "logger=wandb", f"out_dir={out}", "plots=true")
    with wandb_log.session(cfg, out, "decode"):
        summary = main(cfg)
    run = wandb_run_dir(out)
    table = wandb_table(run, "decode/summary")
    rows = {r[0]: dict(zip(table["columns"], r)) for r in table["data"]}
    assert set(rows) == {"target", "constant", "svip"}
    for k in rows:
        assert rows[k]["speedup"] == pytest.approx(summary[k]["speedup"])
        assert rows[k]["acceptance_rate"] == (summary[k].get("acceptance_rate") and pytest.approx(summary[k]["acceptance_rate"]))
    speed = wandb_table(run, "decode/speedup_table")
    assert {r[0] for r in speed["data"]} == {"target", "constant", "svip"}
    acc = wandb_table(run, "decode/acceptance_by_position_table")
    assert acc["columns"] == ["method", "position", "acceptance"] and {r[0] for r in acc["data"]} >= {"constant"}
    hist = wandb_table(run, "decode/draft_length_hist")
    assert sum(r[2] for r in hist["data"] if r[0] == "constant") == sum(summary["constant"]["draft_length_hist"].values())
    assert sorted(p.name.split("_png")[0] for p in (run / "files" / "media" / "images" / "decode").glob("*.png")) == [
        "acceptance_by_position", "speedup"]
    # config and summary live in the run's record log: run.json (every key, e.g. the machine) is in the config
    info = json.loads((out / "run.json").read_text())
    blob = b""
    for _ in range(50):  # the offline writer may still be flushing its record log on a loaded machine
        blob = next(run.glob("run-*.wandb")).read_bytes()
        if b"run_json" in blob:
            break
        time.sleep(0.2)
    assert b"run_json" in blob and info["machine"].encode() in blob
    assert all(json.dumps(k).encode() in blob for k in info)
    assert b"decode/svip/speedup" in blob


def test_logger_none_leaves_no_wandb_run(tmp_path, tiny_pair):
    from decode import wandb_log
    from decode.runner import main

    out = tmp_path / "run"
    cfg = compose("policies=[constant]", f"out_dir={out}")
    assert cfg.logger.wandb is None  # the default
    with wandb_log.session(cfg, out, "decode"):
        main(cfg)
    assert (out / "summary.json").is_file() and not (out / "wandb").exists()


@pytest.mark.slow
def test_multirun_wandb_is_one_group_with_speedup_vs_parameter(cli, tmp_path):
    """`python -m decode -m policy.svip.h=0.2,0.4 logger=wandb`: one offline run per job, all in one W&B group
    named after the sweep folder, plus a sweep run in that group charting speedup against h."""
    sweep = tmp_path / "sweep"
    r = cli("decode", "-m", *BASE[1:], "warmup=false", "policies=[svip]", "policy.svip.h=0.2,0.4", "logger=wandb",
            f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stderr[-2000:]
    group = f"decode-{sweep.name}".encode()
    for job in ("0", "1"):
        assert group in next(wandb_run_dir(sweep / job).glob("run-*.wandb")).read_bytes()
        wandb_table(wandb_run_dir(sweep / job), "decode/summary")
    run = wandb_run_dir(sweep)
    assert group in next(run.glob("run-*.wandb")).read_bytes()
    chart = wandb_table(run, "sweep/speedup_vs_policy.svip.h_table")
    assert chart["columns"] == ["policy.svip.h", "method", "speedup", "cost_model_speedup"]
    got = {row[0]: row[2] for row in chart["data"]}
    for job, h in (("0", 0.2), ("1", 0.4)):
        assert got[h] == pytest.approx(json.loads((sweep / job / "summary.json").read_text())["svip"]["speedup"])


def test_sampling_and_sprinter_summary(tmp_path, tiny_pair):
    from decode.runner import main

    ckpt = save_head(make_head(tiny_pair, "sprinter"), tmp_path / "spr.ckpt")
    out = tmp_path / "run"
    main(compose("temperature=0.8", "policies=[adaedl,sprinter]", f"policy_ckpt={ckpt}", f"out_dir={out}"))
    s = json.loads((out / "summary.json").read_text())
    assert s["adaedl"]["lossless"] is None  # sampling: judged by the distribution tests, not token equality
    assert s["sprinter"]["approximate"] is True and s["sprinter"]["lossless"] is None
    assert {"tvd_est", "rouge_l_ref", "token_agreement", "target_calls_saved_frac"} <= set(s["sprinter"])
    # MBPP prompts carry reference code: target-only quality is the baseline row of the approximate table
    assert 0 <= s["target"]["rouge_l_ref"] <= 1
    assert "| target-only (= exact SD) | 0.000 |" in (out / "summary.md").read_text()


def test_cli_bad_input_one_line(cli, tmp_path):
    r = cli(*BASE, "policies=[constant,nope]", f"out_dir={tmp_path / 'x'}")
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: unknown policy 'nope'; known: target, adaedl, c2t, constant"), r.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["max_new_tokens=0"], "max_new_tokens must be > 0"),
        (["policies=[oracle]", "temperature=0.7"], "oracle policy is greedy-only"),
        (["max_new_tokens=100000"], "context"),
        (["policies=[learned]"], "needs a head"),
        (["policies=[svip]", "+policy.svip.hh=1"], "bad parameter"),
    ],
)
def test_bad_input_user_errors(tmp_path, args, message):
    from decode.runner import main
    from utils.cli import UserError

    overrides = ["policies=[constant]", *args] if not any(a.startswith("policies=") for a in args) else args
    with pytest.raises(UserError, match=message):
        main(compose(*overrides, f"out_dir={tmp_path / 'x'}"))
    assert not (tmp_path / "x" / "summary.json").exists()


def test_head_pair_mismatch(tmp_path, tiny_pair):
    from decode.runner import main
    from utils.cli import UserError

    bundle = make_head(tiny_pair, "disco")
    bundle.pair_id = "smollm2_135m"
    ckpt = save_head(bundle, tmp_path / "other.ckpt")
    with pytest.raises(UserError, match="smollm2_135m.*tiny_random"):
        main(compose(f"policies=[learned:{ckpt}]", f"out_dir={tmp_path / 'x'}"))


# -------------------------------------------------------------------------------------------------------------- real


@pytest.mark.real
def test_real_mbpp_greedy_lossless_chains_and_trees():
    """≥ 20 real MBPP prompts on the default pair: greedy constant and svip outputs — on the student, prompt lookup
    and student+lookup — and the tree builders' (sized on a flat t(n), so they branch), equal target-only token for
    token.

    In float32: in bf16 the same position computed in a 1-token step and in a 6-token verify pass can differ in the
    last bit and flip a near-tie argmax (3 of 40 runs here), which is numerics, not the algorithm.
    """
    from omegaconf import OmegaConf

    from data_gen.prompts import load_prompts
    from decode.drafter import for_policy
    from decode.run import tokenize_prompts
    from decode.tree_builders import Eagle2, Sequoia, TreeStatic
    from models.pair import load_pair
    from tests.test_decode_tree import _profile
    from utils.cli import CONF_DIR

    torch.set_num_threads(1)  # a busy shared CPU runs one thread per process best
    cfg = OmegaConf.load(CONF_DIR / "pair" / "smollm2_135m.yaml")
    cfg.dtype = "float32"
    pair = load_pair(cfg)
    prompts = load_prompts(OmegaConf.load(CONF_DIR / "dataset" / "mbpp.yaml"), "test", 20)
    ids = tokenize_prompts(pair, prompts, 16)
    eos = pair.eos_ids
    flat = _profile(slope=0.0)  # a GPU's flat t(n): every builder grows real trees
    rank_probs = OmegaConf.load(CONF_DIR / "policy" / "sequoia.yaml").rank_probs
    policies = [build_policy("constant", {}), build_policy("svip", {}), TreeStatic(rank_probs=rank_probs, profile=flat),
                Sequoia(rank_probs=rank_probs, max_nodes=16, profile=flat), Eagle2(max_nodes=16, profile=flat)]
    policies += [for_policy(d, pair, build_policy(name, {})) for d in ("lookup", "student+lookup")
                 for name in ("constant", "svip")]  # prompt lookup and the student falling back on it
    bad, widest = [], 0
    for p, x in zip(prompts, ids):
        ref = autoregressive(pair, x, 16, eos=eos)
        for policy in policies:
            res = speculative(pair, x, policy, 16, eos=eos)
            if isinstance(policy, TreeStatic):
                widest = max(widest, max(k for k, _ in res.rounds))
            if res.tokens != ref.tokens:
                bad.append((p.prompt_id, policy.name, getattr(policy, "policy", None)))
    assert len(prompts) == 20 and not bad, bad
    assert widest > len(policies[2].branching)  # more nodes than levels in a round: the static tree branched


def test_tie_margin_of_a_divergence(tiny_pair):
    """A greedy mismatch is diagnosed with the target's logit margin between the two tokens at the divergence."""
    from decode.metrics import agreement, summarize
    from decode.run import tie_margins

    ids = ids_of(tiny_pair, PROMPTS[0])
    ref = autoregressive(tiny_pair, ids, 8).tokens
    with torch.no_grad():
        logits = tiny_pair.target(torch.tensor([ids + ref[:3]])).logits[0, -1, : tiny_pair.vocab_size]
    second = int(logits.topk(2).indices[1])
    other = ref[:3] + [second] + ref[4:]
    rows = [{"method": "target", "prompt_id": "a", "tokens": ref},
            {"method": "constant", "prompt_id": "a", "tokens": other, "matches_target": False,
             **agreement(other, ref)}]
    margin = float(logits[ref[3]] - logits[second])
    base = {"new_tokens": 8, "wall_s": 1.0, "target_calls": 4, "draft_calls": 8, "drafted": 8, "accepted": 4,
            "draft_s": 0.1, "policy_s": 0.0, "rounds": [[2, 1]] * 4}
    for tol, tie in ((margin + 1, True), (margin / 2, False)):
        tie_margins(tiny_pair, rows, {"a": ids}, {"constant": build_policy("constant", {})}, tie_tol=tol)
        assert rows[1]["divergence_margin"] == pytest.approx(margin, abs=1e-4)
        s = summarize([{**rows[1], **base}], [{**base, "draft_calls": 0}], None, True, True)
        assert s["lossless"] is False and s["lossless_up_to_ties"] is tie
    # by default the tolerance follows the dtype: 4 ulps of float32 at these logits, far below a real margin
    tie_margins(tiny_pair, rows, {"a": ids}, {"constant": build_policy("constant", {})})
    assert 0 < rows[1]["divergence_tol"] < 1e-4
    assert summarize([{**rows[1], **base}], [{**base, "draft_calls": 0}], None, True, True)["lossless_up_to_ties"] is (
        margin < rows[1]["divergence_tol"])


def test_tie_tolerance_follows_dtype_resolution():
    """4 ulps at the logit's magnitude: bf16 at 40 → 1.0, at 20 → 0.5; float32 at 40 → 4 × 2^-18."""
    from decode.metrics import tie_tolerance

    assert tie_tolerance("torch.bfloat16", 40.0) == 1.0
    assert tie_tolerance("bfloat16", -20.0) == 0.5
    assert tie_tolerance("float32", 40.0) == pytest.approx(4 * 2.0 ** -18)
    assert tie_tolerance("bfloat16", 40.0, ulps=1) == 0.25


# ------------------------------------------------------------------------------------------ study-facing features


def test_hf_assisted_row_is_lossless_and_counted(tmp_path, tiny_pair):
    """transformers' assisted generation as a decode method: same greedy output as target-only, its calls counted
    (the drafted tokens include accepted ones), marked external, and excluded from the measured c."""
    from decode.runner import main

    out = tmp_path / "run"
    s = main(compose("policies=[constant,hf_assisted]", f"out_dir={out}"))
    hf = s["hf_assisted"]
    assert hf["external"] is True and s["constant"]["external"] is False
    assert hf["lossless"] is True
    assert hf["params"]["num_assistant_tokens"] == 20 and hf["params"]["confidence_threshold"] == 0.4
    assert 0 < hf["target_calls_per_token"] <= 1 and hf["draft_calls_per_token"] > 0
    assert 0 <= hf["acceptance_rate"] <= 1
    assert "hf_assisted (transformers)" in (out / "summary.md").read_text()


def test_sweep_tune_and_tuned_carry_over(tmp_path, tiny_pair):
    """mode=sweep: one row per grid point; mode=tune writes tuned.json whose static_opt K then drives a mode=run
    elsewhere through tuned=PATH (constant keeps its K); bad tuned= paths are one-line user errors."""
    from decode.runner import main
    from utils.cli import UserError

    s = main(compose("mode=sweep", "policies=[static_opt]", "tune.grid.static_opt.k=[1,3]", f"out_dir={tmp_path / 'sw'}"))
    assert set(s) == {"target", "static_opt[k=1]", "static_opt[k=3]"}
    assert s["static_opt[k=3]"]["mean_draft_length"] > s["static_opt[k=1]"]["mean_draft_length"]

    tune_dir = tmp_path / "tune"
    main(compose("mode=tune", "tune.eval_split=null", "policies=[constant,static_opt]", "tune.grid.static_opt.k=[2]",
                 "limit=1", f"out_dir={tune_dir}"))
    tuned = json.loads((tune_dir / "tuned.json").read_text())
    assert tuned["chosen"]["static_opt"] == {"k": 2} and tuned["chosen"]["constant"] == {"k": 5}
    s = main(compose("policies=[constant,static_opt]", f"tuned={tune_dir / 'tuned.json'}", f"out_dir={tmp_path / 'r'}"))
    assert s["static_opt"]["params"]["k"] == 2 and s["constant"]["params"]["k"] == 5
    assert json.loads((tmp_path / "r" / "run.json").read_text())["params"]["static_opt"]["k"] == 2

    with pytest.raises(UserError, match="no such file"):
        main(compose("policies=[svip]", f"tuned={tmp_path / 'nope.json'}", f"out_dir={tmp_path / 'x'}"))
    with pytest.raises(UserError, match="none of this run's methods"):
        main(compose("policies=[svip]", f"tuned={tune_dir / 'tuned.json'}", f"out_dir={tmp_path / 'x'}"))


def test_k_sweep_analysis(tmp_path, tiny_pair):
    """eval.k_sweep on a real (tiny) sweep: α̂ is accepted ÷ verified positions pooled over every K, predictions
    come from eval.theory at that α̂ and the run's c, one row per K."""
    from decode.metrics import per_position
    from decode.runner import main
    from eval.k_sweep import analyse, write
    from eval.theory import improvement_factor

    out = tmp_path / "sw"
    main(compose("mode=sweep", "policies=[static_opt]", "tune.grid.static_opt.k=[1,2,4]", f"out_dir={out}"))
    res = analyse(out)
    assert [r["k"] for r in res["rows"]] == [1, 2, 4]
    rounds = [tuple(x) for row in read_jsonl(out / "prompts.jsonl") for x in row["rounds"]]
    v, a = per_position(rounds)
    assert res["alpha"] == pytest.approx(sum(a) / sum(v))
    assert res["rows"][1]["predicted_leviathan"] == pytest.approx(improvement_factor(res["alpha"], 2, res["c"]))
    write(res, out)
    assert (out / "k_sweep.png").is_file() and "| 4 |" in (out / "k_sweep.md").read_text()


def test_collect_runs_by_a_setting(tmp_path, tiny_pair):
    """eval.collect: two decode runs differing in temperature → one method × temperature table and plot; runs that
    do not differ in --by, or a missing field, are one-line user errors."""
    from decode.runner import main
    from eval.collect import collect, write
    from utils.cli import UserError

    for t in (0.0, 0.7):
        main(compose("policies=[svip]", f"temperature={t}", "limit=1", f"out_dir={tmp_path / str(t)}"))
    res = collect([tmp_path / "0.7", tmp_path / "0.0"], "temperature")
    assert res["values"] == ["0.0", "0.7"] and set(res["methods"]) == {"svip"}
    s07 = json.loads((tmp_path / "0.7" / "summary.json").read_text())["svip"]["speedup"]
    assert res["methods"]["svip"]["0.7"]["speedup"] == s07
    write(res, tmp_path / "out")
    assert "temperature=0.7" in (tmp_path / "out" / "collect.md").read_text()
    with pytest.raises(UserError, match="share"):
        collect([tmp_path / "0.0", tmp_path / "0.0"], "temperature")
    with pytest.raises(UserError, match="no field"):
        collect([tmp_path / "0.0"], "nope")
    assert collect([tmp_path / "0.7", tmp_path / "0.0"], "dir")["values"] == ["0.0", "0.7"]  # folder names


def test_tuned_matches_a_lone_head_by_file_stem(tmp_path):
    """A head tuned beside another (key learned:<stem>) keeps its threshold when a later run lists it alone (key
    learned); a head the file does not name keeps its own."""
    from decode.methods import Method, apply_tuned

    f = tmp_path / "tuned.json"
    f.write_text(json.dumps({"chosen": {"learned:disco_mbpp": {"threshold": 0.6}, "svip": {"h": 0.4}}}))
    out = apply_tuned([Method("learned", "learned:models/weights/heads/disco_mbpp.ckpt", {"threshold": None}),
                       Method("sprinter", "sprinter:x/other.ckpt", {"threshold": 0.5}),
                       Method("svip", "svip", {"h": 0.3})], f)
    assert [m.params for m in out] == [{"threshold": 0.6}, {"threshold": 0.5}, {"h": 0.4}]


def test_report_regenerates_the_published_tables():
    """decode.report writes exactly the summary.md / by_task.md tables under results/ from their JSON."""
    from decode.report import markdown_table, task_table
    from tests.conftest import REPO

    checked = 0
    for name, make in (("summary", markdown_table), ("by_task", task_table)):
        for md in sorted((REPO / "results").rglob(f"{name}.md")):
            data = md.with_suffix(".json")
            if not data.is_file():
                continue
            text = md.read_text()
            first = text.splitlines()[0]
            assert make(json.loads(data.read_text()), first[4:] if first.startswith("### ") else "") == text, md
            checked += 1
    assert checked >= 1
