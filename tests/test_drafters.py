"""Drafters (decode.drafter): prompt lookup and student+lookup lossless with every chain policy (greedy, float32)
and exact in law (χ² at T = 1); the target's hidden states reach a drafter that names layers; a drafter defined
here runs through `python -m decode` by its yaml; `drafters=[...]` decodes side by side, keyed drafter/policy."""

from __future__ import annotations

import json

import pytest
import torch

from decode.drafter import Chain, Drafter, build_drafter, for_policy
from decode.loop import autoregressive, speculative
from decode.policies import build_policy
from tests.conftest import law_chisquare, two_token_law

pytestmark = pytest.mark.usefixtures("one_thread")

# repetitive prompts: prompt lookup finds matches in them and in the tiny target's looping output
PROMPTS = ["a b c d a b c d a b c", "def f(x):\n    return x\ndef g(x):\n    return", "1, 2, 3, 1, 2, 3, 1, 2"]
CHAIN = [("constant", {"k": 3}), ("heuristic", {}), ("oracle", {}), ("svip", {}), ("adaedl", {}),
         ("max_confidence", {}), ("expected_value", {"score": "max_q"})]


def ids_of(pair, text):
    return pair.tokenizer.encode(text, add_special_tokens=False)


def test_lookup_drafters_are_lossless_with_every_chain_policy(tiny_pair):
    eos = {tiny_pair.tokenizer.eos_token_id}
    drafted = accepted = 0
    for text in PROMPTS:
        ids = ids_of(tiny_pair, text)
        ref = autoregressive(tiny_pair, ids, 40, eos=eos)
        for name in ("lookup", "student+lookup"):
            for pol_name, params in CHAIN:
                pol = build_policy(pol_name, params, pair=tiny_pair)
                res = speculative(tiny_pair, ids, for_policy(name, tiny_pair, pol), 40, eos=eos,
                                  lookahead=ref.tokens)
                assert res.tokens == ref.tokens, f"{name}/{pol_name} diverged on {text!r}"
                assert res.target_calls == len(res.rounds)
                drafted, accepted = drafted + res.drafted, accepted + res.accepted
    assert accepted > 0 and drafted > accepted  # lookups were accepted and rejected


def test_lookup_sampling_matches_target_joint_law(tiny_pair):
    """T = 1: the first two tokens follow p(t1)·p(t2 | t1) with prompt lookup drafting (point-mass proposals; a
    loop that kept them unchecked would emit the proposal every time, where p gives it 0.5%)."""
    ids = ids_of(tiny_pair, "The quick brown fox The quick brown fox")
    joint = two_token_law(tiny_pair, ids)
    v = joint.shape[0]
    n, counts, drafted = 1000, torch.zeros(v, v, dtype=torch.float64), 0
    drafter = for_policy("lookup", tiny_pair, build_policy("constant", {"k": 3}))
    for s in range(n):
        res = speculative(tiny_pair, ids, drafter, 2, temperature=1.0, generator=torch.Generator().manual_seed(s))
        counts[res.tokens[0], res.tokens[1]] += 1
        drafted += res.drafted
    assert drafted >= n  # the lookup proposed in every run (the prompt repeats itself)
    bins, pvalue = law_chisquare(counts, joint, n)
    assert bins >= 5
    assert pvalue > 1e-3


class Toy(Drafter):
    """A drafter written by a user, without a model: it copies `k` tokens of the target's greedy output (the
    oracle's lookahead, which greedy decode hands every drafter) with the k-th one wrong, so rounds both accept
    and reject; without a lookahead it repeats the last token. `layers`: hidden states it asks the target for;
    every verdict is kept for the test."""

    name = "toy"

    def __init__(self, pair, policy=None, k: int = 2, layers=()):
        super().__init__(policy, max_len=k)
        self.layers, self.vocab = tuple(layers), pair.vocab_size
        self.seen = []

    def start(self, prompt_ids, s, lookahead=None):
        self.last, self.s, self.ahead, self.pos = prompt_ids[-1], s, lookahead, 0

    def propose(self, budget, res):
        k = min(self.max_len, budget)
        if self.ahead is None:
            toks = [self.last] * k
        else:
            toks = list(self.ahead[self.pos : self.pos + k])
            toks[-1:] = [(t + 1) % self.vocab for t in toks[-1:]]
        qs = [] if self.s.greedy else [torch.nn.functional.one_hot(torch.tensor(t), self.vocab).float() for t in toks]
        return Chain(toks, qs, source=self)

    def commit(self, verdict, res):
        self.last = verdict.next
        self.pos += len(verdict.kept) + 1
        self.seen.append(verdict)


def test_a_drafter_receives_the_target_hidden_states_it_names(tiny_pair):
    ids = ids_of(tiny_pair, PROMPTS[1])
    n_layers = tiny_pair.target.config.num_hidden_layers
    toy = Toy(tiny_pair, k=3, layers=(0, n_layers))
    ref = autoregressive(tiny_pair, ids, 16).tokens
    res = speculative(tiny_pair, ids, toy, 16, lookahead=ref)
    assert res.tokens == ref
    committed = list(ids)
    for v in toy.seen:  # each verdict: states at the pending tokens and the kept path, as a full pass has them
        m = v.hidden.shape[1]
        seq = committed + v.kept
        with torch.no_grad():
            full = tiny_pair.target(torch.tensor([seq]), output_hidden_states=True).hidden_states
        for j, layer in enumerate(toy.layers):
            assert torch.allclose(v.hidden[j], full[layer][0, len(seq) - m:], atol=1e-4)
        committed = seq + [v.next]
    assert any(v.kept for v in toy.seen)


