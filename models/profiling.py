"""Measuring the cost profile (models.cost.CostProfile) on this machine through the loop's own model calls
(models.lm.LM), and caching it per pair and machine (`get_profile`); the draft/target step ratio c that
train.distill reports is timed by the same probe (`step_ratio`). Each point is a median over round-robin repeats,
so a slow spell of a shared machine hits all points alike; a measurement taken while other processes kept the CPU
busy is named (`other_load`)."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from models.cost import (
    PROFILE_VERSION,
    CostProfile,
    monotone,
    profile_key,
    tree_curve,
    tree_passes,
    warn_if_loaded,
)
from utils.cli import UserError
from utils.files import write_text_atomic


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, of this process) so far; None where /proc/stat is not readable."""
    import resource

    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    own = resource.getrusage(resource.RUSAGE_SELF)
    return busy, own.ru_utime + own.ru_stime


def other_load(before, after, wall_s: float) -> float | None:
    """Cores other processes kept busy between two `cpu_seconds` readings (a shared machine's load)."""
    if before is None or after is None or wall_s <= 0:
        return None
    return max(0.0, ((after[0] - before[0]) - (after[1] - before[1])) / wall_s)


def _tree_probe(lm, cache, ids: list[int], c: int, n: int, pending: int, compact: bool = False):
    """A timed tree call after `c` cached tokens as the loop runs it (models.tree.grow's level calls; with
    `compact`, decode.tree's verify and commit): the mask built, `pending` committed tokens run causally, then
    n − pending nodes (children of the last committed token: the mask's shape, not its branching, is what costs),
    logits at all n, and (`compact`) the cache compacted to the prefix and a one-node path (`LM.keep`), before it
    is cropped back."""
    from models.lm import tree_attention

    nodes = n - pending

    def call():
        pos, mask = tree_attention([-1] * nodes, list(range(nodes)), c + pending, c, None, lm.device)
        lm(ids[c: c + n], cache, last=n, positions=pos, mask=mask)
        if compact and nodes:
            lm.keep(cache, [*range(c + pending), c + n - 1])
        cache.crop(c - cache.get_seq_length())
    return call


def _step_probe(lm, cache, ids: list[int], c: int, n: int, last: int):
    """A timed causal call after `c` cached tokens: n new tokens, logits at the `last` of them, then the cache cropped
    back (every repeat sees the same context). The one probe behind every step time: the profile's and `step_ratio`."""
    def call():
        lm(ids[c: c + n], cache, last=last)
        cache.crop(-n)
    return call


def _round_robin(probes: dict, warmup: int, repeats: int, clock, progress: bool = False) -> tuple[dict, float]:
    """Median ms of each probe, timed round-robin so a slow spell of a shared machine hits every point alike (the
    ratios the cost model uses stay steady), and the other processes' CPU use meanwhile (cores, or None). A probe is
    a call, or (setup, call): the setup runs untimed right before the call — the model call that precedes it in
    the loop (a target pass before a round's first draft call, a draft call before a verification pass)."""
    from tqdm import tqdm

    times: dict = {key: [] for key in probes}
    cpu_before, wall_before = cpu_seconds(), time.perf_counter()
    for r in tqdm(range(warmup + repeats), desc="cost profile", unit="round", disable=not progress):
        for key, fn in probes.items():
            setup, call = fn if isinstance(fn, tuple) else (None, fn)
            if setup is not None:
                setup()
            t = clock()
            call()
            if r >= warmup:
                times[key].append(clock() - t)
    load = other_load(cpu_before, cpu_seconds(), time.perf_counter() - wall_before)
    return {key: 1000 * statistics.median(v) for key, v in times.items()}, load


def _profile_probes(draft, target, dcache, tcache, ids: list[int], settings: DictConfig) -> dict:
    """Every point of the profile as a probe, each timed right after the call that precedes it in the loop (its
    setup): the draft's one- and two-token steps and its tree levels after a draft step (warm), its first call of a
    round after a target pass over 3 tokens (cold); the target's causal passes after a target step (target-only
    decoding) and again after a draft step (verification), its tree passes after a draft step; both prefills at
    each length. Why every probe names its predecessor: in a round-robin the one before is whatever came last, and
    a warm draft step timed after the previous round's 512-token prefill cost 1.5x one timed after a draft step
    (2.13 vs 1.39 ms, 2-core EPYC, bf16, 2026-11-29)."""
    c, max_n, tree_n = int(settings.context), int(settings.max_n), tree_passes(settings)
    levels = int(settings.get("max_level", 0) or 0)
    draft_step, target_step = _step_probe(draft, dcache, ids, c, 1, 1), _step_probe(target, tcache, ids, c, 1, 1)
    probes = {("draft", 1): (draft_step, draft_step),
              ("draft", 2): (draft_step, _step_probe(draft, dcache, ids, c, 2, 1)),
              "draft_cold": (_step_probe(target, tcache, ids, c, 3, 3), draft_step)}
    probes.update({("draft_level", n): (draft_step, _tree_probe(draft, dcache, ids, c, n, 0))
                   for n in range(1, levels + 1)})
    for n in range(1, max(max_n, tree_n) + 1):
        if n <= max_n:
            probes[("target", n)] = (target_step, _step_probe(target, tcache, ids, c, n, n))
            probes[("verify", n)] = (draft_step, probes[("target", n)][1])
        if n <= tree_n and settings.get("tree", True):
            probes[("target_tree", n)] = (draft_step, _tree_probe(target, tcache, ids, c, n, 1, compact=True))
    for length in (int(x) for x in settings.prefill_lengths):
        probes[("prefill_target", length)] = lambda L=length: target(ids[:L], target.new_cache(), last=1)
        probes[("prefill_draft", length)] = lambda L=length: draft(ids[:L], draft.new_cache(), last=1)
    return probes


