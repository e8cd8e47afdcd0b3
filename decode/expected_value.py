"""The expected-value stop rule (SpecDec++ / DSpark / llama.cpp's expected-value drafting, costed with the measured
profile) and the training-free policy that feeds it a calibrated draft score (max q or −H_q), fixed or refit online."""

from __future__ import annotations

import math

from decode.policies import StopPolicy
from models.features.signals import DraftStep
from utils.cli import UserError


class ExpectedValueRule:
    """Stop as soon as one more drafted token would lower the round's expected tokens per unit time.

    The decision rule of SpecDec++ / DSpark / llama.cpp's expected-value drafting, costed with the measured profile
    (models.cost): after k drafted tokens with calibrated acceptance probabilities a_1..a_k, the round yields
    E = 1 + Σ_j Π_{i≤j} a_i tokens (the target always adds one) for T(k) target steps (`CostProfile.round_steps`:
    k draft calls, the first cold, and a pass over k + 1 tokens). Drafting one more adds Π_{i≤k} a_i · a_next tokens
    (a_next estimated by a_k) for T(k+1) − T(k) more; keep going while that raises E/T. Any calibrated score can feed it, so training-free and learned rows share one rule.
    """

    def __init__(self, profile, max_len: int):
        if profile is None:
            raise UserError("the expected-value stop rule needs the measured cost profile (models.cost); decode and "
                            "eval.replay pass it — build the policy with profile=...")
        self.time = [profile.round_steps(k, k) for k in range(max_len + 2)]  # a round of k drafted tokens
        self.reset()

    def reset(self):
        self.survive, self.expected, self.k = 1.0, 1.0, 0

    def stop(self, a: float, a_next: float | None = None) -> bool:
        """After a drafted token with P(accept) = a: stop drafting? `a_next`: an estimate of the next token's
        P(accept) if one exists (a next-token head was tried: docs/findings.md); by default a itself."""
        self.k += 1
        self.survive *= a
        self.expected += self.survive
        time, extra = self.time[self.k], self.time[self.k + 1] - self.time[self.k]
        return self.survive * (a if a_next is None else a_next) * time <= self.expected * extra


def platt(x: float, a: float, b: float) -> float:
    """σ(a·x + b): the calibration map of a training-free score (a head carries its own, models.heads)."""
    z = a * x + b
    return 1.0 / (1.0 + math.exp(-z)) if z > -60 else 0.0


class ExpectedValue(StopPolicy):
    """A training-free score, calibrated to P(accept) on validation traces, under the expected-value stop rule.

    `score`: `max_q` (the draft's max probability; x = logit(max q)) or `neg_entropy` (x = −H_q, SVIP's and
    AdaEDL's signal). P(accept) = σ(a·x + b), (a, b) set in conf/policy/expected_value.yaml — a = 1/T and b = the bias
    that `models.heads.fit_calibration` fits for a logit x on validation rows; a=1, b=0 reads max q as P(accept).

    `adapt: online` keeps refitting b while it decodes: after each verification, one step of online logistic
    regression (the log-likelihood's gradient in b, `lr` · (y − p)) per drafted token whose outcome the target
    revealed — the accepted ones (y = 1) and the first rejected (y = 0); those after it are unobserved, and P(accept)
    is the rule's conditional one. Why: a calibration fitted on one domain's validation rows is off on another (the
    draft agrees with the target on 0.72 of MBPP's greedy tokens, 0.46 of Spec-Bench's), and Spec-Bench's
    validation side holds one prompt per task. b carries across prompts (as AdaEDL's λ) unless `per_prompt_reset`.
    Measured: from b = 0 it ties the tuned b = −1 on Spec-Bench and the untuned rule on MBPP (docs/findings.md).
    """

    name = "expected_value"
    needs_profile = True

    def __init__(self, score: str = "max_q", a: float = 1.0, b: float = 0.0, max_len: int = 16, profile=None,
                 adapt: str = "none", lr: float = 0.05, per_prompt_reset: bool = False):
        super().__init__(max_len)
        if score not in ("max_q", "neg_entropy"):
            raise UserError(f"policy.{self.name}.score must be max_q or neg_entropy, got '{score}'")
        if adapt not in ("none", "online"):
            raise UserError(f"policy.{self.name}.adapt must be none or online, got '{adapt}'")
        if not float(lr) > 0:
            raise UserError(f"policy.{self.name}.lr must be > 0, got {lr}")
        self.score, self.a, self.b0 = score, float(a), float(b)
        self.b = self.b0
        self.adapt, self.lr, self.per_prompt_reset = adapt, float(lr), bool(per_prompt_reset)
        self.rule = ExpectedValueRule(profile, self.max_len)
        self._round: list[float] = []  # the round's drafted tokens' x, for `observe`

    def reset(self, **ctx):
        self._round = []
        if self.per_prompt_reset:
            self.b = self.b0

    def _x(self, step: DraftStep) -> float:
        if self.score == "max_q":
            m = min(max(float(step.probs.max()), 1e-6), 1 - 1e-6)
            return math.log(m / (1 - m))
        return -float(step.entropy)

    def should_stop(self, step):
        if step.position_in_round == 0:
            self.rule.reset()
            self._round = []
        x = self._x(step)
        if self.adapt == "online":
            self._round.append(x)
        return self.rule.stop(platt(x, self.a, self.b))

    def observe(self, drafted, accepted):
        if self.adapt != "online":
            return
        seen = self._round[: min(drafted, accepted + 1)]  # accepted ones, then the first rejected if any
        for j, x in enumerate(seen):
            self.b += self.lr * (float(j < accepted) - platt(x, self.a, self.b))
        self._round = []

    def describe(self):
        out = {**super().describe(), "score": self.score, "a": self.a, "b": self.b0}
        if self.adapt != "none":
            out.update(adapt=self.adapt, lr=self.lr, per_prompt_reset=self.per_prompt_reset, b_now=round(self.b, 4))
        return out


class ExpectedValueOnline(ExpectedValue):
    """`expected_value` with `adapt: online` (its docstring): the calibration refitted while decoding, as a row of its
    own so both run side by side in one decode (conf/policy/expected_value_online.yaml)."""

    name = "expected_value_online"

    def __init__(self, adapt: str = "online", **params):
        super().__init__(adapt=adapt, **params)
