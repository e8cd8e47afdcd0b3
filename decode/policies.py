"""Stop policies: after each drafted token, continue drafting or hand the round to the target?

One interface, shaped like transformers' candidate generator (`update_candidate_strategy` after each verification):
- `reset(**ctx)` once per prompt (the oracle receives its lookahead there);
- `should_stop(step: DraftStep) -> bool` after each drafted token (the token is kept in the round either way);
- `observe(drafted, accepted)` after each verification (the heuristic and AdaEDL adapt there).
The loop itself enforces `max_len` (every policy has a cap), the token budget and EOS.

Class attributes tell the loop what to compute: `needs_probs` (q as a distribution — greedy constant/heuristic/oracle
skip the softmax), `needs_hidden` (the draft's last hidden state), `needs_context` (DraftStep.context: prompt +
committed output), `needs_verify_stats` (DraftStep.verify: the last verification's target statistics), `greedy_only`,
`approximate` (SPRINTER verification instead of exact). And they tell decode, the replay and the bar what a policy is:
`needs_profile` (its stop rule reads the measured cost profile), `learned` (reads a trained head: `name:PATH`),
`oracle` (reads the target's output), `external` (runs its own loop, decode/hf.py), `trace_score` (the per-token
score it thresholds, for the replay's AUROC column). Nothing outside this class reads a policy's name.

A policy is found by name: `conf/policy/<name>.yaml` on Hydra's config search path (utils.discover; a user's conf dir
added with `hydra.searchpath=[file:///DIR]` counts), whose `_target_` names the class and whose other keys are its
defaults (with their sources). So adding a policy is one StopPolicy subclass + one yaml (docs/adding_a_policy.md).
decode.yaml holds an open `policy: {}` dict; a listed policy's yaml is read when the policy is built and
`policy.<name>.<param>=V` is merged over it (decode.methods).
"""

from __future__ import annotations

import math
from pathlib import Path

from models.features.signals import DraftStep
from utils.cli import UserError


class StopPolicy:
    name = "base"
    needs_probs = True
    needs_hidden = False
    needs_context = False
    needs_verify_stats = False
    greedy_only = False
    approximate = False
    oracle = False
    needs_profile = False  # the stop rule reads the measured cost profile: built with profile=
    learned = False  # reads a trained head: listed as `name:PATH` (or policy_ckpt / policy.<name>.ckpt), built with it
    external = False  # runs its own loop (transformers' generate, decode/hf.py), not decode.loop: built with pair=
    trace_score: str | None = None  # the per-token score it thresholds, as a trace score (`max_q` | `neg_entropy`)
    tree = False  # a tree builder (decode.tree_builders): the loop drafts and verifies a token tree, not a chain

    def __init__(self, max_len: int = 40):
        if int(max_len) < 1:
            raise UserError(f"policy.{self.name}.max_len must be ≥ 1, got {max_len}")
        self.max_len = int(max_len)

    def reset(self, **ctx) -> None:
        """Per prompt. Adaptive state that should carry across prompts (AdaEDL's λ) is kept unless documented."""

    def should_stop(self, step: DraftStep) -> bool:
        return False

    def observe(self, drafted: int, accepted: int) -> None:
        """After each verification: `drafted` tokens were proposed in the round, `accepted` of them kept."""

    def describe(self) -> dict:
        return {"name": self.name, "max_len": self.max_len}

    @classmethod
    def wants_profile(cls, params: dict, bundle=None) -> bool:
        """Whether a policy built with `params` (and, for a learned one, its head) reads the cost profile."""
        return cls.needs_profile


class Constant(StopPolicy):
    """Static speculation length K (the classic SD baseline, DISCO's SL-5): stop after K tokens."""

    name = "constant"
    needs_probs = False

    def __init__(self, k: int = 5, max_len: int | None = None):
        super().__init__(max_len or k)
        if int(k) < 1:
            raise UserError(f"policy.constant.k must be ≥ 1, got {k}")
        self.k = int(k)

    def should_stop(self, step):
        return step.position_in_round + 1 >= self.k

    def describe(self):
        return {**super().describe(), "k": self.k}


class StaticOpt(Constant):
    """Static K chosen on the validation split (`mode=tune`, grid `tune.grid.static_opt.k`): DISCO's "SL-opt" row,
    listed beside `constant` so a table shows both the default K=5 and the best fixed K."""

    name = "static_opt"


