"""Draft-side features: the one definition data_gen stores and decode computes, so a head sees the same inputs.

For a drafted position with draft logits z (and last hidden state h):
- the draft distribution q = softmax(z / T) for sampling at temperature T, softmax(z) for greedy (T = 0);
- DISCO: the top-k probabilities of q sorted descending (k = 10), the entropy H_q in nats, and the position of the
  token in its draft round (0 = first drafted token) — `disco_vector` stacks them;
- SPRINTER / SpecDec++: h itself, the last-layer hidden state that produced z (after the final norm);
- disco_plus: the DISCO inputs plus what a decoder knows for free (issue 16): `verify` (the last verification's
  target entropy and top-2 margin, accepted count, all-accepted flag, mean TVD — `VerifyStats`), `copy` (does x
  continue an n-gram of prompt + output, prompt-lookup agreement — `ContextIndex`), `token` (x's and the previous
  token's ids, embedded by the head), `text` (the token classes of x and of the previous token, and the line
  position — `token_classes`), `hidden` (h). Trace loading computes them from stored columns
  (`features_from_columns`), decode from the loop's state (`PlusFeatures`); a test checks both give the same rows.

Token-tree node kinds (issue 30; `NodeFeatures`, `tree = True`): one row per candidate-tree node, labelled on_path —
`c2t` (C2T, arXiv 2502.13652: joint probability, entropy of the parent's distribution, depth), `tree_node` (those,
the DISCO inputs of the parent distribution, the node's q_token and rank, log joint, the parent's own q_token) and
`tree_node_plus` (tree_node's row + two of disco_plus's groups, per node: `verify`'s policy-free part — the target's
entropy and top-2 margin at the position before the tree's root, i.e. of the distribution the last committed token
came from, 0 before the first verification — and `copy`: COPY of the node's token after the context prompt +
committed continuation + the node's root path up to its parent, `node_copy_columns` on the chain's ContextIndex).
All read models.tree.node_columns, from tree-trace columns (`from_columns`) or from a models.tree.Tree (`node_rows`,
the tree carrying its root context and verification numbers: `Tree.context` / `Tree.verify`).

Each kind is a `FeatureKind` class (`DiscoFeatures`, `HiddenFeatures`, `DiscoPlusFeatures`, `C2TFeatures`,
`TreeNodeFeatures`, `TreeNodePlusFeatures`) that declares its columns, the trace columns it is built from and what
decode must compute for it.
The distribution math these rest on (softmax, top-k, entropy, TVD) is models.distributions.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch

from models.distributions import entropy, topk_probs

DEFAULT_TOPK = 10


def disco_vector(topk: torch.Tensor, ent: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """DISCO's input: [top-k probs (k), entropy, position in round] as float32, shape (..., k + 2)."""
    return torch.cat([topk.float(), ent.float().unsqueeze(-1), position.float().unsqueeze(-1)], dim=-1)


# disco_plus: the DISCO inputs plus groups of signals a decoder has for free (see `plus_layout` for the order)
GROUPS = ("verify", "copy", "token", "text", "hidden")
VERIFY = ("target_entropy", "target_margin", "last_accepted", "last_all_accepted", "last_mean_tvd")
COPY = ("copy_len", "lookup_hit", "lookup_len")
TOKEN = ("draft_token_id", "prev_token_id")
CLASSES = ("space", "newline", "digit", "alpha", "punct", "chars")  # per token id, `token_classes`
TEXT = (*(f"draft_{c}" for c in CLASSES), *(f"prev_{c}" for c in CLASSES), "line_position")
COPY_MAX = 8  # longest n-gram continuation counted by copy_len
LOOKUP_N = 3  # prompt lookup matches the context's last 3, 2 or 1 tokens (transformers' prompt lookup uses 2-3)
# tree_node_plus's verify group as tree traces store it, per node: H_p and the top-2 margin of the target's
# distribution at the position before the tree's root (models.tree.node_columns, `Tree.verify`)
NODE_VERIFY = ("root_target_entropy", "root_target_margin")


def token_classes(tokenizer):
    """(V, 6) float32 per token id (CLASSES): leading space, contains a newline, digits only, letters only,
    punctuation only, characters — read from byte-level BPE token strings (Ġ = space, Ċ = newline, ĉ = tab)."""
    import string

    import numpy as np

    out = np.zeros((len(tokenizer), len(CLASSES)), np.float32)
    for i, tok in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        tok = tok or ""
        core = tok.replace("Ġ", "").replace("Ċ", "").replace("ĉ", "")
        punct = bool(core) and all(ch in string.punctuation for ch in core)
        out[i] = [tok.startswith("Ġ"), "Ċ" in tok or "\n" in tok, core.isdigit(), core.isalpha(), punct, len(core)]
    return out


def pack_classes(table) -> str:
    """`token_classes` as a short string for a head checkpoint: one flag byte + one length byte per id, base64."""
    import base64

    import numpy as np

    flags = (table[:, :5] > 0).astype(np.uint8) @ (1 << np.arange(5, dtype=np.uint8))
    chars = np.clip(table[:, 5], 0, 255).astype(np.uint8)
    return base64.b64encode(np.stack([flags, chars], 1).tobytes()).decode()


