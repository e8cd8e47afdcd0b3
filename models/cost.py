"""The measured cost profile — what a draft step and a target pass over n tokens cost on this machine — and the cost
model that prices a decode row with it (`modeled_ms`). models.profiling measures and caches it.

`python -m decode.profile pair=NAME [threads=N] [profile.refresh=true]` prints it (the entry point is
decode/profile.py; the profile lives here, below data_gen and decode, because both write it).

The cost model used to assume a verification pass over K+1 tokens costs one target step and a draft step c of one.
On a CPU neither holds: in float32 a 3-token target pass cost 2× a 1-token one on a 2-core AMD EPYC, in bf16 1.1×.
So every cost the project models (decode's cost-model speedup, `mode=tune` by that metric, `eval.replay`, the
expected-value stop rule) reads this curve instead:
- `draft_ms[n-1]`: one draft call on n new tokens (1, or 2 after a fully accepted round) with logits at the last;
- `draft_cold_ms`: the first draft call of a round, right after a target pass has pushed the draft's weights out of
  the CPU caches (measured 1.2-1.5× a warm step on a 2-core EPYC: it is most of the draft cost of short rounds);
- `target_ms[n-1]`: one target call on n new tokens with logits at all n, right after another target call (as
  target-only decoding runs: its step is the unit every speedup is counted in);
- `verify_ms[n-1]`: the same call right after a draft call, as a verification of n-1 drafted tokens runs (every
  point is timed after the call that precedes it in the loop: models.profiling). Why a curve of its own: in the
  loop, passes after draft calls ran 2-9% above the back-to-back curve while target-only steps matched it within
  1.5% (`python -m eval.wall_gap`); the draft evicting the target from the CPU caches was the suspect, but on a
  2-core EPYC in bf16 the two curves came out equal (verify ÷ target 0.97-1.00 for n = 1..17, 2026-11-29 12:40), so
  the gap lies elsewhere. Version 2 profiles lack it (None): verification priced as `target_ms`;
- `prefill_ms`: first calls on a fresh cache of L prompt tokens, for a few L (interpolated between them);
- token trees (decode.tree) call the models differently, so their rounds read two more curves:
  `draft_level_ms[n-1]`, one draft call on a tree level of n nodes with logits at all n (tree-attention mask), and
  `target_tree_ms[n-1]`, one verification pass over the pending token + n-1 tree nodes (tree-attention mask). A
  tree's level call and masked pass cost more than a chain's one-token call and causal pass of the same size; priced
  as the chain's, the cost model overstated trees' speedups by 9-15% on a 2-core EPYC (results/tree_wall). Profiles
  measured before them lack both (None): their tree rounds are priced as chains. The tree curve runs to
  `max_tree_n` (33: the builders' 32 nodes + the pending token), past the chain's `max_n`: read past its end, a
  curve is extrapolated from its last two points, which the monotone fit often leaves equal — flat — and on that
  the builders chose 20-33-token passes that cost 1.2-1.4× a 13-token one (Intel Xeon, 2026-11-28). A tree pass
  is timed as verification runs it (mask built, pass, cache compacted to the accepted path), right beside the
  causal pass of its size, and its curve is kept at or above the causal one (`tree_curve`).
Each is the median of `repeats` timed calls after warm-up, through `models.lm.LM` (the loop's own code path), at
a context of `context` tokens; the three curves over n (`target_ms`, `target_tree_ms`, `draft_level_ms`) are then
made non-decreasing by isotonic regression (`monotone`; the medians stay in `extra.raw_ms`). Why: on a 2-core EPYC
VM a profile measured first thing in a fresh process (3 warm-up rounds, 15 repeats) put the target step 20% above
the loop's own and a 10-token tree pass at 1.00× it; the tree builders grew bigger trees on it (eagle2: 5.9 verified
nodes a round against 4.1) that lost 7% on the clock to the expected-value chain (2026-11-27 12:13). With 10
warm-up rounds, 25 repeats and monotone curves, two back-to-back profiles agreed within 0.07 on every ratio
t(n)/t(1) up to n = 12, and t(1) within 2% of the loop's step. Measured once per (pair, draft, dtype, linear, device,
threads, torch, machine) and cached under `<cache>/profiles/`; every decode run.json and trace manifest carries
the profile it used. A profile measured while other processes kept the CPU busy (`extra.other_load_cores`, read
from /proc/stat) is kept but named in one warning line whenever it is used: its ratios are a loaded machine's.
"""

