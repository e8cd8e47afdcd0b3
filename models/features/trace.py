"""Trace columns → the chain groups' values: the rows' continuations and draft rounds (rounds cut after each greedy
mismatch, as a decoder's first rejection ends them) and the verify / copy / token / text values per row, the values
decode computes from its own state (models.features.chain.PlusFeatures)."""

from __future__ import annotations

from models.features.context import ContextIndex
from models.features.layout import CLASSES, COPY, TEXT, TOKEN, VERIFY
from models.features.signals import all_accepted, compared
from models.features.text import advance_line, classes_of


def as_array(x):
    """A column as a numpy array (a tensor's copy on the CPU; a read-only array copied, so callers may write)."""
    import numpy as np

    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    arr = np.asarray(x)
    return arr if arr.flags.writeable or arr.dtype == object else arr.copy()


def continuation_starts(columns: dict):
    """Bool per trace row: the first row of a continuation (new prompt_id or kind, or the position not increasing;
    eagle_chain rows: its chain of start 0's first step)."""
    import numpy as np

    pos = as_array(columns["position"]).astype(np.int64)
    if "step" in columns:
        first = (as_array(columns["start"]) == 0) & (as_array(columns["step"]) == 0)
        return first | _new_prompt(columns, len(pos))
    starts = np.ones(len(pos), dtype=bool)
    if len(pos) > 1:
        same = pos[1:] > pos[:-1]
        for key in ("prompt_id", "kind"):
            if key in columns:
                col = as_array(columns[key])
                same &= col[1:] == col[:-1]
        starts[1:] = ~same
    return starts


def _new_prompt(columns: dict, n: int):
    import numpy as np

    out = np.zeros(n, dtype=bool)
    out[:1] = True
    for key in ("prompt_id", "kind"):
        if key in columns and n > 1:
            col = as_array(columns[key])
            out[1:] |= col[1:] != col[:-1]
    return out


def trace_round_positions(columns: dict):
    """Position in the draft round for each trace row: rounds cut after each greedy mismatch (draft ≠ argmax p);
    an eagle_chain row is its chain's step, the round it belongs to being explicit."""
    import numpy as np

    if "step" in columns:
        return as_array(columns["step"]).astype(np.int64)

    accepted = as_array(columns["draft_token"]) == as_array(columns["target_token"])
    starts = continuation_starts(columns)
    # a row starts a round at a continuation start or right after a rejected row; position = rows since that start
    n = len(accepted)
    reset = np.zeros(n, dtype=bool)
    reset[0:1] = True
    reset[1:] = starts[1:] | ~accepted[:-1]
    idx = np.arange(n)
    last_reset = np.maximum.accumulate(np.where(reset, idx, 0))
    return idx - last_reset



def verify_columns(columns: dict):
    """(N, 5) VERIFY features per trace row, for rounds cut after each greedy mismatch (`trace_round_positions`).

    A round that starts at row s (not a continuation start) follows a round that ended with its first rejection at
    row s − 1: the decoder verified rows s' .. s − 1 there (s' = that round's start), accepted s − 1 − s' of them,
    and produced the round's first context token from p at row s − 1. So, per row of the round: H_p and the top-2
    margin at row s − 1, accepted = s − 1 − s', all-accepted = 0, mean TVD over rows s' .. s − 1. A decoder whose
    round stopped before its first rejection had all of them accepted; those rounds do not occur in these traces.
    """
    import numpy as np

    pos = trace_round_positions(columns)
    starts = continuation_starts(columns)
    n = len(pos)
    idx = np.arange(n)
    rs = idx - pos  # each row's round start
    out = np.zeros((n, len(VERIFY)), dtype=np.float32)
    has = ~starts[rs]
    last = np.maximum(rs - 1, 0)
    ent = as_array(columns["target_entropy"]).astype(np.float32)
    margin = as_array(columns["target_margin"]).astype(np.float32)
    tv = as_array(columns["tvd"]).astype(np.float64)
    csum = np.concatenate([[0.0], np.cumsum(tv)])
    accepted = pos[last]  # the previous round kept all it drafted before its rejection at row s − 1
    drafted = accepted + 1
    prev_start = last - accepted
    span = compared(drafted, accepted)
    mean_tvd = (csum[prev_start + span] - csum[prev_start]) / np.maximum(span, 1)
    out[:, 0] = np.where(has, ent[last], 0.0)
    out[:, 1] = np.where(has, margin[last], 0.0)
    out[:, 2] = np.where(has, accepted, 0)
    out[:, 3] = np.where(has, all_accepted(drafted, accepted), 0)
    out[:, 4] = np.where(has, mean_tvd, 0.0)
    return out


def copy_token_columns(columns: dict):
    """((N, 3) COPY, (N, 2) TOKEN) per trace row: the context is the prompt + the continuation's context tokens
    before the row (the target's greedy tokens in target_ar traces: what a decoding round sees up to its first
    rejection), the candidate is the row's draft_token, the previous token the context's last."""
    import numpy as np

    starts = np.flatnonzero(continuation_starts(columns))
    ends = np.append(starts[1:], len(columns["position"]))
    ctx_tok = as_array(columns["context_token"]).astype(np.int64).tolist()
    draft = as_array(columns["draft_token"]).astype(np.int64).tolist()
    prompts = columns["prompt_tokens"]
    copy = np.zeros((len(draft), len(COPY)), dtype=np.float32)
    tok = np.zeros((len(draft), len(TOKEN)), dtype=np.float32)
    for a, b in zip(starts, ends):
        index = ContextIndex(prompts[a])
        for i in range(a, b):
            copy[i] = index.copy_features(draft[i])
            tok[i] = (draft[i], index.toks[-1] if index.toks else -1)
            index.push(ctx_tok[i])
    return copy, tok


def text_columns(columns: dict, table):
    """(N, 13) TEXT per trace row: classes of the row's draft_token and of the context's last token, and the line
    position of the row (`advance_line` over prompt + the continuation's context tokens before it)."""
    import numpy as np

    starts = np.flatnonzero(continuation_starts(columns))
    ends = np.append(starts[1:], len(columns["position"]))
    ctx_tok = as_array(columns["context_token"]).astype(np.int64).tolist()
    draft = as_array(columns["draft_token"]).astype(np.int64).tolist()
    out = np.zeros((len(draft), len(TEXT)), dtype=np.float32)
    width = len(CLASSES)
    for a, b in zip(starts, ends):
        prompt = [int(t) for t in columns["prompt_tokens"][a]]
        line, prev = advance_line(0, prompt, table), (prompt[-1] if prompt else -1)
        for i in range(a, b):
            out[i, :width] = classes_of(table, draft[i])
            out[i, width : 2 * width] = classes_of(table, prev)
            out[i, -1] = line
            prev = ctx_tok[i]
            line = advance_line(line, (prev,), table)
    return out



def hidden_columns(columns: dict, d: int):
    """(N, d) float32 draft_hidden, checked against the spec's hidden size."""
    import torch

    hidden = torch.as_tensor(as_array(columns["draft_hidden"])).float()
    if hidden.ndim != 2 or hidden.shape[1] != d:
        raise ValueError(f"draft_hidden has shape {tuple(hidden.shape)}; the feature spec needs d={d}")
    return hidden