@functools.lru_cache(maxsize=4)
def unpack_classes(packed: str):
    """`pack_classes`' string back to the (V, 6) float32 table (cached: decode reads it once per policy)."""
    import base64

    import numpy as np

    raw = np.frombuffer(base64.b64decode(packed), np.uint8).reshape(-1, 2)
    bits = (raw[:, :1] >> np.arange(5, dtype=np.uint8)) & 1
    return np.concatenate([bits, raw[:, 1:]], 1).astype(np.float32)


def classes_of(table, token: int):
    """The row of `token` in a class table (zeros for an id past the tokenizer: a padded logit row)."""
    return table[token] if 0 <= token < len(table) else table[0] * 0


@dataclass(frozen=True)
class FeatureSpec:
    """What a head reads; stored in its checkpoint and checked by decode/eval against the pair and traces.

    kind: the name of a `FeatureKind` — `disco` (top-k + entropy + position), `hidden` (the draft's last hidden state
    of size d) or `disco_plus` (the DISCO inputs followed by the chosen `groups`, in GROUPS order; `hidden` there
    appends d values). What differs between kinds is the kind class's business (`family`); the spec only holds the
    numbers, so a checkpoint stores plain values.
    """

    kind: str
    k: int = DEFAULT_TOPK
    d: int = 0
    groups: tuple = ()
    text_classes: str = ""  # `text` group: the tokenizer's `token_classes`, packed (`pack_classes`)

    def __post_init__(self):
        unknown = set(self.groups or ()) - set(GROUPS)
        if unknown:
            raise ValueError(f"unknown feature group(s) {sorted(unknown)}; known: {', '.join(GROUPS)}")
        object.__setattr__(self, "groups", tuple(g for g in GROUPS if g in tuple(self.groups or ())))
        kind = feature_kinds().get(self.kind)
        if kind is not None and self.groups and not set(self.groups) <= set(kind.group_names if kind.grouped else ()):
            takes = ", ".join(kind.group_names) if kind.grouped else "none"
            raise ValueError(f"a {self.kind} head takes the groups {takes}, not {list(self.groups)}")
        if "text" in self.groups and not self.text_classes:
            raise ValueError("the text group needs the tokenizer's token classes (text_classes=pack_classes(...))")

    @property
    def family(self) -> FeatureKind:
        """The kind's class (`feature_kind`): its columns, trace columns and decode-time needs."""
        return feature_kind(self.kind)

    @property
    def classes(self):
        """(V, len(CLASSES)) float32 token classes of the `text` group."""
        return unpack_classes(self.text_classes)

    @property
    def names(self) -> list[str]:
        """Column names of the head input, in order."""
        return self.family.names(self)

    @property
    def dim(self) -> int:
        return len(self.names)

    @property
    def reads_probs(self) -> bool:
        """Whether the head reads the draft distribution (top-k, entropy): decode must compute q for it."""
        return self.family.reads_probs

    @property
    def reads_hidden(self) -> bool:
        """Whether the head reads the draft's hidden state (of size d: traces must store it, the pair must match)."""
        return self.family.reads_hidden(self)

    @property
    def needs_context(self) -> bool:
        """Whether a row needs the decoder's context (prompt + committed output: DraftStep.context)."""
        return self.family.needs_context(self)

    @property
    def needs_verify(self) -> bool:
        """Whether a row needs the last verification's statistics (DraftStep.verify)."""
        return self.family.needs_verify(self)

    def token_columns(self) -> list[int]:
        """Indices of the token-id columns (integers the head embeds; never normalised)."""
        names = self.names
        return [names.index(t) for t in TOKEN if t in names]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["groups"] = list(self.groups)
        return out


@dataclass(frozen=True)
class VerifyStats:
    """What the last verification told (disco_plus `verify` group), computed by the loop only for policies that ask.

    target_entropy / target_margin: H_p and top-1 − top-2 of p at the last verified position (the one that produced
    the correction or bonus token the new round drafts after); drafted / accepted: the round's k and n; mean_tvd:
    mean TVD(p, q) over the round's drafted positions up to and including its first rejection.
    """

    target_entropy: float
    target_margin: float
    drafted: int
    accepted: int
    mean_tvd: float

    def values(self) -> list[float]:
        """The VERIFY columns in order (no verification yet: `NO_VERIFY`)."""
        full = float(self.drafted > 0 and self.accepted == self.drafted)
        return [self.target_entropy, self.target_margin, float(self.accepted), full, self.mean_tvd]


NO_VERIFY = [0.0, 0.0, 0.0, 0.0, 0.0]  # the first round of a continuation has no verification before it