from __future__ import annotations

import os
import platform

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from utils.cli import UserError

PROFILE_VERSION = 3  # 3: every point timed after its predecessor in the loop, `verify_ms`; 2 is still read (records)
READABLE_VERSIONS = (2, 3)
DRAFTER_PARTS = ("draft_ms", "draft_cold_ms", "prefill_draft_ms", "draft_level_ms", "verify_ms")


def machine() -> str:
    """CPU model and core count (and the GPU when there is one): the machine a number was measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = f"{cpu}, {os.cpu_count()} cores"
    from models.pair import ISA_LIMITS

    limits = [f"{k}={os.environ[k]}" for k in ISA_LIMITS if os.environ.get(k)]
    if limits:  # an older CPU emulated by capping the kernels' instruction set: its own profile, named in every result
        out += f", kernels capped by {' '.join(limits)}"
    if torch.cuda.is_available():
        out += f", {torch.cuda.get_device_name(0)}"
    return out


@dataclass
class CostProfile:
    """t_draft(n), t_target(n) for n = 1..len, and prefill times, in milliseconds (module docstring)."""

    key: dict
    draft_ms: list[float]
    target_ms: list[float]
    prefill_lengths: list[int]
    prefill_target_ms: list[float]
    prefill_draft_ms: list[float]
    context: int
    repeats: int
    date: str = ""
    draft_cold_ms: float | None = None  # None (older profiles): as a warm step
    extra: dict = field(default_factory=dict)
    draft_level_ms: list[float] | None = None  # None (older profiles): a level call as a one-token step
    target_tree_ms: list[float] | None = None  # None (older profiles): a tree pass as the causal one
    verify_ms: list[float] | None = None  # None (version 2, prompt lookup): a verification pass as `target_ms`
    version: int = PROFILE_VERSION

    # -- reading the curve ------------------------------------------------------------------------------------
    def target(self, n) -> np.ndarray | float:
        """t_target(n) in ms; linear beyond the measured range (n may be an array)."""
        return _curve(n, self.target_ms)

    def verify(self, n) -> np.ndarray | float:
        """t of a causal target pass over n tokens right after a draft call, as a chain's verification runs."""
        return _curve(n, self.verify_ms) if self.verify_ms else self.target(n)

    def draft(self, n=1) -> np.ndarray | float:
        return _curve(n, self.draft_ms)

    def prefill_target(self, length) -> np.ndarray | float:
        return _interp(length, self.prefill_lengths, self.prefill_target_ms)

    def prefill_draft(self, length) -> np.ndarray | float:
        return _interp(length, self.prefill_lengths, self.prefill_draft_ms)

    @property
    def cold_ms(self) -> float:
        """The first draft call of a round (`draft_cold_ms`; older profiles: a warm one-token step)."""
        return self.draft_cold_ms if self.draft_cold_ms is not None else self.draft_ms[0]

    @property
    def cost_ratio(self) -> float:
        """t_draft(1) ÷ t_target(1): the classic constant c."""
        return float(self.draft_ms[0] / self.target_ms[0])

    def verify_ratio(self, n) -> np.ndarray | float:
        """t_verify(n) ÷ t_target(1): what a verification pass over n tokens costs in target steps."""
        return self.verify(n) / self.target_ms[0]

    def level_draft(self, n) -> float:
        """t of a draft call on a tree level of n nodes (`draft_level_ms`; older profiles: a one-token step)."""
        return float(_curve(n, self.draft_level_ms) if self.draft_level_ms else self.draft_ms[0])

    def tree_target(self, n) -> float:
        """t of a verification pass over n tokens of a tree round (`target_tree_ms`; older profiles: `target`)."""
        return float(_curve(n, self.target_tree_ms) if self.target_tree_ms else self.target(n))

    def round_steps(self, draft_calls: int, verified: int, levels: list[int] | None = None) -> float:
        """One speculative round in target steps, as `modeled_ms` costs a later round: `draft_calls` draft calls,
        the first cold — right after a target pass — where the profile measured it, and one target pass over the
        pending token + `verified` drafted tokens. A chain (`levels` None): k one-token draft calls and a causal
        pass over k + 1. A token tree: `levels` lists the nodes of each draft call after the first (the levels the
        draft ran on, len(levels) = draft_calls − 1), each priced by `level_draft`, and the pass by `tree_target`.
        The one cost of a round that decode's expected-value rule and tree builders and the replays share."""
        if not draft_calls:
            return float(self.target(verified + 1) / self.target_ms[0])
        cold = self.cold_ms
        if levels is None:
            return float((cold + (draft_calls - 1) * self.draft_ms[0] + self.verify(verified + 1)) / self.target_ms[0])
        if len(levels) != draft_calls - 1:
            raise ValueError(f"round_steps: {draft_calls} draft calls need {draft_calls - 1} level sizes, got {levels}")
        draft = cold + sum(self.level_draft(w) for w in levels)
        return float((draft + self.tree_target(verified + 1)) / self.target_ms[0])

    def drafter_parts(self) -> dict:
        """The curves a drafter's own profile replaces in its pair's (decode's `Drafter.profile_of`: prompt
        lookup's free drafts, EAGLE-3's own step), as a decode summary records them per method (`own_profile`)."""
        return {k: getattr(self, k) for k in DRAFTER_PARTS}

    def with_drafter(self, parts: dict | None) -> "CostProfile":
        """This profile with a drafter's recorded parts (`drafter_parts`) in place of the pair draft's."""
        from dataclasses import replace

        return replace(self, **{k: v for k, v in (parts or {}).items() if k in DRAFTER_PARTS})

    # -- storage ----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["cost_ratio"] = self.cost_ratio
        d["verify_ratio"] = [round(float(self.verify_ratio(n)), 4) for n in range(1, len(self.target_ms) + 1)]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CostProfile":
        if not isinstance(d, dict) or d.get("version") not in READABLE_VERSIONS:
            raise UserError("cost profile has another format version; remeasure it (profile.refresh=true)")
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})

    def summary(self) -> str:
        ns = [n for n in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 41) if n <= len(self.target_ms)]
        load = self.extra.get("other_load_cores")
        lines = [f"cost profile · {self.key.get('pair')} · {self.key.get('dtype')} on {self.key.get('device')} · "
                 f"{self.key.get('threads')} threads · {self.key.get('machine')} · measured {self.date}"
                 + ("" if load is None else f" · other processes' load {load:.1f} cores"),
                 f"draft step {self.draft_ms[0]:.2f} ms (first of a round {self.draft_cold_ms or 0:.2f}), "
                 f"target step {self.target_ms[0]:.2f} ms, "
                 f"c = {self.cost_ratio:.3f}",
                 "verification pass over n tokens (after a draft call) ÷ target step: "
                 + ", ".join(f"n={n} {float(self.verify_ratio(n)):.2f}" for n in ns),
                 *([] if not self.target_tree_ms else [
                     "token trees: masked target pass over n tokens ÷ target step: " + ", ".join(
                         f"n={n} {self.tree_target(n) / self.target_ms[0]:.2f}" for n in ns)]),
                 *([] if not self.draft_level_ms else [
                     "token trees: draft call on a level of n nodes ÷ draft step: " + ", ".join(
                         f"n={n} {self.level_draft(n) / self.draft_ms[0]:.2f}" for n in ns
                         if n <= len(self.draft_level_ms))]),
                 "prefill (ms) target / draft: " + ", ".join(
                     f"L={L} {t:.0f}/{d:.0f}" for L, t, d in zip(self.prefill_lengths, self.prefill_target_ms,
                                                               self.prefill_draft_ms))]
        return "\n".join(lines)