class Heuristic(StopPolicy):
    """transformers' `heuristic` schedule: all drafted accepted → K + 2, else K − 1 (min 1), capped by max_len."""

    name = "heuristic"
    needs_probs = False

    def __init__(self, k: int = 5, max_len: int = 40, per_prompt_reset: bool = True):
        super().__init__(max_len)
        self.k0 = int(k)
        self.k = self.k0
        self.per_prompt_reset = bool(per_prompt_reset)

    def reset(self, **ctx):
        if self.per_prompt_reset:
            self.k = self.k0

    def should_stop(self, step):
        return step.position_in_round + 1 >= self.k

    def observe(self, drafted, accepted):
        if drafted == 0:
            return
        self.k = min(self.max_len, self.k + 2) if accepted == drafted else max(1, self.k - 1)

    def describe(self):
        return {**super().describe(), "k": self.k0}


class Oracle(StopPolicy):
    """Greedy upper bound: drafts exactly to the first mismatch with the target-only output of the same run.

    The lookahead (`reset(lookahead=[...])`) is read, not computed, so the oracle's wall time holds no extra target
    work. The mismatching token itself is drafted (it costs the draft step that reveals it) and then corrected.
    """

    name = "oracle"
    needs_probs = False
    greedy_only = True
    oracle = True

    def __init__(self, max_len: int = 40):
        super().__init__(max_len)
        self.lookahead: list[int] = []

    def reset(self, lookahead=None, **ctx):
        if lookahead is None:
            raise UserError("the oracle policy needs the target-only output of the same prompt (run it via decode)")
        self.lookahead = list(lookahead)

    def should_stop(self, step):
        pos = step.position
        return pos >= len(self.lookahead) or step.token != self.lookahead[pos]