@dataclass
class DraftStep:
    """What a stop policy sees after one drafted token (batch 1): q, its features, the hidden state, positions.

    `context` (prompt + committed output, the loop's own list: read it, never change it) and `verify` (the last
    verification's `VerifyStats`) are filled only for policies with `needs_context` / `needs_verify_stats`, so the
    others pay nothing; the tokens drafted earlier in the round are the policy's to remember.
    """

    probs: torch.Tensor  # (V,) float32 draft distribution the token was drafted from
    token: int
    hidden: torch.Tensor | None  # (d,) last hidden state that produced the logits
    position_in_round: int  # 0 for the first drafted token of a round
    position: int  # index of this token in the generated continuation
    _topk: torch.Tensor | None = None
    _entropy: torch.Tensor | None = None
    context: list[int] | None = None
    verify: VerifyStats | None = None
    # ids outside which probs is exactly 0 (a reduced-vocabulary draft, models.lm.LM.support): top-k and entropy
    # read only these — the same values (zeros add nothing), a sixth of the work on an 8k-of-49k FR-Spec draft
    support: torch.Tensor | None = None
    _on_support: torch.Tensor | None = None  # probs on the support, gathered once for top-k and entropy

    def _mass(self) -> torch.Tensor:
        if self.support is None:
            return self.probs
        if self._on_support is None:
            self._on_support = self.probs.index_select(-1, self.support)
        return self._on_support

    def on_support(self) -> torch.Tensor:
        """q on `support` (all of q without one): what `logit_stats` compares the target's p with."""
        return self._mass()

    def topk(self, k: int = DEFAULT_TOPK) -> torch.Tensor:
        if self._topk is None or self._topk.shape[-1] != k:
            mass = self._mass()
            if mass.shape[-1] < k:  # a support smaller than k: the zeros outside it fill the tail
                mass = self.probs
            self._topk = topk_probs(mass, k)
        return self._topk

    @property
    def entropy(self) -> torch.Tensor:
        if self._entropy is None:
            self._entropy = entropy(self._mass())
        return self._entropy

    def disco(self, k: int = DEFAULT_TOPK) -> torch.Tensor:
        return disco_vector(self.topk(k), self.entropy, torch.tensor(float(self.position_in_round)))


class ContextIndex:
    """N-grams of a growing token context, for the `copy` features; push/mark/rollback so a round's drafted tokens
    can be added and taken back in O(1) each (decode) while trace loading just pushes the whole continuation.

    copy_features(x) for a candidate next token x, with C the context so far:
    - copy_len: the largest L ≤ COPY_MAX such that the last L − 1 tokens of C followed by x occur in C (0: x does
      not occur in C) — how long a stretch of the context x would continue, as in code that repeats itself;
    - lookup_hit / lookup_len: prompt lookup (transformers' PromptLookupCandidateGenerator, without the model): the
      longest suffix of C of n ≤ LOOKUP_N tokens that occurred before; its proposal is the token that followed its
      most recent earlier occurrence; lookup_hit = 1[proposal = x], lookup_len = n (0 when no suffix recurs).
    """

    def __init__(self, tokens=()):
        self.toks: list[int] = []
        self.grams: set[tuple] = set()  # every n-gram of C, n = 1..COPY_MAX
        self.follow: dict[tuple, int] = {}  # n-gram (n ≤ LOOKUP_N) → token after its latest occurrence
        self.log: list = []  # undo entries: ("g", gram) added | ("f", key, old value or None)
        for t in tokens:
            self.push(int(t))

    def push(self, tok: int) -> None:
        toks, n0 = self.toks, len(self.toks)
        for n in range(1, min(COPY_MAX, n0 + 1) + 1):
            gram = (*toks[n0 - n + 1 :], tok) if n > 1 else (tok,)
            if gram not in self.grams:
                self.grams.add(gram)
                self.log.append(("g", gram))
        for n in range(1, min(LOOKUP_N, n0) + 1):
            key = tuple(toks[n0 - n :])
            self.log.append(("f", key, self.follow.get(key)))
            self.follow[key] = tok
        toks.append(tok)

    def mark(self) -> tuple[int, int]:
        return len(self.toks), len(self.log)

    def rollback(self, mark: tuple[int, int]) -> None:
        n_toks, n_log = mark
        while len(self.log) > n_log:
            entry = self.log.pop()
            if entry[0] == "g":
                self.grams.discard(entry[1])
            elif entry[2] is None:
                del self.follow[entry[1]]
            else:
                self.follow[entry[1]] = entry[2]
        del self.toks[n_toks:]

    def copy_features(self, x: int) -> list[float]:
        toks, n0 = self.toks, len(self.toks)
        length = 0
        for n in range(1, min(COPY_MAX, n0 + 1) + 1):  # monotone: a matching n-gram's suffixes all match
            gram = (*toks[n0 - n + 1 :], x) if n > 1 else (x,)
            if gram not in self.grams:
                break
            length = n
        prop, lookup = self.lookup()
        return [float(length), float(prop is not None and prop == x), float(lookup)]

    def lookup(self) -> tuple[int | None, int]:
        """Prompt lookup's proposal for the next token and its match length n (None, 0 when no suffix recurs)."""
        toks, n0 = self.toks, len(self.toks)
        for n in range(min(LOOKUP_N, n0), 0, -1):
            prop = self.follow.get(tuple(toks[n0 - n :]))
            if prop is not None:
                return prop, n
        return None, 0


CONTEXT_GROUPS = {"copy", "token", "text"}  # the groups that read the context (DraftStep.context)


