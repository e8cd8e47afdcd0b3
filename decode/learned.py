"""Trained heads as stop policies (models.heads): DISCO / SpecDec++-style heads under a threshold or the
expected-value rule, and SPRINTER's verifier (approximate verification)."""

from __future__ import annotations

import math

from decode.expected_value import ExpectedValueRule, platt
from decode.policies import StopPolicy
from models.features.signals import DraftStep
from utils.cli import UserError


class Learned(StopPolicy):
    """A trained head (models.heads): DISCO / SPRINTER-style heads stop when P(accept) < threshold; a SpecDec++ head
    (a `cumulative` family) stops when 1 − Π P(accept) over the round > threshold. The threshold defaults to the one
    stored in the checkpoint. What the head reads (q, the hidden state, the context, the last verification) comes from
    its feature spec, so the loop computes exactly that."""

    name = "learned"
    needs_probs = True
    learned = True

    def __init__(self, bundle, threshold: float | None = None, max_len: int = 40, name: str | None = None,
                 rule: str = "auto", profile=None, a: float = 1.0, b: float = 0.0):
        super().__init__(max_len)
        rule, threshold = self.resolve_rule(bundle, threshold, rule)
        # P(accept) read as σ(a·logit P + b): the same calibration shift the training-free expected_value row tunes,
        # so both rows of the expected-value rule get the same grid (a=1, b=0: the head's own calibration)
        self.a, self.b = float(a), float(b)
        self.rule = ExpectedValueRule(profile, self.max_len) if rule == "expected_value" else None
        self.bundle = bundle
        self.kind = bundle.kind
        self.cumulative = _family(bundle).cumulative
        self.threshold = float(bundle.threshold if threshold is None else threshold)
        spec = bundle.spec
        self.needs_hidden = spec.reads_hidden
        self.needs_probs = spec.reads_probs
        self.needs_context = spec.needs_context
        self.needs_verify_stats = spec.needs_verify
        # the feature kind's decode-time row builder (DISCO rows: top-k, H_q, position in round, + disco_plus groups)
        weight = next(bundle.head.parameters(), None)
        self.rows = spec.family.decoder(spec, device=None if weight is None else weight.device)
        self.k = int(spec.k)
        self._survive = 1.0
        if name:
            self.name = name
        # the head is a few small matrices on the draft's device, run as bare tensor ops (HeadBundle.scorer)
        self.score = bundle.scorer()

    @classmethod
    def resolve_rule(cls, bundle, threshold=None, rule: str = "auto") -> tuple[str, float | None]:
        """(rule, threshold). `auto` with no threshold: the rule `python -m train` chose for speed on validation
        (eval.replay.speed_rule, stored in the checkpoint as `decode_rule`) — the out-of-the-box rule; a checkpoint
        without one: expected_value for a calibrated DISCO-style head, else its stored threshold. A given threshold or
        an explicit rule is checked and kept."""
        if rule not in ("auto", "threshold", "expected_value"):
            raise UserError(f"policy.learned.rule must be auto, threshold or expected_value, got '{rule}'")
        if rule != "auto" or threshold is not None:
            return ("threshold" if rule == "auto" else rule), threshold
        stored = getattr(bundle, "decode_rule", None)
        if stored and not cls.approximate:
            return str(stored["rule"]), stored.get("threshold")
        calibrated = (getattr(bundle, "calibration", None) or {}).get("mode", "none") != "none"
        use_ev = calibrated and not cls.approximate and not _family(bundle).cumulative
        return ("expected_value" if use_ev else "threshold"), None

    @classmethod
    def wants_profile(cls, params, bundle=None):
        """The expected-value rule reads the profile; a threshold does not (so no profile is measured for it)."""
        return cls.resolve_rule(bundle, params.get("threshold"), params.get("rule", "auto"))[0] == "expected_value"

    def reset(self, **ctx):
        self._survive = 1.0
        self.rows.reset()

    def _prob(self, step: DraftStep) -> float:
        if self.needs_context and step.context is None:
            raise UserError(f"head {self.bundle.path} reads copy/token/text features that need the decoder's context, "
                            "which this caller does not pass (DraftStep.context); run it through python -m decode "
                            "or eval.replay")
        if self.needs_verify_stats and step.verify is None and step.position_in_round == 0 and step.position > 0:
            raise UserError(f"head {self.bundle.path} reads the last verification's statistics, which this caller "
                            "does not pass (DraftStep.verify); run it through python -m decode or eval.replay")
        return self.score(self.rows.row(step))

    def should_stop(self, step):
        if step.position_in_round == 0:
            self._survive = 1.0
            if self.rule is not None:
                self.rule.reset()
        a = self._prob(step)
        if self.a != 1.0 or self.b != 0.0:
            a = min(max(a, 1e-6), 1 - 1e-6)
            a = platt(math.log(a / (1 - a)), self.a, self.b)
        if self.rule is not None:  # expected value under the cost profile (the head's P(accept) is calibrated)
            return self.rule.stop(a)
        if self.cumulative:
            self._survive *= a
            return 1.0 - self._survive > self.threshold
        return a < self.threshold

    def describe(self):
        return {**super().describe(), "kind": self.kind, "threshold": self.threshold, "ckpt": self.bundle.path,
                "rule": "expected_value" if self.rule is not None else "threshold", "a": self.a, "b": self.b}


def _family(bundle):
    """The head family (models.heads network class) of a bundle: what its checkpoint's arch names, else its kind's."""
    from models.heads import head_family

    return head_family(bundle.kind, getattr(bundle, "arch", None))


class Sprinter(Learned):
    """SPRINTER: the verifier head decides after each drafted token; a reject ends the round and only that token is
    checked by the target (approximate verification, decode/verify.py). Inference threshold 0.5 (SPRINTER §A.5)."""

    name = "sprinter"
    approximate = True