class _ThresholdEMA:
    """Draft & Verify / AdaEDL Algorithm 1: move λ toward a target acceptance rate α with two EMAs."""

    def __init__(self, lam0, alpha, beta1, beta2, eps, max_len):
        self.lam0, self.alpha, self.beta1, self.beta2, self.eps, self.max_len = lam0, alpha, beta1, beta2, eps, max_len
        self.lam = lam0
        self.ar = None

    def reset(self):
        self.lam, self.ar = self.lam0, None

    def update(self, drafted, accepted):
        if drafted == 0:
            return
        ar_i = accepted / drafted
        self.ar = ar_i if self.ar is None else self.beta1 * self.ar + (1 - self.beta1) * ar_i
        if self.ar < self.alpha:
            target = self.lam + self.eps
        elif accepted != self.max_len:
            target = self.lam - self.eps
        else:
            target = self.lam
        self.lam = self.beta2 * self.lam + (1 - self.beta2) * target


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
        P(accept) if one exists (bench/stop_rule_probe.py tries a next-token head); by default a itself."""
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


class MaxConfidence(StopPolicy):
    """Stop when max q < λ (AdaEDL's Max-Confidence-SPD; transformers' `assistant_confidence_threshold`, default 0.4).

    `adapt`: `none` (fixed λ), `ema` (AdaEDL Algorithm 1, as in AdaEDL's comparison), or `roc` (transformers: after
    each round refit λ on the history of (confidence, accepted) minimising FPR + 3·FNR, once both classes were seen).
    """

    name = "max_confidence"
    trace_score = "max_q"

    def __init__(self, lam=0.4, adapt="none", max_len=40, alpha=0.9, beta1=0.5, beta2=0.9, eps=0.01, window=None):
        super().__init__(max_len)
        if adapt not in ("none", "ema", "roc"):
            raise UserError(f"policy.{self.name}.adapt must be none, ema or roc, got '{adapt}'")
        self.lam0, self.lam, self.adapt = float(lam), float(lam), adapt
        self.window = None if window is None else int(window)  # roc: drafted tokens of history kept (None: all)
        self.ema = _ThresholdEMA(float(lam), alpha, beta1, beta2, eps, self.max_len)
        self.history_conf: list[float] = []
        self.history_acc: list[int] = []
        self._round: list[float] = []

    def reset(self, **ctx):
        self._round = []

    def should_stop(self, step):
        conf = float(step.probs.max())
        if self.adapt == "roc":
            self._round.append(conf)
        return conf < (self.ema.lam if self.adapt == "ema" else self.lam)

    def observe(self, drafted, accepted):
        if self.adapt == "ema":
            self.ema.update(drafted, accepted)
        elif self.adapt == "roc":
            self.history_conf.extend(self._round[:drafted])
            self.history_acc.extend([1] * accepted + [0] * (min(drafted, len(self._round)) - accepted))
            self._round = []
            if self.window is not None and len(self.history_acc) > self.window:
                del self.history_conf[: -self.window], self.history_acc[: -self.window]
            if len(self.history_acc) > 5 and 0 < sum(self.history_acc) < len(self.history_acc):
                from sklearn.metrics import roc_curve

                fpr, tpr, thr = roc_curve(self.history_acc, self.history_conf)
                best = int((fpr + 3 * (1 - tpr)).argmin())
                self.lam = float(min(thr[best], 1.0))

    def describe(self):
        return {**super().describe(), "lam": self.lam0, "adapt": self.adapt, "window": self.window}


class OnlineROC(MaxConfidence):
    """Online adaptation as its own row (issue 16's comparator): max-confidence whose λ is refit after every round
    from the ROC of the last `window` drafted tokens of this run (transformers' rule: minimise FPR + 3·FNR), so it
    sits beside the fixed-λ row in one run. `lam` is only the starting point."""

    name = "online_roc"
    trace_score = None  # the same max q as max_confidence: its AUROC is reported once, on that row

    def __init__(self, lam=0.4, adapt="roc", window=2000, **kw):
        super().__init__(lam=lam, adapt=adapt, window=window, **kw)


class SVIP(StopPolicy):
    """SVIP: stop when √(c·H_q) > h — the entropy lower bound on acceptance falls below 1 − h (official c=0.15, h=0.3)."""

    name = "svip"
    trace_score = "neg_entropy"

    def __init__(self, c: float = 0.15, h: float = 0.3, max_len: int = 40):
        super().__init__(max_len)
        self.c, self.h = float(c), float(h)
        # √(c·H) > h  <=>  H > h²/c: one comparison per token, no sqrt
        self.h_max = self.h * self.h / self.c if self.c > 0 else math.inf

    def should_stop(self, step):
        return float(step.entropy) > self.h_max

    def describe(self):
        return {**super().describe(), "c": self.c, "h": self.h}


class AdaEDL(StopPolicy):
    """AdaEDL: stop when 1 − √(γ·H_q) < λ, with λ adapted after each round by Algorithm 1 (γ=0.2, β1=0.5, β2=0.9,
    ε=0.01, α=0.9). λ carries across prompts like the paper's running system; `per_prompt_reset` restarts it at λ0."""

    name = "adaedl"
    trace_score = "neg_entropy"

    def __init__(self, gamma=0.2, lambda0=0.7, alpha=0.9, beta1=0.5, beta2=0.9, eps=0.01, max_len=40,
                 per_prompt_reset=False):
        super().__init__(max_len)
        self.gamma = float(gamma)
        self.ema = _ThresholdEMA(float(lambda0), alpha, beta1, beta2, eps, self.max_len)
        self.per_prompt_reset = bool(per_prompt_reset)

    def reset(self, **ctx):
        if self.per_prompt_reset:
            self.ema.reset()

    def should_stop(self, step):
        return 1.0 - math.sqrt(self.gamma * max(float(step.entropy), 0.0)) < self.ema.lam

    def observe(self, drafted, accepted):
        self.ema.update(drafted, accepted)

    def describe(self):
        return {**super().describe(), "gamma": self.gamma, "lambda0": self.ema.lam0, "alpha": self.ema.alpha}


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


# ------------------------------------------------------------------------------------------- finding and building


def policy_config(name: str, cfg=None) -> dict | None:
    """conf/policy/<name>.yaml (on the config search path of `cfg` or the running app) as a dict; None: no such file."""
    from utils import discover

    return discover.load("policy", name, cfg)


def policy_target(name: str, cfg=None) -> str | None:
    """The `_target_` of a policy's yaml, checked to name a StopPolicy (None: no such policy)."""
    from utils import discover

    path = discover.find("policy", name, cfg)
    if path is None:
        return None
    target = discover.read(path).get("_target_")
    _class_of(target, name, discover.shown(path))
    return str(target)


def policy_class(name: str, cfg=None) -> type[StopPolicy] | None:
    """The class of the policy called `name` (None: no conf/policy/<name>.yaml on the search path)."""
    target = policy_target(name, cfg)
    return None if target is None else _class_of(target, name)


def _class_of(target, name: str, where: str | None = None) -> type[StopPolicy]:
    from utils import discover

    return discover.target_class(target, StopPolicy, f"policy '{name}' ({where or f'conf/policy/{name}.yaml'})")


def known_policies(cfg=None) -> list[str]:
    """Every policy name on the search path, sorted."""
    from utils import discover

    return discover.names("policy", cfg)


def _head_policies(cfg=None) -> list[str]:
    """The policies that take a head checkpoint (`learned`), for error messages; unloadable yamls are left out."""
    out = []
    for name in known_policies(cfg):
        try:
            cls = policy_class(name, cfg)
        except UserError:
            continue
        if cls is not None and cls.learned:
            out.append(name)
    return out


def split_spec(spec: str) -> tuple[str, str | None]:
    """`name` or `name:PATH` → (name, path), unchecked."""
    name, _, path = str(spec).partition(":")
    return name.strip(), (path or None)


def parse_spec(spec: str, cfg=None) -> tuple[str, str | None]:
    """`name` or `name:PATH` (learned heads) → (name, path), for a policy found on the search path (or `target`)."""
    name, path = split_spec(spec)
    cls = policy_class(name, cfg) if name != "target" else None
    if cls is None and name != "target":
        heads = " or ".join(f"{h}:PATH" for h in _head_policies(cfg))
        raise UserError(f"unknown policy '{name}'; known: {', '.join(['target', *known_policies(cfg)])} "
                        f"(heads as {heads})")
    if path and (cls is None or not cls.learned):
        heads = " and ".join(f"{h}:PATH" for h in _head_policies(cfg))
        raise UserError(f"policy '{name}' takes no checkpoint; only {heads} do")
    return name, path


def build_policy(spec: str, params: dict | None = None, pair=None, ckpt: str | None = None,
                 profile=None, target: str | None = None) -> StopPolicy:
    """A policy from its spec (`svip`, `learned:PATH`) and its params (conf/policy/<name>.yaml + overrides), built by
    `hydra.utils.instantiate` from its class (`target`: the yaml's `_target_`, found by name when not given) and the
    params; what else the class gets follows its capabilities: `external` → the pair, `learned` → its head,
    `wants_profile` → `profile` (models.cost, measured for the pair when not given)."""
    from hydra.utils import instantiate

    name, path = parse_spec(spec) if target is None else split_spec(spec)
    if name == "target":
        raise UserError("'target' is target-only decoding, not a stop policy")
    target = target or policy_target(name)
    cls = _class_of(target, name)
    params = {k: v for k, v in dict(params or {}).items() if k not in ("ckpt", "_name")}
    # a partial: the pair, the head and the profile are objects handed to the constructor, not config values
    make = instantiate({"_target_": target, **params}, _partial_=True, _convert_="all")
    see = f"; see conf/policy/{name}.yaml"
    if cls.external:
        if pair is None:
            raise UserError(f"'{name}' runs transformers' generate and needs the pair")
        return _call(make, {"pair": pair}, name, see)
    extra: dict = {}
    bundle = None
    if cls.learned:
        bundle = _load_bundle(name, path or ckpt, pair)
        extra["bundle"] = bundle
    if cls.wants_profile(params, bundle):  # the profile only for a rule that reads it; measured once, then cached
        if profile is None and pair is not None:
            from models.cost import get_profile

            profile = get_profile(pair)
        extra["profile"] = profile
    return _call(make, extra, f"policy {name}", "" if cls.learned else see)


def _load_bundle(name: str, path: str | None, pair):
    """A learned policy's head, checked against the pair and moved to its device (features stay there: no copy per
    drafted token)."""
    if not path:
        raise UserError(f"policy '{name}' needs a head: {name}:PATH_TO_CKPT, policy_ckpt=PATH or policy.{name}.ckpt=PATH")
    from models.heads import load_head

    bundle = load_head(Path(path))
    if pair is not None:
        bundle.check_pair(pair)
        bundle.head.to(pair.device)
    return bundle


def _call(make, extra: dict, what: str, hint: str = "") -> StopPolicy:
    """`make(**extra)`; a constructor that rejects its parameters (TypeError) is one user-error line."""
    try:
        return make(**extra)
    except TypeError as err:
        raise UserError(f"bad parameter for {what}: {err}{hint}") from None
