"""Stop policies in isolation: each rule fires exactly where its paper says, adaptive state moves as specified."""

from __future__ import annotations

import math

import pytest
import torch

from decode.learned import Learned, Sprinter
from decode.policies import build_policy, parse_spec
from decode.rules import SVIP, AdaEDL, Constant, Heuristic, MaxConfidence, OnlineROC, Oracle
from models.distributions import entropy
from models.features.signals import DraftStep
from models.features.spec import FeatureSpec
from utils.cli import UserError


def step(probs=None, token=0, pos_in_round=0, position=0, hidden=None):
    if probs is None:
        probs = torch.tensor([1.0, 0.0, 0.0, 0.0])
    return DraftStep(probs=probs, token=token, hidden=hidden, position_in_round=pos_in_round, position=position)


def dist_with_entropy(h: float, v: int = 50) -> torch.Tensor:
    """A distribution over v tokens with entropy h nats (one peak + uniform rest, found by bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        p = torch.full((v,), (1 - mid) / (v - 1), dtype=torch.float64)
        p[0] = mid
        if float(entropy(p)) > h:
            lo = mid
        else:
            hi = mid
    return p.float()


def test_constant_stops_after_k():
    pol = Constant(k=3)
    assert [pol.should_stop(step(pos_in_round=j)) for j in range(3)] == [False, False, True]
    assert pol.max_len == 3


def test_heuristic_schedule_matches_transformers():
    pol = Heuristic(k=5, max_len=8)
    pol.observe(5, 5)
    assert pol.k == 7
    pol.observe(7, 7)
    assert pol.k == 8  # capped
    pol.observe(8, 2)
    assert pol.k == 7
    for _ in range(10):
        pol.observe(pol.k, 0)
    assert pol.k == 1  # min 1
    pol.reset()
    assert pol.k == 5


def test_oracle_stops_at_first_mismatch():
    pol = Oracle()
    pol.reset(lookahead=[4, 5, 6])
    assert not pol.should_stop(step(token=4, position=0))
    assert pol.should_stop(step(token=9, position=1))
    assert pol.should_stop(step(token=6, position=3))  # past the lookahead
    with pytest.raises(UserError):
        Oracle().reset()


def test_svip_threshold_on_entropy():
    pol = SVIP(c=0.15, h=0.3)  # stop iff H > h²/c = 0.6 nats
    assert not pol.should_stop(step(dist_with_entropy(0.55)))
    assert pol.should_stop(step(dist_with_entropy(0.65)))
    assert math.isclose(pol.h_max, 0.6)


def test_max_confidence_fixed_and_roc():
    pol = MaxConfidence(lam=0.4)
    assert pol.should_stop(step(torch.tensor([0.35, 0.35, 0.3, 0.0])))
    assert not pol.should_stop(step(torch.tensor([0.45, 0.35, 0.2, 0.0])))
    roc = MaxConfidence(lam=0.4, adapt="roc")
    for conf_ok, conf_bad in [(0.9, 0.2), (0.8, 0.3), (0.95, 0.25), (0.85, 0.1)]:
        roc.should_stop(step(torch.tensor([conf_ok, 1 - conf_ok])))
        roc.should_stop(step(torch.tensor([max(conf_bad, 1 - conf_bad), min(conf_bad, 1 - conf_bad)])))
        roc.observe(2, 1)
    assert roc.lam != 0.4  # refit on the history


def test_online_roc_refits_between_the_classes_over_a_window():
    """The online comparator: λ moves to separate accepted (conf ≥ 0.7) from rejected (≤ 0.3) drafted tokens, and
    only the last `window` tokens are remembered."""
    pol = build_policy("online_roc", {"lam": 0.05, "window": 12})
    assert isinstance(pol, OnlineROC) and pol.adapt == "roc" and pol.name == "online_roc"
    for r in range(10):
        for conf in (0.9, 0.7 + 0.01 * r, 0.3 - 0.01 * r):  # two accepted, then the rejected one
            pol.should_stop(step(torch.tensor([conf, 1 - conf])))
        pol.observe(3, 2)
        assert len(pol.history_acc) <= 12
    # λ = the lowest accepted confidence among the last 12 tokens (rounds 6-9: 0.76); over every round it would be 0.70
    assert pol.lam == pytest.approx(0.76)
    stop = [pol.should_stop(step(torch.tensor([c, 1 - c]))) for c in (0.55, 0.95)]
    assert stop == [True, False]
    assert pol.should_stop(step(torch.tensor([0.25, 0.25, 0.25, 0.25])))  # max q 0.25 < λ


def test_adaedl_rule_and_algorithm_1():
    pol = AdaEDL(gamma=0.2, lambda0=0.7, alpha=0.9, beta1=0.5, beta2=0.9, eps=0.01, max_len=16)
    # stop iff 1 − √(0.2·H) < 0.7  <=>  H > 0.45
    assert not pol.should_stop(step(dist_with_entropy(0.40)))
    assert pol.should_stop(step(dist_with_entropy(0.50)))
    pol.observe(4, 1)  # AR = 0.25 < α → λ' = λ + ε;  λ = 0.9·0.7 + 0.1·0.71
    assert pol.ema.lam == pytest.approx(0.701)
    pol.observe(4, 4)  # AR = 0.5·0.25 + 0.5·1 = 0.625 < α → up again
    assert pol.ema.lam == pytest.approx(0.9 * 0.701 + 0.1 * 0.711)
    for _ in range(6):
        pol.observe(4, 4)  # AR → ≥ 0.9, accepted ≠ L → λ goes down
    assert pol.ema.lam < 0.702


class StubBundle:
    """Same fields as models.heads.HeadBundle; prob() returns a scripted sequence."""

    def __init__(self, kind, spec, probs, threshold=0.5, pair_id="tiny_random", tokenizer_hash="x"):
        self.head, self.kind, self.spec, self.labels = torch.nn.Identity(), kind, spec, {}
        self.threshold, self.pair_id, self.tokenizer_hash, self.path = threshold, pair_id, tokenizer_hash, None
        self.probs = list(probs)
        self.seen = []

    def prob(self, x):
        self.seen.append(x.clone())  # the policy reuses its feature buffer
        return torch.tensor(self.probs.pop(0))

    def scorer(self):
        return lambda x: float(self.prob(x))

    def check_pair(self, pair):
        if pair.pair_id != self.pair_id:
            raise UserError(f"head was trained on pair {self.pair_id} but this run uses {pair.pair_id}")


def test_learned_disco_threshold_and_features():
    b = StubBundle("disco", FeatureSpec("disco", k=3), [0.9, 0.6, 0.4])
    pol = Learned(b, threshold=0.5)
    q = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert [pol.should_stop(step(q, pos_in_round=j)) for j in range(3)] == [False, False, True]
    assert b.seen[2].shape == (5,) and float(b.seen[2][-1]) == 2.0  # k probs, entropy, position in round
    assert torch.allclose(b.seen[0][:3], torch.tensor([0.5, 0.3, 0.15]))


def test_learned_specdecpp_product_rule():
    b = StubBundle("specdecpp", FeatureSpec("hidden", d=4), [0.9, 0.9, 0.9, 0.9])
    pol = Learned(b, threshold=0.3)  # stop when 1 − Π a > 0.3: 0.1, 0.19, 0.271, 0.344
    h = torch.zeros(4)
    assert [pol.should_stop(step(hidden=h, pos_in_round=j)) for j in range(4)] == [False, False, False, True]
    b.probs = [0.5]
    assert pol.should_stop(step(hidden=h, pos_in_round=0)) is True  # new round: 1 − 0.5 > 0.3
    assert pol.needs_hidden and not pol.needs_probs


def test_sprinter_is_approximate():
    pol = Sprinter(StubBundle("sprinter", FeatureSpec("hidden", d=4), [0.7, 0.2]), threshold=0.5)
    assert pol.approximate
    assert not pol.should_stop(step(hidden=torch.zeros(4)))
    assert pol.should_stop(step(hidden=torch.zeros(4), pos_in_round=1))


def test_bad_specs_give_one_clear_error():
    with pytest.raises(UserError, match="known: target, adaedl, c2t, constant"):
        parse_spec("nope")
    with pytest.raises(UserError, match="takes no checkpoint"):
        parse_spec("svip:/x.ckpt")
    with pytest.raises(UserError, match="needs a head"):
        build_policy("learned")
    with pytest.raises(UserError, match="bad parameter"):
        build_policy("svip", {"hh": 1})
    with pytest.raises(UserError, match="not found"):
        build_policy("learned:/nonexistent/head.ckpt")


# ------------------------------------------------------------------------------------------- expected-value rule


def ev_profile(c=0.15, slope=0.05):
    from models.cost import CostProfile

    return CostProfile(key={}, draft_ms=[c, c], target_ms=[1 + slope * i for i in range(20)], prefill_lengths=[1],
                       prefill_target_ms=[1.0], prefill_draft_ms=[c], context=1, repeats=1)


def best_k(a: float, prof, max_len=16) -> int:
    """The round length that maximises E[tokens] ÷ time for a constant acceptance probability a (brute force)."""
    def rate(k):
        tokens = 1 + sum(a ** j for j in range(1, k + 1))
        return tokens / (k * prof.cost_ratio + float(prof.verify_ratio(k + 1)))
    return max(range(1, max_len + 1), key=rate)


@pytest.mark.parametrize("a", [0.3, 0.6, 0.8, 0.9, 0.97])
@pytest.mark.parametrize("slope", [0.0, 0.05, 0.3])
def test_expected_value_rule_drafts_the_rate_optimal_length(a, slope):
    """With a constant calibrated acceptance a, the greedy rule stops at the length a brute-force search over K
    finds best (the rate E/T is unimodal in K there); a steeper verification curve shortens rounds."""
    from decode.expected_value import ExpectedValueRule

    prof = ev_profile(slope=slope)
    rule = ExpectedValueRule(prof, 16)
    k = 1
    while k < 16 and not rule.stop(a):
        k += 1
    assert k == best_k(a, prof)


def test_expected_value_rule_next_token_guess():
    """a_next replaces the rule's default guess of the next token (a itself): a sure next token keeps drafting where a
    hopeless one stops at once, for the same current-token probabilities."""
    from decode.expected_value import ExpectedValueRule

    prof = ev_profile()
    default, sure, hopeless = (ExpectedValueRule(prof, 16) for _ in range(3))
    assert not sure.stop(0.6, a_next=1.0) and hopeless.stop(0.6, a_next=0.0)
    assert default.stop(0.6) == ExpectedValueRule(prof, 16).stop(0.6, a_next=0.6)


def test_expected_value_policy_reads_score_and_profile():
    from decode.expected_value import ExpectedValue

    with pytest.raises(UserError, match="cost profile"):
        ExpectedValue()
    with pytest.raises(UserError, match="max_q or neg_entropy"):
        ExpectedValue(score="tvd", profile=ev_profile())
    confident = torch.tensor([0.99] + [0.01 / 49] * 49)
    unsure = torch.full((50,), 1 / 50)
    pol = ExpectedValue(profile=ev_profile())
    assert not pol.should_stop(step(confident, pos_in_round=0))
    assert pol.should_stop(step(unsure, pos_in_round=1))
    # neg_entropy with a calibration that maps every entropy to a high probability keeps drafting
    pol = ExpectedValue(score="neg_entropy", a=0.0, b=4.0, profile=ev_profile())
    assert not any(pol.should_stop(step(unsure, pos_in_round=j)) for j in range(5))
    assert pol.describe()["score"] == "neg_entropy"


def test_expected_value_online_calibration_follows_the_revealed_acceptance():
    """`adapt: online`: b moves towards the acceptance the verifications reveal — down when confident tokens keep
    being rejected, up when they are accepted — only accepted tokens and the first rejection count, b carries across
    prompts unless `per_prompt_reset`, and a pessimistic b drafts shorter rounds."""
    from decode.expected_value import ExpectedValue

    confident = torch.tensor([0.9] + [0.1 / 49] * 49)

    def run_round(pol, drafted, accepted):
        for j in range(drafted):
            pol.should_stop(step(confident, pos_in_round=j))
        pol.observe(drafted, accepted)

    rejected, accepted = (ExpectedValue(profile=ev_profile(), adapt="online", lr=0.1) for _ in range(2))
    for _ in range(30):
        run_round(rejected, 3, 0)
        run_round(accepted, 3, 3)
    assert rejected.b < -1.0 and accepted.b > 0.5  # (1 − p) shrinks as p nears 1: up slowly
    # a round of 3 drafted, 1 accepted reveals two tokens (one y = 1, one y = 0): the third is not seen
    pol = ExpectedValue(profile=ev_profile(), adapt="online", lr=0.1, b=0.0)
    run_round(pol, 3, 1)
    p = 0.9  # σ(logit 0.9 + 0)
    p2 = 1 / (1 + math.exp(-(math.log(9) + 0.1 * (1 - p))))
    assert pol.b == pytest.approx(0.1 * (1 - p) + 0.1 * (0 - p2))
    pol.reset()
    assert pol.b != 0.0
    fresh = ExpectedValue(profile=ev_profile(), adapt="online", per_prompt_reset=True, b=0.0)
    run_round(fresh, 3, 0)
    fresh.reset()
    assert fresh.b == 0.0
    # the rule drafts fewer tokens under the pessimistic calibration than under the fixed one
    def drafted(pol):
        j = 0
        while j < 16 and not pol.should_stop(step(confident, pos_in_round=j)):
            j += 1
        return j + 1
    assert drafted(rejected) < drafted(ExpectedValue(profile=ev_profile()))
    assert ExpectedValue(profile=ev_profile()).describe()["b"] == 0.0 and "adapt" not in ExpectedValue(
        profile=ev_profile()).describe()
    with pytest.raises(UserError, match="none or online"):
        ExpectedValue(profile=ev_profile(), adapt="ema")


def test_learned_head_under_the_expected_value_rule(tiny_pair):
    """`policy.learned.rule=expected_value` stops by the same rule on the head's P(accept)."""
    import tests.test_decode as td

    bundle = td.make_head(tiny_pair, "disco")
    pol = Learned(bundle, rule="expected_value", profile=ev_profile())
    assert pol.describe()["rule"] == "expected_value"
    with pytest.raises(UserError, match="threshold or expected_value"):
        Learned(bundle, rule="sometimes")
    # (a, b) shift the head's calibrated P(accept) as σ(a·logit P + b): an optimistic b drafts at least as long
    x = step(dist_with_entropy(1.0))
    p0 = pol._prob(x)

    def drafted(b):
        pol = Learned(bundle, rule="expected_value", profile=ev_profile(), b=b)
        return next((j + 1 for j in range(16) if pol.should_stop(step(x.probs, pos_in_round=j, position=j))), 17)

    lengths = [drafted(b) for b in (-8.0, -2.0, 0.0, 2.0, 8.0)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    thr = Learned(bundle, threshold=0.5, a=1.0, b=-100.0)
    assert thr.should_stop(x) and not Learned(bundle, threshold=min(p0 + 1e-3, 0.999), b=50.0).should_stop(x)
