"""What a head reads (`FeatureSpec`, stored in its checkpoint) and the feature kinds by name: the one entry point the
stages ask for a head's columns, trace columns and decode-time needs."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from models.features import chain, nodes  # noqa: F401  (defines the shipped kinds `feature_kinds` finds)
from models.features.kind import FeatureKind
from models.features.layout import DEFAULT_TOPK, GROUPS, TOKEN
from models.features.text import unpack_classes


@dataclass(frozen=True)
class FeatureSpec:
    """What a head reads; stored in its checkpoint and checked by decode/eval against the pair and traces.

    kind: the name of a `FeatureKind` — `disco` (top-k + entropy + position), `hidden` (the draft's last hidden state
    of size d) or `disco_plus` (the DISCO inputs followed by the chosen `groups`, in their order:
    models.features.groups; `hidden` there appends d values). What differs between kinds is the kind class's business
    (`family`); the spec only holds the numbers, so a checkpoint stores plain values.
    """

    kind: str
    k: int = DEFAULT_TOPK
    d: int = 0
    groups: tuple = ()
    text_classes: str = ""  # `text` group: the tokenizer's `token_classes`, packed (`pack_classes`)

    def __post_init__(self):
        from models.features.groups import group_names, resolve

        names = tuple(self.groups or ())
        kind = feature_kinds().get(self.kind)
        if names and kind is not None and not kind.grouped:
            raise ValueError(f"a {self.kind} head takes the groups none, not {list(names)}")
        folder = kind.group_folder if kind is not None else FeatureKind.group_folder
        try:
            found = resolve(folder, names)
        except ValueError:
            if kind is None:
                raise
            known = group_names(folder)  # named, not built: a broken yaml must not hide this message
            takes = ", ".join([g for g in GROUPS if g in known] + sorted(set(known) - set(GROUPS)))
            raise ValueError(f"a {self.kind} head takes the groups {takes}, not {list(names)}") from None
        object.__setattr__(self, "groups", tuple(g.name for g in found))
        if any(g.needs_classes for g in found) and not self.text_classes:
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


def needed_columns(spec: FeatureSpec) -> tuple[str, ...]:
    """The trace columns `features_from_columns` reads for a spec (its kind's `columns`)."""
    return spec.family.columns(spec)



def features_from_columns(columns: dict, spec: FeatureSpec) -> torch.Tensor:
    """Head input (N, spec.dim) float32 from trace columns (a dict of arrays), the same vector decode builds per step
    (its kind's `from_columns`)."""
    return spec.family.from_columns(columns, spec)