def test_drafter_from_a_users_yaml_through_decode(cli, tmp_path):
    conf = tmp_path / "conf" / "drafter"
    conf.mkdir(parents=True)
    (conf / "toy.yaml").write_text("_target_: test_drafters.Toy\nk: 3\n")
    out = tmp_path / "run"
    r = cli("decode", "pair=tiny_random", "dataset=mbpp", "split=test", "limit=2", "max_new_tokens=12", "threads=1",
            "plots=false", "drafters=[toy,lookup]", "policies=[constant,svip]", f"out_dir={out}",
            f"hydra.searchpath=[file://{tmp_path / 'conf'}]")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert {"toy/constant", "toy/svip", "lookup/constant", "lookup/svip"} <= set(summary)
    assert all(summary[k]["lossless"] is True for k in summary if k != "target")
    assert summary["toy/constant"]["drafter"] == "toy" and summary["toy/constant"]["mean_accepted_length"] >= 1


def test_side_by_side_pairs_each_drafter_with_the_policies_it_runs(cli, tmp_path):
    out = tmp_path / "run"
    r = cli("decode", "pair=tiny_random", "dataset=mbpp", "split=test", "limit=3", "max_new_tokens=12", "threads=1",
            "plots=false", "drafters=[student,lookup,student+lookup]", "policies=[constant,eagle2]", f"out_dir={out}")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"target", "student/constant", "student/eagle2", "lookup/constant",
                            "student+lookup/constant"}
    assert "lookup/eagle2 left out" in r.stdout
    assert all(summary[k]["lossless"] is True for k in summary)
    assert summary["lookup/constant"]["measured_c"] < summary["student/constant"]["measured_c"]
    from eval.drafters_bar import compare

    bar = compare(out, n_resamples=200)  # python -m eval.drafters_bar on the run
    assert set(bar["drafters"]) == {"student", "lookup", "student+lookup"} and bar["prompts"] == 3
    assert bar["drafters"]["student"]["vs_reference"] == 1.0
    lookup = bar["drafters"]["lookup"]
    assert lookup["best"] == "lookup/constant" and lookup["vs_reference"] == pytest.approx(
        summary["lookup/constant"]["tokens_per_s"] / summary[bar["drafters"]["student"]["best"]]["tokens_per_s"], rel=1e-4)


def test_unknown_drafter_and_a_pairing_that_does_not_go_are_one_line(cli, tiny_pair):
    r = cli("decode", "pair=tiny_random", "limit=1", "max_new_tokens=4", "drafters=[nope]", "policies=[constant]")
    assert r.returncode != 0 and "unknown drafter 'nope'" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(Exception, match="does not run policy"):
        for_policy("lookup", tiny_pair, build_policy("eagle2", {}, pair=tiny_pair))
    with pytest.raises(Exception, match="min_ngram"):
        build_drafter("lookup", tiny_pair, None, {"min_ngram": 5})


def test_a_profile_reading_policy_reads_its_drafters_profile(tiny_pair):
    """The expected-value rule prices a round on its drafter's profile: a lookup round's draft steps cost nothing,
    so it is cheaper than a student round of the same length."""
    from decode.methods import Method
    from decode.run import _drafters
    from models.profiling import get_profile

    prof = get_profile(tiny_pair)
    methods = [Method(f"{d}/expected_value", "expected_value", {"score": "max_q"}, "decode.expected_value.ExpectedValue",
                      drafter=d) for d in ("student", "lookup")]
    built = _drafters(tiny_pair, methods, prof)
    student, lookup = (built[f"{d}/expected_value"].policy.rule.time for d in ("student", "lookup"))
    assert lookup[3] == pytest.approx(prof.round_steps(0, 3)) and lookup[3] < student[3]


def test_tuned_parameters_reach_methods_keyed_by_drafter():
    """A tuned.json written by a run with drafters (keys `drafter/policy`, e.g. eval.replay on EAGLE-3's traces) or
    without (bare keys) sets the parameters of a decode run with drafters, heads matched by file stem too."""
    from decode.methods import method_entry

    table = {"eagle3/expected_value": {"a": 1.0}, "eagle3/learned:disco_eagle3_mbpp": {"b": 2.0}, "svip": {"h": 0.3}}
    head = "models/weights/heads/disco_eagle3_mbpp.ckpt"
    assert method_entry(table, "eagle3/expected_value", "expected_value") == {"a": 1.0}
    assert method_entry(table, "eagle3/learned", "learned", head) == {"b": 2.0}
    assert method_entry(table, "student/svip", "svip") == method_entry(table, "svip", "svip") == {"h": 0.3}
    assert method_entry(table, "student/expected_value", "expected_value") is None
