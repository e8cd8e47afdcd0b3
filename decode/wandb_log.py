"""W&B for `python -m decode` and `python -m eval.replay` (`logger=wandb`; offline by default, like train).

One run per job under `<out_dir>/wandb/offline-run-*` (`wandb sync <out_dir>/wandb/offline-run-*` uploads it):
- config: the resolved job config, plus `run_json`: everything the run's run.json holds (machine, dtype, threads,
  measured c, the cost profile when present, the parameters every method ran with);
- `decode/summary`: the summary table (one row per method, the summary.md columns) as a W&B Table;
- `decode/speedup` (bar chart), `decode/acceptance_by_position` (line per method), `decode/draft_length_hist`
  (rounds per draft length, a table + a W&B histogram per method under `decode/draft_length/<method>`), the PNGs;
- scalars `decode/<method>/<metric>` in the run summary (so W&B can chart any of them across runs);
- `mode=tune`: the same for the tuning split under `tune/`, and the chosen parameters in config `tuned`;
- eval.replay: `replay/table`, `replay/cost_model_speedup` and, with synthetic heads, the speedup-vs-AUROC line.

A Hydra multirun (`python -m decode -m policy.svip.h=0.2,0.3,0.4 logger=wandb`) puts every job's run in one group
named after the sweep folder; `SweepCallback` (conf/decode.yaml `hydra.callbacks`) then adds one run to that group
holding the speedup-vs-parameter chart of every swept parameter (`sweep/speedup_vs_<param>`) and the table behind it.
A job's results are queued while it runs and written to its run when it ends (`session`'s `finally`): W&B's
service never competes with timed decoding, a failed job still leaves a closed run of what it logged (exit code 1),
a job that fails before logging anything (a user error) leaves no W&B folder, and the next job gets its own run.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from utils import wandb_run

# the summary.md columns (decode.report.markdown_table) + the flags that qualify a row
COLUMNS = ("tokens_per_s", "speedup", "speedup_std", "cost_model_speedup", "acceptance_rate", "mean_accepted_length",
           "target_calls_per_token", "draft_calls_per_token", "mean_draft_length", "policy_overhead_frac", "lossless",
           "lossless_up_to_ties")
FLAGS = ("oracle", "approximate", "external")
REPLAY_COLUMNS = ("cost_model_speedup", "acceptance_rate", "mean_accepted_length", "draft_calls_per_token",
                  "mean_draft_length", "past_rejection", "score_auroc")
_RUN = None  # the W&B run being written (inside `session`'s finally, or the sweep callback)
_PENDING: list | None = None  # results of the job in progress, logged when it ends (None: W&B off)


@contextlib.contextmanager
def session(cfg: DictConfig, out_dir: Path, job_type: str):
    """Collect what the `with` body logs and write it to this job's W&B run when the body ends, however it ends.

    The run starts only then, so W&B's service process never competes with timed decoding on a small CPU, and a job
    that fails before logging anything (a user error) leaves no W&B folder. No-op when `logger` has no wandb block.
    """
    global _PENDING, _RUN
    if wandb_run.settings(cfg) is None:
        yield
        return
    _PENDING = []
    code = 0
    try:
        yield
    except BaseException:
        code = 1
        raise
    finally:
        pending, _PENDING = _PENDING, None
        if pending:
            _RUN = wandb_run.start(cfg, Path(out_dir), job_type)
            try:
                for fn, args, kwargs in pending:
                    _safe(fn)(*args, **kwargs)
                if _RUN is not None:
                    print(f"W&B ({wandb_run.settings(cfg).get('mode', 'offline')}) run: {Path(_RUN.dir).parent}",
                          flush=True)
            finally:
                _RUN = None
                wandb_run.finish(code)


def _deferred(fn):
    """`fn(...)` is queued for the job's W&B run (see `session`); nothing happens when W&B is off."""
    def queue(*args, **kwargs):
        if _PENDING is not None:
            _PENDING.append((fn, args, kwargs))
    queue.__doc__, queue.__name__ = fn.__doc__, fn.__name__
    return queue


def _cell(v):
    if isinstance(v, bool) or v is None or isinstance(v, (int, float, str)):
        return v
    return json.dumps(v, default=str)