def node_copy_columns(index: ContextIndex, parents, tokens, nodes) -> np.ndarray:
    """(len(nodes), 3) COPY per token-tree node: `ContextIndex.copy_features` of the node's token after the tree's
    root context (what `index` holds: prompt + committed continuation) followed by the node's root path up to its
    parent — the chain's definition on a context that branches per node. `parents` / `tokens`: the tree's (−1: a
    child of the root). Nodes under one parent share a context: its path is pushed once, read, and rolled back, so
    `index` is left as found (decode keeps one index per prompt; traces one per continuation)."""
    import numpy as np

    out = np.zeros((len(nodes), len(COPY)), dtype=np.float32)
    by_parent: dict[int, list[int]] = {}
    for j, i in enumerate(nodes):
        by_parent.setdefault(int(parents[i]), []).append(j)
    for par, rows in by_parent.items():
        path, cur = [], par
        while cur >= 0:
            path.append(int(tokens[cur]))
            cur = int(parents[cur])
        mark = index.mark()
        for tok in reversed(path):
            index.push(tok)
        for j in rows:
            out[j] = index.copy_features(int(tokens[nodes[j]]))
        index.rollback(mark)
    return out


def advance_line(line: int, tokens, table) -> int:
    """The `text` group's line position (tokens after the last newline token, the column the next token would start
    at, in tokens) after `tokens` follow a context whose position was `line`; `advance_line(0, ctx, table)` for a
    whole context. One rule for trace columns and decode, which advances it by the tokens each round commits."""
    for tok in tokens:
        line = 0 if classes_of(table, tok)[1] else line + 1
    return line


class PlusFeatures:
    """Builds the disco_plus row (a DISCO row is one without groups) at decode time from the loop's DraftSteps (one
    per prompt; `reset` between).

    Keeps a ContextIndex of the committed context, adds the round's drafted tokens as it goes and takes them back at
    the next round, so each drafted token costs a few set/dict look-ups. Layout: `FeatureSpec.names`.
    """

    def __init__(self, spec: FeatureSpec, device=None):
        self.spec = spec
        self.buf = torch.zeros(spec.dim, device=device)
        # on CPU the row is written through a numpy view of buf: a few numpy stores instead of one torch op (and a
        # small tensor) per group, which after a model step cost ~20 µs each (cold caches)
        self._np = self.buf.numpy() if self.buf.device.type == "cpu" else None
        self.index: ContextIndex | None = None
        self.round_mark = None
        self.last = -1
        # text group: the line position before the current token, and after the committed context alone
        self.line = self.committed_line = 0
        self.table = spec.classes if "text" in spec.groups else None

    def reset(self) -> None:
        self.index, self.round_mark, self.last, self.line, self.committed_line = None, None, -1, 0, 0

    def row(self, step: DraftStep) -> torch.Tensor:
        spec, buf, k, view = self.spec, self.buf, self.spec.k, self._np
        if view is not None:
            view[:k] = step.topk(k).cpu().numpy()  # a head on the CPU behind a CUDA draft: k floats come over
            view[k] = float(step.entropy)
            view[k + 1] = step.position_in_round
        else:
            buf[:k].copy_(step.topk(k))
            buf[k] = step.entropy
            buf[k + 1] = step.position_in_round
        i = k + 2
        table = self.table
        if CONTEXT_GROUPS & set(spec.groups):
            ctx = step.context
            if ctx is None:
                raise RuntimeError("disco_plus copy/token/text features need DraftStep.context (policy.needs_context)")
            if step.position_in_round == 0:
                if self.index is None:
                    self.index = ContextIndex()
                elif self.round_mark is not None:
                    self.index.rollback(self.round_mark)
                committed = ctx[len(self.index.toks) :]  # what the last round added (all of it at first)
                for t in committed:
                    self.index.push(t)
                self.round_mark = self.index.mark()
                prev = ctx[-1] if ctx else -1
                if table is not None:
                    self.line = self.committed_line = advance_line(self.committed_line, committed, table)
            else:
                self.index.push(self.last)
                prev = self.last
                if table is not None:
                    self.line = advance_line(self.line, (prev,), table)
            self.last = step.token
        values: list[float] = []
        for g in spec.groups:
            if g == "verify":
                values += step.verify.values() if step.verify is not None else NO_VERIFY
            elif g == "copy":
                values += self.index.copy_features(step.token)
            elif g == "token":
                values += [float(step.token), float(prev)]
            elif g == "text":
                values += [*classes_of(table, step.token), *classes_of(table, prev), float(self.line)]
        if values:
            if view is not None:
                view[i : i + len(values)] = values
            else:
                buf[i : i + len(values)] = torch.tensor(values)
            i += len(values)
        if "hidden" in spec.groups:
            buf[i:].copy_(step.hidden.float())
        return buf


# ------------------------------------------------------------------------------------ trace columns → head inputs


def _np(x):
    import numpy as np

    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    arr = np.asarray(x)
    return arr if arr.flags.writeable or arr.dtype == object else arr.copy()


def continuation_starts(columns: dict):
    """Bool per trace row: the first row of a continuation (new prompt_id or kind, or the position not increasing)."""
    import numpy as np

    pos = _np(columns["position"]).astype(np.int64)
    starts = np.ones(len(pos), dtype=bool)
    if len(pos) > 1:
        same = pos[1:] > pos[:-1]
        for key in ("prompt_id", "kind"):
            if key in columns:
                col = _np(columns[key])
                same &= col[1:] == col[:-1]
        starts[1:] = ~same
    return starts


