"""The training-free stop rules: a static length (constant, static_opt), transformers' heuristic schedule, the
greedy oracle, max-confidence (fixed, EMA-adapted or ROC-refit λ), SVIP and AdaEDL — each one StopPolicy subclass
named by its conf/policy/<name>.yaml."""

from __future__ import annotations

import math

from decode.policies import StopPolicy
from utils.cli import UserError


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
