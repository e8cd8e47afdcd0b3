"""Whether a results folder is older than what made it: the pair settings its files record (`records`), compared
with today's defaults of that pair (`stale_reasons`); for files that record no draft fingerprint, whether git last
committed them before today's draft weights (`older_than_draft`); for sections drafting with the pair's EAGLE-3
draft, whether they were made with today's one (`older_than_eagle3`); and whether a section reads another's stale
folder (`read_sections`). eval.study prints the verdict per section (`stale_line`); a section is anything with
`folder`, `only` and `commands` (eval.study.Section)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from utils.cli import UserError

REPO = Path(__file__).resolve().parent.parent


def _record(data: dict) -> dict | None:
    """The pair settings a result file records: a cost profile's key, a replay's profile, a run.json, or the
    profile file a bench result names."""
    if isinstance(data.get("key"), dict) and "pair" in data["key"]:
        return {**data["key"], "date": data.get("date")}
    prof = (data.get("settings") or {}).get("cost_profile") if isinstance(data.get("settings"), dict) else None
    if isinstance(prof, dict) and isinstance(prof.get("key"), dict):
        return {**prof["key"], "date": data["settings"].get("date")}
    if "pair" in data and "dtype" in data:
        return data
    if isinstance(data.get("profile"), str) and (REPO / data["profile"]).is_file():
        return _record(json.loads((REPO / data["profile"]).read_text()))
    return None


def records(results: Path, sec) -> list[dict]:
    """The settings records of a section's files (each run.json of a folder of decode runs)."""
    d = results / sec.folder
    if sec.only:
        files = [d / f for f in sec.only if f.endswith(".json")]
    else:
        files = [d / "run.json", *sorted(d.glob("*/run.json")), d / "replay.json", d / "profile.json"]
    out = []
    for f in files:
        if f.is_file():
            rec = _record(json.loads(f.read_text()))
            if rec is not None:
                out.append(rec)
    return out


def pair_defaults(name: str) -> dict | None:
    """conf/pair/<name>.yaml as a dict (today's defaults of that pair), or None when the pair no longer exists."""
    from omegaconf import OmegaConf

    path = REPO / "conf" / "pair" / f"{name}.yaml"
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False) if path.is_file() else None


def command_overrides(commands) -> set[str]:
    """The `pair.*` settings a section's commands set on purpose (`pair.dtype=float32` → pair.dtype)."""
    return {m for c in commands for m in re.findall(r"\b(pair(?:\.\w+)+)=", c)}


def stale_reasons(rec: dict, overrides: set[str] = frozenset()) -> list[str]:
    """What a settings record differs in from today's defaults of its pair (empty: current)."""
    pair = str(rec.get("pair"))
    conf = pair_defaults(pair)
    if conf is None:
        return [f"pair {pair}, which conf/pair/ no longer defines"]
    out = []
    if conf.get("dtype", "auto") != "auto" and "pair.dtype" not in overrides:
        if str(rec.get("dtype", "")).removeprefix("torch.") != str(conf["dtype"]):
            out.append(f"dtype={rec.get('dtype')} (today {conf['dtype']})")
    if "device" not in rec:  # a partial record (pair and dtype only): nothing more to compare
        return out
    draft = rec.get("draft") or {}
    for key in ("vocab_subset", "quantize"):
        want = (conf.get("draft") or {}).get(key)
        if draft.get(key) != want and f"pair.draft.{key}" not in overrides:
            out.append(f"draft.{key}={'null' if draft.get(key) is None else draft.get(key)} (today {want})")
    freq, want_freq = draft.get("vocab_freq"), (conf.get("draft") or {}).get("vocab_freq")
    if rec.get("draft_files") is None and freq and want_freq and freq != want_freq and draft.get("vocab_subset") \
            and "pair.draft.vocab_freq" not in overrides:  # a record from before draft fingerprints: its head's list
        out.append(f"draft.vocab_freq={freq} (today {want_freq})")
    if rec.get("draft_files") is not None and "pair.draft.weights" not in overrides:  # which draft, by content
        from models.pair import draft_files

        today = draft_files(conf)
        if rec["draft_files"].get("weights") != today.get("weights"):
            out.append(f"draft weights {rec['draft_files'].get('weights') or 'none'} (today {today.get('weights')})")
    if conf.get("linear", "auto") == "auto" and "pair.linear" not in overrides:
        want = "packed" if str(rec.get("device")) == "cpu" else "torch"
        if rec.get("linear") != want:
            got = rec.get("linear")
            out.append(f"linear={got} (today {want})" if got else f"linear=torch (before pair.linear; today {want})")
    if "pair.forward" not in overrides and not rec.get("forward"):
        out.append(f"forward=hf (before pair.forward; today {conf.get('forward', 'auto')})")
    return out