def _safe(fn):
    """W&B logging never fails a job: a problem is a warning, the run's files are written regardless."""
    def wrapped(*args, **kwargs):
        if _RUN is None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001
            warnings.warn(f"W&B logging skipped ({type(err).__name__}: {err}); the run's files are written",
                          stacklevel=2)
            return None
    wrapped.__doc__ = fn.__doc__
    return wrapped


@_deferred
def log_result(summary: dict, run_json: dict, out_dir: Path, prefix: str = "decode", by_task: dict | None = None,
               tuned: dict | None = None) -> None:
    """One decode result (what summary.json, run.json and the plots hold) to the job's run, keys under `prefix/`."""
    import wandb

    methods = list(summary)
    table = wandb.Table(columns=["method", *COLUMNS, *FLAGS],
                        data=[[m, *(_cell(summary[m].get(c)) for c in COLUMNS + FLAGS)] for m in methods])
    payload = {f"{prefix}/summary": table}
    speed = [[m, summary[m].get("speedup")] for m in methods if summary[m].get("speedup") is not None]
    if speed:
        payload[f"{prefix}/speedup"] = wandb.plot.bar(wandb.Table(columns=["method", "speedup"], data=speed),
                                                      "method", "speedup", title=f"{prefix}: speedup vs target-only")
    acc = [[m, j, a] for m in methods for j, a in enumerate(summary[m].get("per_position_acceptance") or [])
           if a is not None]
    if acc:
        payload[f"{prefix}/acceptance_by_position"] = wandb.plot.line(
            wandb.Table(columns=["method", "position", "acceptance"], data=acc), "position", "acceptance",
            stroke="method", title=f"{prefix}: P(accept | previous accepted) by position in round")
    hist = [[m, int(k), int(n)] for m in methods for k, n in (summary[m].get("draft_length_hist") or {}).items()]
    if hist:
        payload[f"{prefix}/draft_length_hist"] = wandb.Table(columns=["method", "draft_length", "rounds"], data=hist)
        for m in methods:
            h = {int(k): int(n) for k, n in (summary[m].get("draft_length_hist") or {}).items()}
            if h:
                edges = list(range(min(h), max(h) + 2))
                payload[f"{prefix}/draft_length/{m}"] = wandb.Histogram(
                    np_histogram=([h.get(k, 0) for k in edges[:-1]], edges))
    if by_task:
        tasks = list(by_task)
        payload[f"{prefix}/by_task"] = wandb.Table(
            columns=["method", *tasks], data=[[m, *(by_task[t].get(m, {}).get("speedup") for t in tasks)]
                                              for m in next(iter(by_task.values()))])
    if prefix == "decode":
        for png in ("speedup.png", "acceptance_by_position.png"):
            if (Path(out_dir) / png).is_file():
                payload[f"{prefix}/{Path(png).stem}_png"] = wandb.Image(str(Path(out_dir) / png))
    _RUN.log(payload)
    for m in methods:
        for c in COLUMNS:
            v = summary[m].get(c)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                _RUN.summary[f"{prefix}/{m}/{c}"] = v
    _RUN.config.update({"run_json" if prefix == "decode" else f"{prefix}_run_json": run_json,
                        **({"tuned": tuned} if tuned else {})}, allow_val_change=True)


@_deferred
def log_replay(result: dict, out_dir: Path) -> None:
    """An eval.replay result (replay.json) to the job's run: its table, speedup bars, the synthetic-head curve."""
    import wandb

    rows = result["eval"]
    chosen = result.get("chosen") or {}
    table = wandb.Table(columns=["method", "chosen", *REPLAY_COLUMNS],
                        data=[[k, _cell(chosen.get(k)), *(_cell(r.get(c, r.get("realised_auroc") if c == "score_auroc"
                                                                           else None)) for c in REPLAY_COLUMNS)]
                              for k, r in rows.items()])
    payload = {"replay/table": table,
               "replay/cost_model_speedup": wandb.plot.bar(
                   wandb.Table(columns=["method", "cost_model_speedup"],
                               data=[[k, r["cost_model_speedup"]] for k, r in rows.items()]),
                   "method", "cost_model_speedup", title="replay: cost-model speedup")}
    syn = [[r["realised_auroc"], r["cost_model_speedup"]] for k, r in rows.items() if k.startswith("synthetic[")]
    if syn:
        payload["replay/speedup_vs_auroc"] = wandb.plot.line(
            wandb.Table(columns=["auroc", "cost_model_speedup"], data=syn), "auroc", "cost_model_speedup",
            title="replay: cost-model speedup of a synthetic head vs its AUROC")
    png = Path(out_dir) / "replay_auroc.png"
    if png.is_file():
        payload["replay/replay_auroc_png"] = wandb.Image(str(png))
    _RUN.log(payload)
    for k, r in rows.items():
        _RUN.summary[f"replay/{k}/cost_model_speedup"] = r["cost_model_speedup"]
    _RUN.config.update({"replay_settings": result.get("settings"), "gap": result.get("gap")}, allow_val_change=True)


