"""Trace kinds: what rows a trace folder holds and how they are made, one class per kind (`trace=NAME`).

A kind is one `TraceKind` class plus `conf/trace/<name>.yaml` whose `_target_` names it and whose `kind` is the name
the folder and the manifest record (`trace_kind`). What storage and the generation job ask of it (its default for
hidden states, its checks, its folder-name and hash additions, its manifest entry, how it sets up the prompts and
makes their rows) is declared on the class, never read off its name (DESIGN.md "Trace kinds").
"""

from __future__ import annotations

from data_gen.tree_format import TREE_FORMAT
from utils import discover
from utils.cli import UserError

CONTEXT_KINDS = ("prompt", "draft", "target", "mixed")  # interleaved contexts, in equal shares by prompt order


class TraceKind:
    """A trace kind. `kind` (the yaml's) is its recorded name; the other yaml keys are its settings, read where they
    are used from the trace config (`t`) the methods get, so a kind built from a manifest's config reads the same."""

    hidden_default = False  # store_hidden when the yaml does not say
    tree = False  # rows are candidate-tree nodes, not drafted positions
    # rows follow the target's own continuation, one per drafted position, so a decoder's rounds replay on them
    # (eval.replay; greedy ones: the train job's speed rule)
    replays_rounds = False
    first_round_empty = False  # its drafter proposes nothing before the target's prefill (a replay's first round)

    def __init__(self, kind: str | None = None, **settings):
        self.name = str(kind)
        self.settings = settings

    def store_hidden(self, t) -> bool:
        return bool(t.get("store_hidden", self.hidden_default))

    def drafter(self, t) -> str:
        """Whose draft the rows record (decode.drafter's name; the manifest's `drafter`)."""
        return "student"

    def hidden_size(self, pair, t) -> int:
        """Width of `draft_hidden` when stored."""
        return int(pair.draft.config.hidden_size)

    def cost_profile(self, pair, profile, t):
        """The cost profile the rows' draft runs at (the manifest's, which replays and the speed rule price rounds
        on): the pair's, measured for its draft."""
        return profile

    def check(self, t) -> None:
        """Refuse settings this kind cannot trace (UserError), before anything is loaded or written."""

    def folder_suffix(self, t) -> str:
        """Added to the folder's decoding part: settings that change the rows and are not common to every kind."""
        return ""

    def files(self, t) -> dict:
        """Content fingerprints of files the rows depend on beyond the pair's (in the config hash: new weights at
        the same path make new traces)."""
        return {}

    def hash_extra(self) -> dict:
        """Entries of the config hash beside the common ones (a format number of the kind's own columns)."""
        return {}

    def manifest_extra(self, t) -> dict:
        return {}

    def prepare(self, items: list, encode, max_new: int) -> None:
        """Set up the prompts' items in place before tracing (`encode`: text → token ids, no special tokens)."""

    def rows(self, pair, items: list, t) -> list[dict]:
        """Column arrays per item (data_gen.store writes them), one dict per item in item order."""
        raise NotImplementedError


class TargetAR(TraceKind):
    """DISCO: the target generates the continuation; one teacher-forced draft pass gives q at every position."""

    replays_rounds = True

    def rows(self, pair, items, t):
        from data_gen.traces import chain_batch

        return chain_batch(pair, items, t, joint=False)