def trace_round_positions(columns: dict):
    """Position in the draft round for each trace row: rounds cut after each greedy mismatch (draft ≠ argmax p)."""
    import numpy as np

    accepted = _np(columns["draft_token"]) == _np(columns["target_token"])
    starts = continuation_starts(columns)
    # a row starts a round at a continuation start or right after a rejected row; position = rows since that start
    n = len(accepted)
    reset = np.zeros(n, dtype=bool)
    reset[0:1] = True
    reset[1:] = starts[1:] | ~accepted[:-1]
    idx = np.arange(n)
    last_reset = np.maximum.accumulate(np.where(reset, idx, 0))
    return idx - last_reset


PLUS_COLUMNS = {
    "verify": ("target_entropy", "target_margin", "tvd"),
    "copy": ("context_token", "prompt_tokens"),
    "token": ("context_token", "prompt_tokens"),
    "text": ("context_token", "prompt_tokens"),
    "hidden": ("draft_hidden",),
}
ROUND_COLUMNS = ("draft_token", "target_token", "position", "prompt_id", "kind")


def needed_columns(spec: FeatureSpec) -> tuple[str, ...]:
    """The trace columns `features_from_columns` reads for a spec (its kind's `columns`)."""
    return spec.family.columns(spec)


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
    ent = _np(columns["target_entropy"]).astype(np.float32)
    margin = _np(columns["target_margin"]).astype(np.float32)
    tv = _np(columns["tvd"]).astype(np.float64)
    csum = np.concatenate([[0.0], np.cumsum(tv)])
    prev_start = last - pos[last]
    mean_tvd = (csum[last + 1] - csum[prev_start]) / np.maximum(last + 1 - prev_start, 1)
    out[:, 0] = np.where(has, ent[last], 0.0)
    out[:, 1] = np.where(has, margin[last], 0.0)
    out[:, 2] = np.where(has, pos[last], 0)
    out[:, 4] = np.where(has, mean_tvd, 0.0)
    return out


def copy_token_columns(columns: dict):
    """((N, 3) COPY, (N, 2) TOKEN) per trace row: the context is the prompt + the continuation's context tokens
    before the row (the target's greedy tokens in target_ar traces: what a decoding round sees up to its first
    rejection), the candidate is the row's draft_token, the previous token the context's last."""
    import numpy as np

    starts = np.flatnonzero(continuation_starts(columns))
    ends = np.append(starts[1:], len(columns["position"]))
    ctx_tok = _np(columns["context_token"]).astype(np.int64).tolist()
    draft = _np(columns["draft_token"]).astype(np.int64).tolist()
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
    ctx_tok = _np(columns["context_token"]).astype(np.int64).tolist()
    draft = _np(columns["draft_token"]).astype(np.int64).tolist()
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


def features_from_columns(columns: dict, spec: FeatureSpec) -> torch.Tensor:
    """Head input (N, spec.dim) float32 from trace columns (a dict of arrays), the same vector decode builds per step
    (its kind's `from_columns`)."""
    return spec.family.from_columns(columns, spec)


# ------------------------------------------------------------------------------------------------- feature kinds


class FeatureKind:
    """One kind of head input (`FeatureSpec.kind`): its columns, the trace columns it is built from, and what decode
    must compute for it. Every difference between kinds lives in its class, so the stages ask a spec
    (`spec.reads_probs`, `spec.reads_hidden`, `needed_columns(spec)`, ...) rather than compare kind names; a new kind
    is one subclass with a new `name` (the string checkpoints store), which `feature_kind` finds."""

    name = ""
    reads_probs = False  # the DISCO part (top-k q, H_q): decode computes q, traces store draft_topk / draft_entropy
    grouped = False  # takes optional column groups (`FeatureSpec.groups`, train's model.groups)
    group_names: tuple = GROUPS  # the groups a grouped kind takes
    # scores token-tree nodes (`NodeFeatures`: tree traces, decode's tree builders) rather than chain drafting steps:
    # no round decoder, no chain speed rule or static-length baseline
    tree = False
    # the training-free scores its heads are compared with (eval.metrics.BASELINES names), on the same rows
    baselines = ("max_q", "neg_entropy")
    position_columns = ROUND_COLUMNS  # the trace columns `positions` reads

    def names(self, spec: FeatureSpec) -> list[str]:
        """Column names of the head input, in order."""
        raise NotImplementedError

    def columns(self, spec: FeatureSpec) -> tuple[str, ...]:
        """The trace columns `from_columns` reads."""
        raise NotImplementedError

    def from_columns(self, columns: dict, spec: FeatureSpec) -> torch.Tensor:
        """(N, spec.dim) float32 head input from trace columns."""
        raise NotImplementedError

    def decoder(self, spec: FeatureSpec, device=None):
        """The decode-time row builder: `reset()` per prompt, `row(step)` per drafted token (`from_columns`' row)."""
        raise NotImplementedError

    def positions(self, columns: dict):
        """Per row, its 0-based position in what the decoder drafts in one go (per-position metrics buckets; chain
        kinds: the position in the draft round, `trace_round_positions`)."""
        return trace_round_positions(columns)

    def reads_hidden(self, spec: FeatureSpec) -> bool:
        return False

    def needs_context(self, spec: FeatureSpec) -> bool:
        return False

    def needs_verify(self, spec: FeatureSpec) -> bool:
        return False