def default_pair() -> str:
    """The pair the stages use when none is named (conf/decode.yaml's defaults list)."""
    return _default_pair(Path(REPO))


@functools.lru_cache(maxsize=None)  # read once per study run, not once per section
def _default_pair(repo: Path) -> str:
    from omegaconf import OmegaConf

    for item in OmegaConf.to_container(OmegaConf.load(repo / "conf" / "decode.yaml")).get("defaults", []):
        if isinstance(item, dict) and "pair" in item:
            return str(item["pair"])
    raise UserError("conf/decode.yaml names no default pair")


def _committed_at(path: Path) -> int | None:
    """Unix time of the last commit that touched `path`; None when git has no such commit, the file lies outside
    the repository or has uncommitted changes (then it is newer than anything committed)."""
    import subprocess

    def git(*args):
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)
        return out.stdout.strip() if out.returncode == 0 else ""

    try:
        rel = str(Path(path).resolve().relative_to(Path(REPO).resolve()))
    except ValueError:  # outside the repository (a results folder elsewhere): no history to read
        return None
    if git("status", "--porcelain", "--", rel):
        return None
    stamp = git("log", "-1", "--format=%ct", "--", rel)
    return int(stamp) if stamp else None


@functools.lru_cache(maxsize=None)  # one git call per study run for the draft, whatever the number of sections
def _draft_committed_at(repo: Path, weights: str) -> int | None:
    return _committed_at(repo / weights)


def _committed_before(results: Path, sec, when: int | None) -> bool:
    """Whether git last committed some of the section's json files before `when` (False without `when`, or when
    none of them is committed unchanged)."""
    d = results / sec.folder
    files = [d / f for f in sec.only if f.endswith(".json")] if sec.only else sorted(d.glob("*.json"))
    made = [t for t in (_committed_at(f) for f in files if f.is_file()) if t is not None]
    return when is not None and bool(made) and min(made) < when


def older_than_draft(results: Path, sec, recs: list[dict]) -> str:
    """A reason when the section's files record no draft fingerprint and were last committed before today's draft
    weights of the default pair were: made with an earlier draft. '' when its records name the draft by content
    (stale_reasons compares those), when its commands choose another pair or draft, or without git history."""
    pair = default_pair()
    if any(r.get("draft_files") is not None or str(r.get("pair", pair)) != pair for r in recs):
        return ""
    if any(re.search(rf"\bpair=(?!{re.escape(pair)}\b)|\bpair\.draft\.weights=|\bstudent=", c) for c in sec.commands):
        return ""
    weights = ((pair_defaults(pair) or {}).get("draft") or {}).get("weights")
    draft_at = _draft_committed_at(Path(REPO), weights) if weights else None
    if not _committed_before(results, sec, draft_at):
        return ""
    return f"an earlier draft (its files predate today's {weights} and record no draft fingerprint)"


EAGLE3_COMMAND = re.compile(r"eagle3|trace=eagle_")  # drafters=[..eagle3..], +experiment=*_eagle3*, eagle traces


def _command_pair(commands) -> str | None:
    pairs = {m for c in commands for m in re.findall(r"\bpair=([\w.]+)", c)}
    return pairs.pop() if len(pairs) == 1 else None