def _curve(n, ys):
    """A curve measured at n = 1..len(ys) read at n: the point itself for a measured integer n (the tree builders
    ask thousands of times a round: np.interp's overhead was 3% of a decode), else `_interp`."""
    if type(n) is int and 1 <= n <= len(ys):
        return ys[n - 1]
    return _interp(n, np.arange(1, len(ys) + 1), ys)


def _interp(x, xs, ys):
    """Piecewise-linear through (xs, ys), extended linearly past both ends (a pass over more tokens costs more)."""
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    x_arr = np.asarray(x, dtype=float)
    if len(xs) == 1:
        out = np.full(x_arr.shape, ys[0])
    else:
        out = np.interp(x_arr, xs, ys)
        lo = (ys[1] - ys[0]) / (xs[1] - xs[0])
        hi = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)  # a noisy last pair never makes longer passes cheaper
        out = np.where(x_arr < xs[0], ys[0] + lo * (x_arr - xs[0]), out)
        out = np.where(x_arr > xs[-1], ys[-1] + hi * (x_arr - xs[-1]), out)
    return float(out) if np.ndim(out) == 0 else out


# ---------------------------------------------------------------------------------------------------- measuring


def tree_passes(settings: DictConfig) -> int:
    """The largest tree pass the profile times (`max_tree_n`; settings without it: the chain's `max_n`)."""
    return int(settings.get("max_tree_n") or settings.max_n)


