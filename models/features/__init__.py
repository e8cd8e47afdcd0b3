"""Draft-side features: the one definition data_gen stores and decode computes, so a head sees the same inputs.

Import each name from the module that owns it:
- layout: the column names and widths of the groups (DEFAULT_TOPK, VERIFY, COPY, ...); a leaf, models.tree reads it;
- signals: what a policy sees per drafted token (DraftStep) and what the last verification told (VerifyStats);
- context: the n-gram index of a growing context (ContextIndex) the copy groups read;
- text: the text group's token classes and line position;
- trace: trace columns → continuations, draft rounds and the chain groups' values per row;
- groups: feature groups, one class + one yaml each (conf/feature_group, conf/node_group);
- kind: the FeatureKind base every kind derives from;
- chain: the chain kinds (disco, hidden, disco_plus) and their decode-time row builders;
- nodes: token-tree node features: node_columns, the node groups and kinds (c2t, tree_node, tree_node_plus);
- spec: FeatureSpec (what a head reads, stored in its checkpoint) and the kinds by name.
The distribution math these rest on (softmax, top-k, entropy, TVD) is models.distributions.
"""