class DiscoFeatures(FeatureKind):
    """DISCO: [draft_topk[:, :k], draft_entropy, position in round] (`disco_vector`; the round position comes from
    `trace_round_positions`). Decode builds the row with `PlusFeatures` (a DISCO row is a disco_plus row without
    groups)."""

    name = "disco"
    reads_probs = True

    def names(self, spec):
        return [f"top{i + 1}" for i in range(spec.k)] + ["draft_entropy", "position_in_round"]

    def columns(self, spec):
        return ("draft_topk", "draft_entropy", *ROUND_COLUMNS)

    def from_columns(self, columns, spec):
        topk = torch.as_tensor(_np(columns["draft_topk"]), dtype=torch.float32)
        if topk.ndim != 2 or topk.shape[1] < spec.k:
            raise ValueError(f"draft_topk has shape {tuple(topk.shape)}; the feature spec needs k={spec.k}")
        ent = torch.as_tensor(_np(columns["draft_entropy"]), dtype=torch.float32)
        pos = torch.as_tensor(trace_round_positions(columns), dtype=torch.float32)
        return disco_vector(topk[:, : spec.k], ent, pos)

    def decoder(self, spec, device=None):
        return PlusFeatures(spec, device=device)


class HiddenFeatures(FeatureKind):
    """SPRINTER / SpecDec++: draft_hidden as float32, d values."""

    name = "hidden"

    def names(self, spec):
        return [f"h{i}" for i in range(spec.d)]

    def columns(self, spec):
        return ("draft_hidden",)

    def from_columns(self, columns, spec):
        hidden = torch.as_tensor(_np(columns["draft_hidden"])).float()
        if hidden.ndim != 2 or hidden.shape[1] != spec.d:
            raise ValueError(f"draft_hidden has shape {tuple(hidden.shape)}; the feature spec needs d={spec.d}")
        return hidden

    def decoder(self, spec, device=None):
        return HiddenRow()

    def reads_hidden(self, spec):
        return True


class HiddenRow:
    """The decode-time row of a hidden-state head: the draft's hidden state itself."""

    def reset(self) -> None:
        pass

    def row(self, step: DraftStep) -> torch.Tensor:
        return step.hidden.float()


GROUP_COLUMNS = {"verify": VERIFY, "copy": COPY, "token": TOKEN, "text": TEXT}  # disco_plus head columns per group


class DiscoPlusFeatures(DiscoFeatures):
    """disco_plus: the disco vector then, per group in GROUPS order, `verify_columns`, `copy_token_columns`,
    `text_columns` and draft_hidden (decode: `PlusFeatures.row`)."""

    name = "disco_plus"
    grouped = True

    def names(self, spec):
        out = super().names(spec)
        for g in spec.groups:
            out += list(GROUP_COLUMNS.get(g, ())) or HiddenFeatures().names(spec)
        return out

    def columns(self, spec):
        cols = list(super().columns(spec))
        for g in spec.groups:
            cols += PLUS_COLUMNS[g]
        return tuple(dict.fromkeys(cols))

    def from_columns(self, columns, spec):
        parts = [super().from_columns(columns, spec)]
        if "copy" in spec.groups or "token" in spec.groups:
            copy, tok = copy_token_columns(columns)
        for g in spec.groups:
            if g == "verify":
                parts.append(torch.as_tensor(verify_columns(columns)))
            elif g == "copy":
                parts.append(torch.as_tensor(copy))
            elif g == "token":
                parts.append(torch.as_tensor(tok))
            elif g == "text":
                parts.append(torch.as_tensor(text_columns(columns, spec.classes)))
            else:
                parts.append(HiddenFeatures().from_columns(columns, spec))
        return torch.cat(parts, dim=1)

    def reads_hidden(self, spec):
        return "hidden" in spec.groups

    def needs_context(self, spec):
        return bool(CONTEXT_GROUPS & set(spec.groups))

    def needs_verify(self, spec):
        return "verify" in spec.groups


# ------------------------------------------------------------------------------------- token-tree node kinds


def parent_rows(columns: dict):
    """Per tree-trace row, the row of its parent node in the same (prompt_id, position) tree; −1 for the root's
    children. Node ids index within one tree, so the lookup is by (prompt_id, position, node).

    data_gen writes a tree's nodes as consecutive rows in node order (node i is row start + i), so the parent's row is
    row − node + parent; a reordered table (checked) falls back to a lookup by (prompt_id, position, node)."""
    import numpy as np

    node = _np(columns["node"]).astype(np.int64)
    parent = _np(columns["parent"]).astype(np.int64)
    keys = [_np(columns[c]) for c in ("prompt_id", "position") if c in columns]
    n, has = len(node), parent >= 0
    rows = np.where(has, np.arange(n) - node + parent, np.arange(n))  # a root child points at itself (unused)
    good = (rows >= 0) & (rows < n)
    if good.all():
        good = node[rows] == np.where(has, parent, node)
        for key in keys:
            good &= key[rows] == key
    if not good.all():
        where = {(*(key[i] for key in keys), int(node[i])): i for i in range(n)}
        rows = np.array([where.get((*(key[i] for key in keys), int(parent[i])), -1) if has[i] else i for i in range(n)],
                        dtype=np.int64)
        if (rows[has] < 0).any():
            raise ValueError("tree trace rows name a parent node missing from the table; load whole trees")
    return np.where(has, rows, -1)