def profile_key(pair, settings: DictConfig) -> dict:
    """What the profile depends on: the same key reuses the cached measurement."""
    from models.lm_head import INT8_FLOAT_ROWS

    draft = OmegaConf.to_container(pair.cfg.draft, resolve=True) if isinstance(pair.cfg, DictConfig) else {}
    if draft.get("quantize") == "int8":  # where an int8 draft's products switch kernels changes its many-row calls
        draft.setdefault("int8_float_rows", INT8_FLOAT_ROWS)
    return {"pair": pair.pair_id, "draft": draft, "dtype": str(pair.dtype).replace("torch.", ""),
            "fit": "monotone, tree >= causal", "linear": getattr(pair, "linear", "torch"),
            "forward": getattr(pair, "forwards", {}),
            "device": str(pair.device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "machine": machine(), "max_n": int(settings.max_n), "context": int(settings.context),
            "max_level": int(settings.get("max_level", 0) or 0), "tree": bool(settings.get("tree", True)),
            "max_tree_n": tree_passes(settings),
            "prefill_lengths": [int(x) for x in settings.prefill_lengths]}


LOADED_CORES = 0.5  # other processes' CPU use during a measurement above which its ratios are not trusted silently


def warn_if_loaded(prof: "CostProfile") -> None:
    load = prof.extra.get("other_load_cores")
    if load is not None and load > LOADED_CORES:
        print(f"warning: other processes kept {load:.1f} cores busy while this cost profile was measured "
              f"({prof.date}); its ratios may be distorted — remeasure on an idle machine with profile.refresh=true",
              flush=True)


def monotone(ys: list[float]) -> list[float]:
    """The non-decreasing curve nearest `ys` in least squares (isotonic regression, pool-adjacent-violators): a pass
    over more tokens never costs less, so a point measured below an earlier one is noise and is pooled with it."""
    from sklearn.isotonic import IsotonicRegression

    if len(ys) < 2:
        return [float(y) for y in ys]
    fit = IsotonicRegression(increasing=True).fit_transform(np.arange(len(ys)), np.asarray(ys, dtype=float))
    return [float(y) for y in fit]


def tree_curve(tree_ms: list[float], target_fit: list[float]) -> list[float]:
    """The tree-pass curve: non-decreasing, and never below the causal pass of the same size (`target_fit`; past its
    end, its last point): a tree pass runs the same products over as many tokens plus a mask, the cache's compaction and the
    walk, so a point measured cheaper is the machine's noise. Why: on a loaded 2-core Xeon (2026-11-28 14:13) the
    tree points read 8% below the causal ones while in the loop, tree rounds' passes cost 9% more than the causal
    curve's, and the builders grew trees on the difference."""
    floored = [max(t, target_fit[min(i, len(target_fit) - 1)]) for i, t in enumerate(tree_ms)]
    return monotone(floored)  # isotonic regression keeps a monotone floor: a cheap tail never drags points under it


# ------------------------------------------------------------------------------------------------- cost model


def _tree_ms(row: dict, prof: CostProfile, prompt: int) -> tuple[float, float]:
    """`modeled_parts` of a token-tree row: per round the root's draft call (the first round's is the draft's
    prefill, later ones cold), its level calls and one tree pass over pending + verified nodes (the first round's
    inside the target's prefill)."""
    ks = [k for k, _ in row["rounds"]]
    target = prof.prefill_target(prompt + ks[0]) + sum(prof.tree_target(k + 1) for k in ks[1:])
    draft = prof.prefill_draft(prompt) + (len(ks) - 1) * prof.cold_ms
    draft += sum(prof.level_draft(w) for levels in row["tree_levels"] for w in levels)
    return float(target), float(draft)


def modeled_ms(row: dict, prof: CostProfile) -> float:
    """What one decode row (a prompt's target-only or speculative generation) costs under the profile.

    Target-only: a prefill of the prompt, then one 1-token step per further token. Speculative: both prefills
    (the target's first call also verifies the first round, so it runs prompt + k₁ tokens), one target pass over
    k+1 tokens per later round, one draft step per further draft call — the first of each round cold.
    transformers' loop (no per-round record) is costed at its mean round length. A token-tree row (its per-round
    `tree_levels`) is costed as `round_steps` costs a tree round: tree-attention passes, level calls by their size.
    """
    return sum(modeled_parts(row, prof))


def modeled_parts(row: dict, prof: CostProfile) -> tuple[float, float]:
    """`modeled_ms` split into (the target's calls, the draft's calls), in ms: what eval.wall_gap sets against the
    time a decode row measured in each."""
    prompt = int(row.get("prompt_tokens") or prof.context)
    tcalls, dcalls = int(row["target_calls"]), int(row["draft_calls"])
    if not dcalls and not row.get("rounds"):  # target-only (a prompt-lookup row drafts without model calls)
        return float(prof.prefill_target(prompt) + max(tcalls - 1, 0) * prof.target(1)), 0.0
    rounds = row.get("rounds") or []
    if row.get("tree_levels") and rounds:
        return _tree_ms(row, prof, prompt)
    if rounds:
        ks = np.array([k for k, _ in rounds], dtype=float)
        target = prof.prefill_target(prompt + ks[0]) + float(np.sum(prof.verify(ks[1:] + 1)))
    else:
        mean_k = row.get("drafted", 0) / max(tcalls, 1)
        target = prof.prefill_target(prompt + mean_k) + (tcalls - 1) * prof.verify(mean_k + 1)
    # the first draft call of each later round runs cold (after a target pass); the rest warm
    cold = sum(1 for k, _ in rounds[1:] if k > 0) if rounds else max(tcalls - 1, 0)
    cold = min(cold, max(dcalls - 1, 0))
    draft = prof.prefill_draft(prompt) + cold * prof.cold_ms + (max(dcalls - 1, 0) - cold) * prof.draft(1)
    return float(target), float(draft)