# --------------------------------------------------------------------------------------------------- multirun


def sweep_rows(sweep_dir: Path) -> tuple[list[dict], list[str]]:
    """One row per (job, method) of a decode multirun, with the job's overrides; and the keys the jobs vary."""
    import yaml

    jobs = []
    for overrides_file in sorted(Path(sweep_dir).glob("*/.hydra/overrides.yaml")):
        job = overrides_file.parent.parent
        if not (job / "summary.json").is_file():
            continue
        pairs = [o.split("=", 1) for o in (yaml.safe_load(overrides_file.read_text()) or []) if "=" in o]
        jobs.append((job, {k.lstrip("+~"): v for k, v in pairs}, json.loads((job / "summary.json").read_text())))
    keys = sorted({k for _, o, _ in jobs for k in o})
    varying = [k for k in keys if len({o.get(k) for _, o, _ in jobs}) > 1]
    rows = []
    for job, overrides, summary in jobs:
        for method, s in summary.items():
            rows.append({"job": job.name, **{k: overrides.get(k) for k in varying}, "method": method,
                         **{c: s.get(c) for c in ("speedup", "cost_model_speedup", "acceptance_rate", "tokens_per_s")}})
    return rows, varying


def _number(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


class SweepCallback(Callback):
    """After a decode multirun with logger=wandb: one more run in the sweep's W&B group, charting speedup (and
    cost-model speedup) against every swept parameter, one line per method."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        global _RUN
        if wandb_run.settings(config) is None:
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        rows, varying = sweep_rows(sweep_dir) if sweep_dir.is_dir() else ([], [])
        if not rows:
            return
        from omegaconf import open_dict

        cfg = config.copy()
        with open_dict(cfg):
            cfg.pop("hydra", None)  # the run's config: the sweep's base settings, not Hydra's internals
        _RUN = wandb_run.start(cfg, sweep_dir, "sweep", group=wandb_run.group_name(config.task_name, sweep_dir),
                               name="sweep")
        try:
            self._log(rows, varying)
        finally:
            if _RUN is not None:
                print(f"W&B sweep run (group {wandb_run.group_name(config.task_name, sweep_dir)}): "
                      f"{Path(_RUN.dir).parent}", flush=True)
            _RUN = None
            wandb_run.finish()

    @staticmethod
    @_safe
    def _log(rows: list[dict], varying: list[str]) -> None:
        import wandb

        cols = list(rows[0])
        payload = {"sweep/table": wandb.Table(columns=cols, data=[[_cell(r[c]) for c in cols] for r in rows])}
        for key in varying:
            pts = [[_number(r[key]), r["method"], r["speedup"], r["cost_model_speedup"]] for r in rows
                   if _number(r[key]) is not None and r["speedup"] is not None and r["method"] != "target"]
            if not pts:
                continue
            table = wandb.Table(columns=[key, "method", "speedup", "cost_model_speedup"], data=pts)
            payload[f"sweep/speedup_vs_{key}"] = wandb.plot.line(table, key, "speedup", stroke="method",
                                                                 title=f"speedup vs {key}")
            payload[f"sweep/cost_model_speedup_vs_{key}"] = wandb.plot.line(
                table, key, "cost_model_speedup", stroke="method", title=f"cost-model speedup vs {key}")
        _RUN.log(payload)
