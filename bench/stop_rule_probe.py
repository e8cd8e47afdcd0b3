"""Where the static-K → oracle gap is lost: the head's score for the *current* token, or the stop rule's guess of the
*next* one (issue 16). Gradient-boosted probes on the disco_plus features, replayed with eval.replay's machinery.

    python -m bench.stop_rule_probe [out_dir=results/bench] [cost_profile=results/stop_heads/profile.json]

The expected-value rule (decode.expected_value.ExpectedValueRule) decides after drafted token k whether to draft k + 1
from Π a_i (the round survives so far) and a guess of a_{k+1}, which no policy has seen yet: it uses a_k. This
probe measures, on the heads' traces (train: MBPP 511-570, calibration shift chosen on validation 571-600, replayed on
the 500 test prompts, cost model under results/stop_heads/profile.json):
- how well a_k predicts the next token's acceptance (AUROC on rows whose own token was accepted), against a probe
  trained for exactly that (`next head`: the same features, label = the next row's acceptance);
- the replayed speedup with a_next = a_k, with the next head's estimate, and with the next token's true outcome
  (an upper bound on what a perfect guess of a_{k+1} would buy, current-token scores unchanged);
- the current-token probe with two feature groups the head lacks: token classes of the drafted and previous token
  (leading space, newline, digit, alpha, punctuation, length) and the line position (tokens since the last newline,
  position in the continuation, prompt length);
- the rule's renewal-reward form (`RateThreshold`): a long-run rate λ tuned on validation in place of the round's E/T;
- how good a guess of a_{k+1} the bar would need: synthetic next-token guesses of known AUROC (binormal scores on
  the next row's true outcome, turned into their exact posterior probability, so perfectly calibrated).
Writes stop_rule_probe.json / .md under out_dir: a fixed measurement on fixed trace folders, with only its output
folder and profile file to choose.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
from omegaconf import DictConfig
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.metrics import roc_auc_score

from bench import REPO, command, repo_path
from decode.expected_value import ExpectedValueRule, platt
from decode.policies import StopPolicy
from eval.continuations import CONTINUATION_COLUMNS, continuations, load_greedy_traces
from eval.replay import replay_one, summarize
from models.cost import CostProfile
from models.features.spec import FeatureSpec, features_from_columns, needed_columns
from models.features.text import token_classes
from models.features.trace import continuation_starts
from utils.cli import UserError, hydra_entry
from utils.files import write_result

TRACES = REPO / "traces" / "smollm2_135m--mbpp--target_ar-t0-p1-n128-s0--"  # the heads' traces (results/stop_heads)
SPEC = FeatureSpec("disco_plus", groups=("verify", "copy", "token"))
STUDY = REPO / "conf" / "experiment" / "study" / "stop_heads.yaml"  # its expected_value grid: the (a, b) every row gets


def shift_grid() -> list[tuple[float, float]]:
    """The calibration shifts (a, b) the study tunes the training-free expected-value row and the heads over."""
    from omegaconf import OmegaConf

    grid = OmegaConf.load(STUDY).tune.grid.expected_value
    return [(float(a), float(b)) for a in grid.a for b in grid.b]


def line_features(cols: dict, newline: np.ndarray) -> np.ndarray:
    """(N, 3): tokens since the last newline in prompt + context before the row, position, prompt length."""
    starts = np.flatnonzero(continuation_starts(cols))
    ends = np.append(starts[1:], len(cols["position"]))
    ctx = cols["context_token"].astype(np.int64)
    out = np.zeros((len(ctx), 3), np.float32)
    for a, b in zip(starts, ends):
        prompt = np.asarray(cols["prompt_tokens"][a], dtype=np.int64)
        where = np.flatnonzero(newline[prompt])
        since = len(prompt) - 1 - where[-1] if len(where) else len(prompt)
        for i in range(a, b):
            out[i] = [since, cols["position"][i], len(prompt)]
            since = 0 if newline[ctx[i]] else since + 1
    return out


def load(name: str, classes: np.ndarray):
    names = list(dict.fromkeys([*needed_columns(SPEC), *CONTINUATION_COLUMNS]))
    cols, _ = load_greedy_traces(Path(f"{TRACES}{name}"), names)
    x = features_from_columns(cols, SPEC).numpy()
    extra = np.c_[classes[cols["draft_token"].astype(np.int64)], classes[np.maximum(x[:, -1], 0).astype(np.int64)],
                  line_features(cols, classes[:, 1] > 0)]
    y = (cols["draft_token"] == cols["target_token"]).astype(np.int64)
    has_next = np.zeros(len(y), bool)
    has_next[:-1] = ~continuation_starts(cols)[1:]
    y_next = np.where(has_next, np.roll(y, -1), 0)
    return {"x": x, "extra": extra, "y": y, "next": y_next, "has_next": has_next, "conts": continuations(cols)}


def gbm(x, y):
    return HistGradientBoostingClassifier(max_iter=300, learning_rate=0.05, random_state=0).fit(x, y)


class RowScores(StopPolicy):
    """The expected-value rule on per-row P(accept) and, optionally, per-row guesses of the next row's, read through
    the calibration shift σ(a·logit + b) (decode.expected_value.platt) the study tunes for every calibrated score."""

    name = "probe"
    needs_probs = False

    def __init__(self, profile, a: float, b: float, max_len: int = 16):
        super().__init__(max_len)
        self.rule, self.a, self.b = ExpectedValueRule(profile, max_len), a, b

    def shift(self, p: float) -> float:
        p = min(max(float(p), 1e-6), 1 - 1e-6)  # as decode.learned.Learned reads a head's P(accept)
        return platt(math.log(p / (1 - p)), self.a, self.b)

    def reset(self, synthetic=None, **ctx):
        self.cur, self.nxt = synthetic
        self.rule.reset()

    def should_stop(self, step):
        if step.position_in_round == 0:
            self.rule.reset()
        i = step.position
        return self.rule.stop(self.shift(self.cur[i]), None if self.nxt is None else self.shift(self.nxt[i]))


class RateThreshold(RowScores):
    """The renewal-reward form of the same rule: keep drafting while Π a_i · a_next ≥ λ · (marginal cost of one more
    token), λ a long-run rate tuned on validation, instead of the round's own E/T. Optimal stopping for tokens per
    unit time across rounds has this form; the question is whether it beats the per-round comparison in practice."""

    def __init__(self, profile, lam: float, max_len: int = 16):
        super().__init__(profile, 1.0, 0.0, max_len)
        self.lam = lam

    def should_stop(self, step):
        if step.position_in_round == 0:
            self.survive = 1.0
        a = self.shift(self.cur[step.position])
        self.survive *= a
        k, time = step.position_in_round + 1, self.rule.time  # the rule's measured round costs
        return self.survive * a <= self.lam * (time[k + 1] - time[k])


LAMBDAS = [round(0.6 + 0.1 * i, 1) for i in range(25)]  # 0.6 .. 3.0 tokens per target step


NEXT_AUROCS = [0.75, 0.8, 0.85, 0.9, 0.95]


def synthetic_next(y_next: np.ndarray, auroc: float, base_rate: float, seed: int) -> np.ndarray:
    """Calibrated P(next accepted) of a given AUROC: scores N(μ·y, 1), μ = √2·Φ⁻¹(AUROC) as eval.replay's synthetic
    heads, mapped through their posterior logit μ·s − μ²/2 + logit(base rate)."""
    from scipy.special import expit, logit
    from scipy.stats import norm

    mu = math.sqrt(2.0) * norm.ppf(auroc)
    s = mu * y_next + np.random.default_rng(seed).standard_normal(len(y_next))
    return expit(mu * s - mu * mu / 2 + logit(base_rate))


def per_cont(data, values):
    out, i = [], 0
    for c in data["conts"]:
        out.append(None if values is None else values[i : i + len(c.accepted)])
        i += len(c.accepted)
    return out


def replay_speed(data, cur, nxt, profile, a, b) -> float:
    pol = RowScores(profile, a, b)
    cur_c, nxt_c = per_cont(data, cur), per_cont(data, nxt)
    rounds = [replay_one(pol, c, synthetic=(u, v)) for c, u, v in zip(data["conts"], cur_c, nxt_c)]
    return summarize(rounds, profile, data["conts"])["cost_model_speedup"]


def rate_speed(data, cur, profile, lam) -> float:
    pol = RateThreshold(profile, lam)
    rounds = [replay_one(pol, c, synthetic=(u, None)) for c, u in zip(data["conts"], per_cont(data, cur))]
    return summarize(rounds, profile, data["conts"])["cost_model_speedup"]


def tuned_speed(val, test, scores_val, scores_test, profile) -> dict:
    """(a, b) chosen on validation for cost-model speedup, then the test speedup — as the study tunes every row."""
    best = max(shift_grid(), key=lambda ab: replay_speed(val, *scores_val, profile, *ab))
    return {"a": best[0], "b": best[1], "speedup": replay_speed(test, *scores_test, profile, *best)}


def run(cfg: DictConfig) -> None:
    from models.pair import load_pair

    profile_path = repo_path(cfg.cost_profile)
    if not profile_path.is_file():
        raise UserError(f"cost_profile={cfg.cost_profile} not found; pass a profile file (python -m decode.profile out=F)")
    classes = token_classes(load_pair("smollm2_135m").tokenizer)
    tr, va, te = (load(s, classes) for s in ("train", "validation", "test-lim500"))
    profile = CostProfile.from_dict(json.loads(profile_path.read_text()))
    cur = gbm(tr["x"], tr["y"])
    rows = tr["has_next"] & (tr["y"] == 1)  # the rule only asks about a next token while the round survives
    nxt = gbm(tr["x"][rows], tr["next"][rows])
    rich = gbm(np.c_[tr["x"], tr["extra"]], tr["y"])
    p = {n: {"cur": cur.predict_proba(d["x"])[:, 1], "next": nxt.predict_proba(d["x"])[:, 1],
             "rich": rich.predict_proba(np.c_[d["x"], d["extra"]])[:, 1], "truth": d["next"] * 0.998 + 0.001}
         for n, d in (("val", va), ("test", te))}
    ask = te["has_next"] & (te["y"] == 1)
    result = {
        "command": command("stop_rule_probe"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "traces": f"{TRACES.relative_to(REPO)}{{train,validation,test-lim500}}",
        "profile": str(profile_path.resolve().relative_to(REPO)) if profile_path.resolve().is_relative_to(REPO)
        else str(cfg.cost_profile), "test_rows": int(len(te["y"])),
        "auroc_current": {"max_q": roc_auc_score(te["y"], te["x"][:, 0]), "probe": roc_auc_score(te["y"], p["test"]["cur"]),
                          "probe + token classes + line position": roc_auc_score(te["y"], p["test"]["rich"])},
        "auroc_next_given_current_accepted": {"a_k (the rule's guess)": roc_auc_score(te["next"][ask], p["test"]["cur"][ask]),
                                              "next head": roc_auc_score(te["next"][ask], p["test"]["next"][ask])},
        "replay": {},
    }
    variants = {"a_next = a_k (the rule today)": ("cur", None), "a_next = next head": ("cur", "next"),
                "a_next = the next token's outcome (bound)": ("cur", "truth"),
                "a_k from the probe + token classes + line position": ("rich", None)}
    base = float(tr["next"][rows].mean())  # P(next accepted | current accepted) on the training rows
    for i, a in enumerate(NEXT_AUROCS):
        label = f"a_next = a calibrated synthetic guess of AUROC {a:g}"
        variants[label] = ("cur", label)
        for j, (n, d) in enumerate((("val", va), ("test", te))):
            p[n][label] = synthetic_next(d["next"], a, base, seed=2 * i + j)
    for label, (c, n) in variants.items():
        sv = (p["val"][c], None if n is None else p["val"][n])
        st = (p["test"][c], None if n is None else p["test"][n])
        result["replay"][label] = tuned_speed(va, te, sv, st, profile)
        print(f"{label}: {result['replay'][label]['speedup']:.3f}", flush=True)
    lam = max(LAMBDAS, key=lambda x: rate_speed(va, p["val"]["cur"], profile, x))
    result["replay"]["renewal-reward threshold (λ tuned on validation), a_next = a_k"] = {
        "lambda": lam, "speedup": rate_speed(te, p["test"]["cur"], profile, lam)}
    lines = ["| probe (gradient-boosted, disco_plus features) | value |", "|---|---|"]
    lines += [f"| test AUROC, current token: {k} | {v:.3f} |" for k, v in result["auroc_current"].items()]
    lines += [f"| test AUROC, next token given the current accepted: {k} | {v:.3f} |"
              for k, v in result["auroc_next_given_current_accepted"].items()]
    lines += [f"| replayed cost-model speedup (500 test prompts), {k} | {v['speedup']:.3f} |"
              for k, v in result["replay"].items()]
    write_result(repo_path(cfg.out_dir), "stop_rule_probe", result, lines)


if __name__ == "__main__":
    hydra_entry("bench/stop_rule_probe")(run)()