class Interleaved(TraceKind):
    """SPRINTER: contexts of four kinds in equal shares, draft and target stepped jointly, x ~ q at every position."""

    hidden_default = True

    def prepare(self, items, encode, max_new):
        for i, it in enumerate(items):
            it.kind = CONTEXT_KINDS[i % 4]  # equal shares, fixed by prompt order
            if it.kind != "prompt":
                continue
            ref = it.meta.get("reference")
            forced = encode(ref)[:max_new] if ref else []
            if not forced:  # no reference: the original text is the prompt's own tail
                n = min(max_new, len(it.prefix) // 2)
                if n < 1:
                    it.kind = "target"
                    continue
                it.prefix, forced = it.prefix[:-n], it.prefix[-n:]
            it.forced = forced

    def rows(self, pair, items, t):
        from data_gen.traces import chain_batch

        return chain_batch(pair, items, t, joint=True)


class Tree(TraceKind):
    """Token trees (issue 30): along the target's greedy continuation the draft grows a candidate tree per position."""

    tree = True

    def check(self, t):
        if float(t.get("temperature", 0.0)) != 0.0:
            raise UserError(f"trace={self.name} records greedy labels (on_path) only; set trace.temperature=0")
        if bool(t.get("store_hidden", False)):
            raise UserError("trace=tree stores no hidden states yet; set trace.store_hidden=false")
        for name in ("tree_topk", "tree_depth", "stride"):
            if int(t.get(name, 1)) < 1:
                raise UserError(f"trace.{name} must be >= 1, got {t.get(name)}")

    def folder_suffix(self, t):  # the candidate trees' bounds: two tree traces of one pair differ by them
        stride = int(t.get("stride", 1))
        return f"-w{int(t.get('tree_topk', 4))}-d{int(t.get('tree_depth', 5))}" + (f"-st{stride}" if stride != 1 else "")

    def hash_extra(self):
        return {"tree_format": TREE_FORMAT}

    def manifest_extra(self, t):  # the candidate trees' bounds (models.tree.TopkExpander) and the positions' spacing
        return {"tree": {"topk": int(t.get("tree_topk", 4)), "depth": int(t.get("tree_depth", 5)),
                         "stride": int(t.get("stride", 1))}}

    def rows(self, pair, items, t):
        from data_gen.traces import tree_batch

        return tree_batch(pair, items, t)


class _Eagle:
    """What both EAGLE-3 kinds share: the draft's weights (`trace.weights`, their content in the config hash), the
    drafter the manifest names, and EAGLE-3's own step as the rows' cost profile (as decode prices its rounds)."""

    first_round_empty = True  # the draft reads the target's features: none exist before its prefill

    @staticmethod
    def weights(t):
        from data_gen.eagle_traces import weights_path

        return weights_path(t)

    def check_weights(self, t):
        if t.get("weights") is None:
            raise UserError("trace.weights is null and the pair names no EAGLE-3 draft (pair.eagle3.weights); pass "
                            "trace.weights=PATH or train one with python -m train.eagle")
        if not self.weights(t).is_file():
            raise UserError(f"trace.weights={t.get('weights')} is not a file; train an EAGLE-3 draft with "
                            "python -m train.eagle")

    def files(self, t):
        from models.pair import file_fingerprint

        path = self.weights(t)
        return {"weights": file_fingerprint(path)} if path.is_file() else {}

    def drafter(self, t):
        return "eagle3"

    def cost_profile(self, pair, profile, t):
        from models.eagle3_pair import draft_profile, load_for_pair
        from models.lm import LM

        model, path = load_for_pair(pair, t.weights, "pair")
        return draft_profile(model, path, profile, LM.of(pair, "target"))


class EagleChain(_Eagle, TraceKind):
    """EAGLE-3's chains (issue 53): along the target's greedy continuation, the chain a round starting at each
    position drafts, one row per step (data_gen.eagle_traces)."""

    hidden_default = True
    replays_rounds = True

    def check(self, t):
        if float(t.get("temperature", 0.0)) != 0.0:
            raise UserError("trace=eagle_chain records greedy rounds only; set trace.temperature=0")
        self.check_weights(t)
        if int(t.get("steps", 8)) < 1:
            raise UserError(f"trace.steps must be >= 1, got {t.get('steps')}")

    def folder_suffix(self, t):
        return f"-K{int(t.get('steps', 8))}"

    def manifest_extra(self, t):
        return {"eagle": {"weights": str(t.get("weights")), "steps": int(t.get("steps", 8))}}

    def hidden_size(self, pair, t):  # the layer's output and the fused target feature, side by side
        return 2 * int(pair.target.config.hidden_size)

    def rows(self, pair, items, t):
        from data_gen.eagle_traces import eagle_batch

        return eagle_batch(pair, items, t)


class EagleTree(_Eagle, Tree):
    """EAGLE-3's candidate trees (issue 53): trace=tree's rows, grown by the EAGLE-3 draft as decode's eagle3_tree
    grows them (data_gen.eagle_traces.eagle_tree_batch); its node heads run on eagle3 only."""

    def check(self, t):
        Tree.check(self, t)  # greedy only, and the trees' bounds
        self.check_weights(t)

    def manifest_extra(self, t):
        return {**Tree.manifest_extra(self, t), "eagle": {"weights": str(t.get("weights"))}}

    def rows(self, pair, items, t):
        from data_gen.eagle_traces import eagle_tree_batch

        return eagle_tree_batch(pair, items, t)


def manifest_kind(manifest: dict) -> TraceKind | None:
    """The kind a trace folder's manifest records (its config's trace settings, by `kind`); None when it records
    none (traces assembled in memory)."""
    t = (manifest.get("config") or {}).get("trace") or {"kind": manifest.get("trace_kind")}
    return trace_kind(t) if t.get("kind") is not None else None


def greedy_rounds(manifest: dict) -> bool:
    """Whether a trace folder holds rows a decoder's rounds replay on (eval.replay, the train job's speed rule): a
    kind whose rows follow the target's own continuation (`replays_rounds`), traced greedily."""
    kind, temp = manifest_kind(manifest), manifest.get("temperature")
    return kind is not None and kind.replays_rounds and temp is not None and float(temp) == 0.0


def trace_kind(t) -> TraceKind:
    """The kind a trace config describes, built from its `_target_`; a config without one (a manifest's, from
    before the key) is looked up by `kind` in conf/trace."""
    return discover.build("trace", t, TraceKind, "kind", f"trace kind '{dict(t or {}).get('kind')}'")