def parent_q_column(columns: dict):
    """Per tree-trace row, its parent node's own q_token (1.0 for the root's children), read off the parent's row
    (`parent_rows`)."""
    import numpy as np

    rows = parent_rows(columns)
    q = _np(columns["q_token"]).astype(np.float32)
    out = np.ones(len(rows), dtype=np.float32)
    out[rows >= 0] = q[rows[rows >= 0]]
    return out


def parent_on_path_rows(parents, on_path):
    """The nodes whose parent is on the accepted path (the root's children always): the rows of the conditional
    task P(on path | parent on path) (labels=on_path_given_parent). `parents`: per row its parent's row, −1 at the
    root (`parent_rows`, or a models.tree.Tree's `parents`, where node i is row i)."""
    import numpy as np

    par = np.asarray(parents, dtype=np.int64)
    on = np.asarray(on_path).astype(bool)
    out = par < 0
    out[~out] = on[par[~out]]
    return out


def compose_path(scores, parents, how: str = "product"):
    """Per node, its score composed along its root path: `product` (acc = P · acc[parent], a conditional head's
    P(on path | parent on path) → P(on path), as EAGLE-2's joint composes q) or `min` (acc = min(P, acc[parent]),
    an unconditional head's P capped by its parent's). `parents` as in `parent_on_path_rows`; any row order."""
    import numpy as np

    p = np.asarray(scores, dtype=np.float64).reshape(-1)
    par = np.asarray(parents, dtype=np.int64).reshape(-1)
    op = {"product": np.multiply, "min": np.minimum}.get(how)
    if op is None:
        raise ValueError(f"compose_path: how must be product or min, got '{how}'")
    acc, done = p.copy(), par < 0
    while not done.all():  # one level per pass: the nodes whose parent is composed
        ready = ~done & done[np.where(done, 0, par)]
        if not ready.any():
            raise ValueError("compose_path: a node's parent is missing or on a cycle; pass whole trees")
        acc[ready] = op(p[ready], acc[par[ready]])
        done |= ready
    return acc


class NodeFeatures(FeatureKind):
    """A token-tree node kind: one row per candidate-tree node, from `tree` traces (`from_columns`) or from a
    models.tree.Tree at decode (`node_rows`); both go through `_matrix` on the same per-node columns
    (models.tree.node_columns), so the rows are equal. `parts` lists the row's values in order ("topk": the parent
    distribution's sorted top-k, k values; the others one value each, `NODE_VALUES`). The label is `on_path`, the
    training-free baselines the joint probability and q_token (the scores EAGLE-2 and a greedy tree rank nodes by)."""

    tree = True
    baselines = ("joint", "q_token")
    position_columns = ("depth",)
    parts: tuple = ()
    # the optional models.tree.node_columns groups the row reads ("copy", "verify"): what decode's builder must hand
    # the tree (Tree.context, Tree.verify) and what only newer tree traces store (data_gen.store.TREE_FORMAT)
    node_groups: tuple = ()

    def groups_of(self, spec: FeatureSpec) -> tuple:
        """The node groups a head of this kind reads (grouped kinds: its spec's)."""
        return self.node_groups

    def parts_of(self, spec: FeatureSpec) -> tuple:
        """The row's values in order for this spec (`parts`, then each read group's values)."""
        return self.parts

    def names(self, spec):
        out = []
        for part in self.parts_of(spec):
            out += [f"top{i + 1}" for i in range(spec.k)] if part == "topk" else [part]
        return out

    def columns(self, spec):
        cols = []
        for part in self.parts_of(spec):
            cols += NODE_SOURCES[part]
        return tuple(dict.fromkeys(cols))

    def _matrix(self, cols: dict, spec: FeatureSpec) -> torch.Tensor:
        import numpy as np

        blocks = []
        for part in self.parts_of(spec):
            if part == "topk":
                topk = np.asarray(cols["draft_topk"], dtype=np.float32)
                if topk.ndim != 2 or topk.shape[1] < spec.k:
                    raise ValueError(f"draft_topk has shape {tuple(topk.shape)}; the feature spec needs k={spec.k}")
                blocks.append(topk[:, : spec.k])
            else:
                blocks.append(np.asarray(NODE_VALUES[part](cols), dtype=np.float32).reshape(-1, 1))
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(blocks, axis=1), dtype=np.float32))

    def from_columns(self, columns, spec):
        lack = [c for c in self.columns(spec) if c not in columns and c not in ("prompt_id", "position")]  # keys only
        if lack:
            from utils.cli import UserError

            raise UserError(f"{self.name} features need tree-trace column(s) {lack} these traces lack (made before "
                            "them?); regenerate the tree traces with python -m data_gen trace=tree ... overwrite=true")
        cols = {c: _np(columns[c]) for c in self.columns(spec) if c in columns}
        if "parent_q" in self.parts_of(spec):
            cols["parent_q"] = parent_q_column(columns)
        return self._matrix(cols, spec)

    def node_rows(self, tree, nodes: list[int], spec: FeatureSpec, support=None) -> torch.Tensor:
        """(len(nodes), spec.dim) float32 rows of `nodes` of a models.tree.Tree (their parents' distributions known:
        `tree.dist`), the rows `from_columns` gives for the same nodes in a tree trace. `support`: the draft's reduced
        vocabulary (models.lm.LM.support) when it has one — the same values, fewer reads."""
        from models.tree import node_columns

        k = spec.k if "topk" in self.parts_of(spec) else 0
        return self._matrix(node_columns(tree, list(nodes), k, support, self.groups_of(spec)), spec)

    def positions(self, columns):
        """depth − 1: the node's position on its drafted path (0 = a child of the root), as a chain's round position."""
        import numpy as np

        return _np(columns["depth"]).astype(np.int64) - 1

    def decoder(self, spec, device=None):
        from utils.cli import UserError

        raise UserError(f"a {self.name} head scores token-tree nodes (decode's tree builders: kind.node_rows); it has "
                        "no chain-round decoder, so it cannot be a chain stop policy (learned:<ckpt>): use a disco head")

    def needs_context(self, spec):
        return "copy" in self.groups_of(spec)

    def needs_verify(self, spec):
        return "verify" in self.groups_of(spec)