def eagle3_today(pair: str) -> tuple[str, str | None, int | None] | None:
    """The pair's EAGLE-3 draft today: (weights path, content fingerprint, commit time of its shipping). The
    fingerprint is the file's, or where the file is not built (the 1.5B draft is gitignored) the one its committed
    .train.json records; the commit time is the weights' or, for untracked weights, the .train.json's. None for a
    pair without `eagle3.weights`."""
    from models.pair import file_fingerprint

    weights = ((pair_defaults(pair) or {}).get("eagle3") or {}).get("weights")
    if not weights:
        return None
    path, record = Path(REPO) / weights, (Path(REPO) / weights).with_suffix(".train.json")
    fingerprint = file_fingerprint(path) if path.is_file() else None
    if fingerprint is None and record.is_file():
        fingerprint = json.loads(record.read_text()).get("fingerprint")
    return weights, fingerprint, _committed_at(path) or (_committed_at(record) if record.is_file() else None)


def older_than_eagle3(results: Path, sec, recs: list[dict]) -> str:
    """A reason when a section that drafts with its pair's EAGLE-3 draft was made with another one: decode rows
    record the weights' fingerprint (`draft_weights`), compared with today's; files that record none (traces'
    replays, heads, ceilings, and runs from before the record) are stale when git last committed them before
    today's draft shipped. '' for sections without EAGLE-3, or whose commands name other EAGLE-3 weights."""
    if not any(EAGLE3_COMMAND.search(c) for c in sec.commands) or any("eagle3.weights=" in c for c in sec.commands):
        return ""
    pair = next((str(r["pair"]) for r in recs if r.get("pair")), None) or _command_pair(sec.commands)
    today = eagle3_today(pair or default_pair())
    if today is None:
        return ""
    weights, fingerprint, shipped = today
    summary = results / sec.folder / "summary.json"
    rows = json.loads(summary.read_text()).values() if summary.is_file() and not sec.only else []
    seen = {r["draft_weights"]["fingerprint"] for r in rows if isinstance(r, dict) and r.get("draft_weights")}
    if seen and fingerprint:
        old = sorted(seen - {fingerprint})
        return f"EAGLE-3 draft {', '.join(old)} (today {fingerprint}, {weights})" if old else ""
    if not _committed_before(results, sec, shipped):
        return ""
    return f"an earlier EAGLE-3 draft (its files predate today's {weights})"


def read_sections(sec, sections) -> list:
    """The other sections whose folders this section's commands read (`bar.replay=results/eagle/replay_mbpp`,
    `tuned=results/x/tuned.json`): for each path the deepest section folder holding it."""
    out = []
    for path in {m.rstrip("/.") for c in sec.commands for m in re.findall(r"\bresults/([\w./-]+)", c)}:
        holders = [s for s in sections if s.folder != sec.folder and not s.only
                   and (path == s.folder or path.startswith(s.folder + "/"))]
        if holders and not path.startswith(sec.folder + "/"):
            deepest = max(holders, key=lambda s: len(s.folder))
            out += [deepest] if deepest not in out else []
    return out


def stale_line(results: Path, sec, sections=()) -> str:
    """The visible stale line of a section ('' when every record matches today's defaults). With the study's
    `sections`, a section built from another section's stale files (a bar over a stale replay) is stale too."""
    reasons: list[str] = []
    recs = records(results, sec)
    for rec in recs:
        reasons += [r for r in stale_reasons(rec, command_overrides(sec.commands)) if r not in reasons]
    reasons += [r for r in (older_than_draft(results, sec, recs), older_than_eagle3(results, sec, recs)) if r]
    if not reasons:
        stale_inputs = [s.folder for s in read_sections(sec, sections) if stale_line(results, s)]
        reasons += [f"the stale files of {', '.join(sorted(stale_inputs))}"] if stale_inputs else []
    return f"**Stale:** made with {', '.join(reasons)}. Rerun its command to refresh it." if reasons else ""
