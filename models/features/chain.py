"""The chain feature kinds — `disco` (top-k + entropy + round position), `hidden` (the draft's hidden state),
`disco_plus` (DISCO + feature groups) — and their decode-time row builders, which give the rows trace loading gives.

For a drafted position with draft logits z (and last hidden state h): q = softmax(z / T) for sampling at temperature
T, softmax(z) for greedy; DISCO reads the top-k probabilities of q sorted descending (k = 10), H_q in nats and the
token's position in its draft round; SPRINTER / SpecDec++ read h (after the final norm); disco_plus reads the DISCO
inputs followed by its `groups` (models.features.groups: verify, copy, token, text, hidden and any a user adds).
"""

from __future__ import annotations

import torch

from models.features.context import ContextIndex
from models.features.groups import resolve
from models.features.kind import FeatureKind
from models.features.layout import ROUND_COLUMNS, hidden_names
from models.features.signals import DraftStep, disco_vector
from models.features.text import advance_line
from models.features.trace import as_array, hidden_columns, trace_round_positions


class DiscoFeatures(FeatureKind):
    """DISCO: [draft_topk[:, :k], draft_entropy, position in round] (`disco_vector`; the round position comes from
    `trace_round_positions`). Decode builds the row with `PlusFeatures` (a DISCO row is a disco_plus row without
    groups)."""

    name = "disco"
    reads_probs = True

    def names(self, spec):
        return [f"top{i + 1}" for i in range(spec.k)] + ["draft_entropy", "position_in_round"]

    def columns(self, spec):
        return ("draft_topk", "draft_entropy", *ROUND_COLUMNS)  # + CHAIN_COLUMNS where present: position_columns

    def from_columns(self, columns, spec):
        topk = torch.as_tensor(as_array(columns["draft_topk"]), dtype=torch.float32)
        if topk.ndim != 2 or topk.shape[1] < spec.k:
            raise ValueError(f"draft_topk has shape {tuple(topk.shape)}; the feature spec needs k={spec.k}")
        ent = torch.as_tensor(as_array(columns["draft_entropy"]), dtype=torch.float32)
        pos = torch.as_tensor(trace_round_positions(columns), dtype=torch.float32)
        return disco_vector(topk[:, : spec.k], ent, pos)

    def decoder(self, spec, device=None):
        return PlusFeatures(spec, device=device)


class HiddenFeatures(FeatureKind):
    """SPRINTER / SpecDec++: draft_hidden as float32, d values."""

    name = "hidden"

    def names(self, spec):
        return hidden_names(spec.d)

    def columns(self, spec):
        return ("draft_hidden",)

    def from_columns(self, columns, spec):
        return hidden_columns(columns, spec.d)

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


class DiscoPlusFeatures(DiscoFeatures):
    """disco_plus: the disco vector then each of the spec's groups' columns, in the groups' order
    (models.features.groups; decode: `PlusFeatures.row`)."""

    name = "disco_plus"
    grouped = True

    def feature_groups(self, spec):
        return resolve(self.group_folder, spec.groups)

    def names(self, spec):
        out = super().names(spec)
        for group in self.feature_groups(spec):
            out += group.names(spec)
        return out

    def columns(self, spec):
        cols = list(super().columns(spec))
        for group in self.feature_groups(spec):
            cols += group.trace_columns
        return tuple(dict.fromkeys(cols))

    def from_columns(self, columns, spec):
        parts, cache = [super().from_columns(columns, spec)], {}
        for group in self.feature_groups(spec):
            parts.append(torch.as_tensor(group.from_columns(columns, spec, cache)))
        return torch.cat(parts, dim=1)

    def reads_hidden(self, spec):
        return any(g.reads_hidden for g in self.feature_groups(spec))

    def needs_context(self, spec):
        return any(g.reads_context for g in self.feature_groups(spec))

    def needs_verify(self, spec):
        return any(g.reads_verify for g in self.feature_groups(spec))


class PlusFeatures:
    """Builds the disco_plus row (a DISCO row is one without groups) at decode time from the loop's DraftSteps (one
    per prompt; `reset` between).

    Keeps a ContextIndex of the committed context, adds the round's drafted tokens as it goes and takes them back at
    the next round, so each drafted token costs a few set/dict look-ups. Layout: `FeatureSpec.names`. The groups read
    the state it keeps: `index`, `prev` (the token before the drafted one), `line` and `table` (the text group's).
    """

    def __init__(self, spec, device=None):
        self.spec = spec
        self.groups = spec.family.feature_groups(spec)
        self.values_groups = [g for g in self.groups if not g.reads_hidden]
        self.hidden = any(g.reads_hidden for g in self.groups)
        self.context = any(g.reads_context for g in self.groups)
        self.buf = torch.zeros(spec.dim, device=device)
        # on CPU the row is written through a numpy view of buf: a few numpy stores instead of one torch op (and a
        # small tensor) per group, which after a model step cost ~20 µs each (cold caches)
        self._np = self.buf.numpy() if self.buf.device.type == "cpu" else None
        self.index: ContextIndex | None = None
        self.round_mark = None
        self.last = self.prev = -1
        # text group: the line position before the current token, and after the committed context alone
        self.line = self.committed_line = 0
        self.table = spec.classes if any(g.needs_classes for g in self.groups) else None

    def reset(self) -> None:
        self.index, self.round_mark, self.last, self.prev, self.line, self.committed_line = None, None, -1, -1, 0, 0

    def _advance(self, step: DraftStep) -> None:
        """Bring the index, the previous token and the line position to just before `step`'s token."""
        ctx, table = step.context, self.table
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
            self.prev = ctx[-1] if ctx else -1
            if table is not None:
                self.line = self.committed_line = advance_line(self.committed_line, committed, table)
        else:
            self.index.push(self.last)
            self.prev = self.last
            if table is not None:
                self.line = advance_line(self.line, (self.prev,), table)
        self.last = step.token

    def row(self, step: DraftStep) -> torch.Tensor:
        buf, k, view = self.buf, self.spec.k, self._np
        if view is not None:
            view[:k] = step.topk(k).cpu().numpy()  # a head on the CPU behind a CUDA draft: k floats come over
            view[k] = float(step.entropy)
            view[k + 1] = step.position_in_round
        else:
            buf[:k].copy_(step.topk(k))
            buf[k] = step.entropy
            buf[k + 1] = step.position_in_round
        i = k + 2
        if self.context:
            self._advance(step)
        values: list[float] = []
        for group in self.values_groups:
            values += group.values(step, self)
        if values:
            if view is not None:
                view[i : i + len(values)] = values
            else:
                buf[i : i + len(values)] = torch.tensor(values)
            i += len(values)
        if self.hidden:
            buf[i:].copy_(step.hidden.float())
        return buf
