"""Greedy traces as continuations: the rows a replay reads rounds off (eval.replay, train's speed rule) — target_ar's
one row per position, eagle_chain's one chain per start position (`Continuation.row`) — refused in one line when they
are not greedy traces of a kind whose rows follow the target's continuation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data_gen.kinds import greedy_rounds
from models.features.signals import VerifyStats, compared
from models.features.trace import continuation_starts
from utils.cli import UserError


@dataclass
class Continuation:
    """One greedy continuation of a trace: per-row draft features, the target's tokens, and (when the trace has them)
    what a disco_plus head reads: the prompt and context tokens and the target's per-row statistics."""

    topk: torch.Tensor  # (n, k) draft top-k probabilities
    entropy: torch.Tensor  # (n,)
    hidden: torch.Tensor | None  # (n, d) or None
    draft_token: np.ndarray
    target_token: np.ndarray
    prompt_id: str = ""
    prompt: list[int] | None = None  # prompt token ids
    context_token: np.ndarray | None = None  # the continuation's tokens (the target's greedy tokens)
    target_entropy: np.ndarray | None = None  # H_p, top-2 margin of p and TVD(p, q) per row
    target_margin: np.ndarray | None = None
    tvd: np.ndarray | None = None
    # eagle_chain traces (data_gen.eagle_traces): row of start t's step j ((n, K), −1 where the trace has none) and
    # the target's token per position; target_ar rows are one per position (row t + j; target_token is the path)
    rows: np.ndarray | None = None
    path: np.ndarray | None = None

    @property
    def accepted(self) -> np.ndarray:
        """Per row: the drafted token is the target's."""
        return self.draft_token == self.target_token

    @property
    def target_path(self) -> np.ndarray:
        """The target's token at each position of the continuation (what a verifier compares against)."""
        return self.target_token if self.path is None else self.path

    def row(self, t: int, j: int) -> int | None:
        """The row of the j-th token a round starting at position t drafts; None past the trace's end or steps."""
        if self.rows is None:
            return t + j if t + j < len(self.draft_token) else None
        if t >= self.rows.shape[0] or j >= self.rows.shape[1] or self.rows[t, j] < 0:
            return None
        return int(self.rows[t, j])

    def verify_stats(self, t: int, k: int, n: int) -> VerifyStats:
        """The loop's VerifyStats (decode.lm_drafters.verify_stats) of a round that started at row t, drafted k, kept n:
        the target produced row t + n's token, so H_p and the margin are row t + n's, TVD averaged over rows
        t .. t + min(n + 1, k) − 1."""
        tvds = self.tvd[t : t + compared(k, n)]
        return VerifyStats.of(self.target_entropy[t + n], self.target_margin[t + n], tvds, k, n)


def check_greedy(manifest: dict, where) -> None:
    """Refuse, in one line, traces that are not greedy target_ar (the only ones a replay can read rounds off)."""
    if not greedy_rounds(manifest):
        kind, temp = manifest.get("trace_kind"), manifest.get("temperature")
        raise UserError(f"{where} holds {kind} traces at temperature {temp}; this needs greedy target_ar traces "
                        "(python -m data_gen trace=target_ar trace.temperature=0)")


def load_greedy_traces(folder: Path, names: list[str]) -> tuple[dict, dict]:
    """(columns present among `names`, manifest) of a greedy target_ar trace folder; other folders refused in one line."""
    from data_gen.contract import trace_columns
    from data_gen.store import load_traces

    folder = Path(folder)
    if not folder.exists():
        raise UserError(f"no traces at {folder}; make them with python -m data_gen trace=target_ar split=... limit=...")
    ds, manifest = load_traces(folder)
    check_greedy(manifest, folder)
    return trace_columns(ds, [n for n in names if n in ds.column_names]), manifest


PLUS_TRACE_COLUMNS = ("prompt_tokens", "context_token", "target_entropy", "target_margin", "tvd")
CONTINUATION_COLUMNS = ["prompt_id", "kind", "position", "draft_token", "target_token", "draft_topk", "draft_entropy",
                        "draft_hidden", "start", "step", *PLUS_TRACE_COLUMNS]


def load_continuations(folder: Path) -> tuple[list[Continuation], dict, dict]:
    """A greedy target_ar trace folder as (continuations, manifest, columns)."""
    cols, manifest = load_greedy_traces(folder, CONTINUATION_COLUMNS)
    if manifest.get("eagle"):
        print(f"note: {folder} holds {manifest['eagle']['steps']} drafting steps per round (trace.steps): a replayed "
              "round stops there whatever its policy's max_len", flush=True)
    return continuations(cols), manifest, cols


def continuations(cols: dict) -> list[Continuation]:
    """Trace columns (`CONTINUATION_COLUMNS` where present) split into continuations."""
    starts = np.flatnonzero(continuation_starts(cols))
    ends = np.append(starts[1:], len(cols["position"]))
    topk = torch.tensor(cols["draft_topk"], dtype=torch.float32)
    ent = torch.tensor(cols["draft_entropy"], dtype=torch.float32)
    hid = torch.tensor(cols["draft_hidden"]).float() if "draft_hidden" in cols else None
    plus = all(c in cols for c in PLUS_TRACE_COLUMNS)

    def part(name, a, b):
        return cols[name][a:b] if plus else None

    if "step" in cols:
        return [_chains(cols, topk, ent, hid, a, b) for a, b in zip(starts, ends)]
    out = [Continuation(topk[a:b], ent[a:b], None if hid is None else hid[a:b],
                        cols["draft_token"][a:b].astype(np.int64), cols["target_token"][a:b].astype(np.int64),
                        prompt_id=str(cols["prompt_id"][a]) if "prompt_id" in cols else str(i),
                        prompt=[int(x) for x in cols["prompt_tokens"][a]] if plus else None,
                        context_token=part("context_token", a, b), target_entropy=part("target_entropy", a, b),
                        target_margin=part("target_margin", a, b), tvd=part("tvd", a, b))
           for i, (a, b) in enumerate(zip(starts, ends))]
    return out


def _chains(cols: dict, topk, ent, hid, a: int, b: int) -> Continuation:
    """One eagle_chain continuation (rows a..b): per-row draft columns, the (start, step) → row table and the
    target's path (the context a disco_plus head reads is not rebuilt for these rows yet: plus fields stay None)."""
    start, step = cols["start"][a:b].astype(np.int64), cols["step"][a:b].astype(np.int64)
    pos = start + step
    n = int(pos.max()) + 1
    rows = np.full((n, int(step.max()) + 1), -1, dtype=np.int64)
    rows[start, step] = np.arange(b - a)
    target = cols["target_token"][a:b].astype(np.int64)
    path = np.zeros(n, dtype=np.int64)
    path[pos] = target  # every row of a position names the same target token
    return Continuation(topk[a:b], ent[a:b], None if hid is None else hid[a:b],
                        cols["draft_token"][a:b].astype(np.int64), target, prompt_id=str(cols["prompt_id"][a]),
                        rows=rows, path=path)
