"""What a `tree` trace stores besides the shared columns: its per-node columns and its format number.

Below storage (data_gen.store writes them), generation (data_gen.traces makes them) and the kind (data_gen.kinds
hashes the format), so none of the three imports another for them.
"""

# the per-node columns of a `tree` trace besides prompt_id, split, kind, position and draft_topk (data_gen.traces);
# root_target_* and copy_len .. lookup_len (models.tree.NODE_GROUP_COLUMNS, read by tree_node_plus) since TREE_FORMAT 2
TREE_COLUMNS = ("node", "parent", "depth", "rank", "token", "q_token", "joint", "draft_entropy", "root_target_entropy",
                "root_target_margin", "copy_len", "lookup_hit", "lookup_len", "on_path", "length")
# the tree traces' own format, in their config hash: a bump makes folders of an older one "another config" (refused
# in one line, `overwrite=true` regenerates) rather than mixed with new ones. 2: the verify and copy node columns
TREE_FORMAT = 2