@torch.inference_mode()
def measure(pair, settings: DictConfig, progress: bool = True) -> CostProfile:
    """Time the loop's own model calls (models.lm.LM) on this machine; see models.cost's docstring."""
    from models.lm import LM, Clock

    gen = torch.Generator().manual_seed(0)
    longest = max(int(settings.max_n), tree_passes(settings), int(settings.get("max_level", 0) or 0))
    ids = torch.randint(100, max(pair.vocab_size - 1, 101), (max(int(settings.context),
                        max(settings.prefill_lengths)) + longest + 2,), generator=gen).tolist()
    clock, c = Clock(pair.device), int(settings.context)
    draft, target = LM.of(pair, "draft"), LM.of(pair, "target")
    dcache, tcache = draft.new_cache(), target.new_cache()
    draft(ids[:c], dcache, last=0)
    target(ids[:c], tcache, last=0)
    probes = _profile_probes(draft, target, dcache, tcache, ids, settings)
    ms, load = _round_robin(probes, int(settings.warmup), int(settings.repeats), clock, progress)
    return _profile_of(ms, load, pair, settings)


def _profile_of(ms: dict, load, pair, settings: DictConfig) -> CostProfile:
    """The CostProfile of measured medians `ms`: the curves over n made non-decreasing (raw medians kept in
    `extra.raw_ms`), the tree curve floored at the causal one."""
    lengths = [int(x) for x in settings.prefill_lengths]
    levels = int(settings.get("max_level", 0) or 0)
    target_ms = [ms[("target", n)] for n in range(1, int(settings.max_n) + 1)]
    verify_ms = [ms[("verify", n)] for n in range(1, int(settings.max_n) + 1)]
    level_ms = [ms[("draft_level", n)] for n in range(1, levels + 1)] or None
    tree_ms = [ms[key] for key in sorted(k for k in ms if k[0] == "target_tree")] or None
    extra = {"raw_ms": {"target_ms": target_ms, "verify_ms": verify_ms, "target_tree_ms": tree_ms,
                        "draft_level_ms": level_ms}}
    if load is not None:
        extra["other_load_cores"] = round(load, 2)
    target_fit = monotone(target_ms)
    verify_fit = monotone(verify_ms)
    return CostProfile(key=profile_key(pair, settings), draft_ms=[ms[("draft", 1)], ms[("draft", 2)]],
                       target_ms=target_fit, prefill_lengths=lengths,
                       prefill_target_ms=[ms[("prefill_target", L)] for L in lengths],
                       prefill_draft_ms=[ms[("prefill_draft", L)] for L in lengths],
                       context=int(settings.context), repeats=int(settings.repeats), draft_cold_ms=ms["draft_cold"],
                       date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), extra=extra,
                       draft_level_ms=level_ms and monotone(level_ms), verify_ms=verify_fit,
                       target_tree_ms=tree_ms and tree_curve(tree_ms, verify_fit))


@torch.inference_mode()
def step_ratio(draft, target, ids: list[int], repeats: int = 25, warmup: int = 5) -> dict:
    """c = one draft step ÷ one target step (medians, round-robin) after the context `ids[:-1]`, through
    models.lm.LM as the loop calls them: what train.distill reports for a student (`draft`, `target`: LM objects)."""
    from models.lm import Clock

    c = len(ids) - 1
    dcache, tcache = draft.new_cache(), target.new_cache()
    draft(ids[:c], dcache, last=0)
    target(ids[:c], tcache, last=0)
    probes = {"draft": _step_probe(draft, dcache, ids, c, 1, 1), "target": _step_probe(target, tcache, ids, c, 1, 1)}
    device = next(target.model.parameters()).device
    ms, _ = _round_robin(probes, warmup, repeats, Clock(device))
    return {"c": ms["draft"] / ms["target"], "draft_step_ms": ms["draft"], "target_step_ms": ms["target"]}


def cache_path(pair, key: dict) -> Path:
    from models.sources import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root(pair.cfg) / "profiles" / f"{pair.pair_id}-{digest}.json"


def get_profile(pair, settings: DictConfig | dict | None = None) -> CostProfile:
    """The cached profile for this pair and machine, measured first when there is none, when it was timed over fewer
    rounds than `settings.repeats`, or on `refresh`."""
    settings = OmegaConf.merge(DEFAULTS, settings or {})
    if settings.get("file"):  # a profile measured elsewhere (e.g. to replay another machine's costs)
        path = Path(str(settings.file))
        if not path.is_file():
            raise UserError(f"profile.file={path}: no such file; pass a profile.json from `python -m decode.profile`")
        return CostProfile.from_dict(json.loads(path.read_text()))
    key = profile_key(pair, settings)
    path = cache_path(pair, key)
    if path.is_file() and not settings.get("refresh"):
        try:
            prof = CostProfile.from_dict(json.loads(path.read_text()))
            # fewer timed rounds than asked are not the measurement asked for: the 1.5B pair's 3-round profile,
            # reused by a run that asked for 7, priced every call ~38% too dear (85 vs 62 ms, 2-core EPYC, bf16)
            if prof.version == PROFILE_VERSION and prof.repeats >= int(settings.repeats):
                warn_if_loaded(prof)
                return prof
        except (ValueError, UserError, TypeError):
            pass  # an unreadable or older cache entry is remeasured, never trusted
    prof = measure(pair, settings)
    write_text_atomic(path, json.dumps(prof.to_dict(), indent=1))
    warn_if_loaded(prof)
    return prof


DEFAULTS = OmegaConf.load(Path(__file__).resolve().parent.parent / "conf" / "profile" / "default.yaml")


