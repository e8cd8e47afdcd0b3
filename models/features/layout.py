"""The column names and widths of the feature groups: a leaf module, so models.tree and every features module read
one definition without importing each other."""

DEFAULT_TOPK = 10

# disco_plus: the DISCO inputs plus groups of signals a decoder has for free (models.features.groups)
GROUPS = ("verify", "copy", "token", "text", "hidden")  # the shipped groups, in their column order
VERIFY = ("target_entropy", "target_margin", "last_accepted", "last_all_accepted", "last_mean_tvd")
COPY = ("copy_len", "lookup_hit", "lookup_len")
TOKEN = ("draft_token_id", "prev_token_id")
CLASSES = ("space", "newline", "digit", "alpha", "punct", "chars")  # per token id, models.features.text
TEXT = (*(f"draft_{c}" for c in CLASSES), *(f"prev_{c}" for c in CLASSES), "line_position")
COPY_MAX = 8  # longest n-gram continuation counted by copy_len
LOOKUP_N = 3  # prompt lookup matches the context's last 3, 2 or 1 tokens (transformers' prompt lookup uses 2-3)
# tree_node_plus's verify group as tree traces store it, per node: H_p and the top-2 margin of the target's
# distribution at the position before the tree's root (models.features.nodes.node_columns, `Tree.verify`)
NODE_VERIFY = ("root_target_entropy", "root_target_margin")
NO_VERIFY = [0.0, 0.0, 0.0, 0.0, 0.0]  # the first round of a continuation has no verification before it
# the trace columns every chain row's round position reads (models.features.trace.trace_round_positions)
ROUND_COLUMNS = ("draft_token", "target_token", "position", "prompt_id", "kind")
# ... and, where a trace has them (eagle_chain: each row's round is explicit), its round's start and step: read
# when present (the loaders skip the columns a trace lacks), never required
CHAIN_COLUMNS = ("start", "step")


def hidden_names(d: int) -> list[str]:
    """The columns of a hidden state of size d (the `hidden` kind and disco_plus's `hidden` group)."""
    return [f"h{i}" for i in range(d)]