def _log(x):
    """float32 log, floored at 1e-30 (a joint probability can underflow to 0 in float32)."""
    import numpy as np

    return np.log(np.maximum(np.asarray(x, dtype=np.float32), np.float32(1e-30)))


# the trace columns each node value reads, and the value from those columns (float32 arrays, `NodeFeatures._matrix`)
NODE_SOURCES = {
    "topk": ("draft_topk",),
    "parent_entropy": ("draft_entropy",),
    "depth": ("depth",),
    "joint": ("joint",),
    "log_joint": ("joint",),
    "q_token": ("q_token",),
    "rank": ("rank",),
    "parent_q": ("node", "parent", "q_token", "prompt_id", "position"),
    "target_entropy": (NODE_VERIFY[0],),
    "target_margin": (NODE_VERIFY[1],),
    **{c: (c,) for c in COPY},
}
NODE_VALUES = {
    "parent_entropy": lambda c: c["draft_entropy"],
    "depth": lambda c: c["depth"],
    "joint": lambda c: c["joint"],
    "log_joint": lambda c: _log(c["joint"]),
    "q_token": lambda c: c["q_token"],
    "rank": lambda c: c["rank"],
    "parent_q": lambda c: c["parent_q"],
    "target_entropy": lambda c: c[NODE_VERIFY[0]],
    "target_margin": lambda c: c[NODE_VERIFY[1]],
    **{name: (lambda c, name=name: c[name]) for name in COPY},
}


class C2TFeatures(NodeFeatures):
    """C2T (arXiv 2502.13652): [joint probability, entropy of the parent's distribution, depth]."""

    name = "c2t"
    parts = ("joint", "parent_entropy", "depth")


class TreeNodeFeatures(NodeFeatures):
    """This project's richer node row: C2T's inputs, the DISCO inputs of the parent distribution (sorted top-k), the
    node's own q_token and rank, log joint, and the parent's own q_token (1.0 for the root's children)."""

    name = "tree_node"
    reads_probs = True
    parts = ("topk", "parent_entropy", "depth", "joint", "log_joint", "q_token", "rank", "parent_q")


class TreeNodePlusFeatures(TreeNodeFeatures):
    """tree_node's row + the richer inputs the chain's disco_plus heads read, per node (issue 30):
    - `verify` (VERIFY[:2]): the target's entropy and top-2 margin at the position before the tree's root — the
      distribution the last committed token came from, as the last verification saw it (decode: its pass over the
      previous round's tree; traces: the target's greedy generation step), 0 for a continuation's first tree. The
      policy-dependent part of disco_plus's verify group (accepted count, all-accepted, mean TVD) is left out: in a
      tree trace it depends on the builder that would have verified the previous round;
    - `copy` (COPY): copy_len / lookup_hit / lookup_len of the node's token after prompt + committed continuation +
      the node's root path up to its parent (`node_copy_columns`, the chain's ContextIndex).
    Not `hidden`: the parent's 576-float hidden state per node would take ~7 GB of tree traces for 500 prompts.
    Decode hands the builder the root context and the verification numbers (`needs_context`, `needs_verify`:
    decode.loop attaches them to the tree, models.tree.grow). `model.groups` picks either group alone (the ablation);
    a spec without groups (the heads saved before groups were selectable) reads both."""

    name = "tree_node_plus"
    grouped = True
    group_names = ("verify", "copy")
    node_groups = group_names
    GROUP_PARTS = {"verify": VERIFY[:2], "copy": COPY}

    def groups_of(self, spec):
        return tuple(spec.groups) or self.node_groups

    def parts_of(self, spec):
        return (*TreeNodeFeatures.parts, *(p for g in self.groups_of(spec) for p in self.GROUP_PARTS[g]))


def feature_kinds() -> dict[str, type[FeatureKind]]:
    """Every feature kind by name: the subclasses of FeatureKind (defining one is all it takes to add it)."""
    out, todo = {}, [FeatureKind]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.name:
                out[sub.name] = sub
    return out


_KINDS: dict[str, FeatureKind] = {}  # one instance per kind name, made on first use


def feature_kind(name: str) -> FeatureKind:
    """The feature kind called `name` (ValueError naming the known ones otherwise)."""
    kind = _KINDS.get(name)
    if kind is None:
        cls = feature_kinds().get(name)
        if cls is None:
            raise ValueError(f"unknown feature kind '{name}'; known: {', '.join(sorted(feature_kinds()))}")
        kind = _KINDS[name] = cls()
    return kind
