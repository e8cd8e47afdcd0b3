"""One definition each: top-k and entropy of a draft distribution on its support (DraftStep and models.tree.Tree.stats),
the verification statistics (decode's loop from logits or p, the replay's continuations, the trace columns, a tree's
root) and path composition (whole trees and level by level)."""

from __future__ import annotations

import numpy as np
import torch


def _q(vocab=300, support=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[:support].sort().values
    q = torch.zeros(vocab)
    q[ids] = torch.softmax(torch.randn(support, generator=g) * 3, -1)
    return q, ids


def test_draftstep_and_tree_stats_agree_on_a_support():
    from models.features.signals import DraftStep
    from models.tree import Tree

    for support_size, k in ((40, 10), (6, 10), (40, 4)):  # 6 < k: the zeros off the support fill the tail
        q, ids = _q(support=support_size, seed=support_size + k)
        for support in (ids, None):
            step = DraftStep(probs=q, token=0, hidden=None, position_in_round=0, position=0, support=support)
            tree = Tree(root_q=q, support=support)
            v, tok, ent = tree.stats(-1, k)
            assert torch.equal(step.topk(k), v) and torch.equal(step.entropy, ent)
            assert torch.equal(q[tok], v)


def test_verify_stats_live_replay_and_trace_agree():
    from decode.lm_drafters import verify_stats as _verify_stats
    from eval.continuations import Continuation
    from models.distributions import entropy, top2_margin, tvd
    from models.features.trace import verify_columns

    g = torch.Generator().manual_seed(1)
    V, k, n = 50, 4, 2  # drafted 4, kept 2: rows 0..2 compared, H_p and margin at row 2
    z = torch.randn(k + 1, V, generator=g) * 2
    p = torch.softmax(z, -1)
    qs = [torch.softmax(torch.randn(V, generator=g), -1) for _ in range(k)]
    greedy = _verify_stats(None, z, qs, None, k, n)  # from the logits (greedy verification)
    sampled = _verify_stats(p, z, qs, None, k, n)  # from p
    rows = dict(target_entropy=entropy(p).numpy(), target_margin=top2_margin(p).numpy(),
                tvd=tvd(p[:k], torch.stack(qs)).numpy())
    cont = Continuation(None, None, None, np.zeros(k), np.zeros(k), **rows)
    replayed = cont.verify_stats(0, k, n)
    for a in (greedy, sampled):
        np.testing.assert_allclose(a.values(), replayed.values(), rtol=1e-5, atol=1e-6)
    assert replayed.values()[2:4] == [2.0, 0.0] and replayed.mean_tvd == float(rows["tvd"][:3].mean())

    # a trace: rows 0..2 are a round rejected at row 2 (kept 2), row 3 starts the next round, which reads them
    cols = {"position": np.arange(4), "prompt_id": np.zeros(4), "draft_token": np.array([1, 1, 1, 1]),
            "target_token": np.array([1, 1, 2, 1]), **{c: np.append(v[:3], 0) for c, v in rows.items()}}
    trace = verify_columns(cols)
    np.testing.assert_allclose(trace[3], replayed_for(cont, rows), rtol=1e-6)
    assert (trace[:3] == 0).all()  # no verification before the first round


def replayed_for(cont, rows):
    """The replay's numbers for the round that drafted 3 and kept 2 (what a trace's rejected round is)."""
    return cont.verify_stats(0, 3, 2).values()


def test_tree_root_stats_is_the_chain_definition():
    from decode.tree import root_stats
    from models.distributions import draft_probs, entropy, top2_margin

    class S:
        greedy, temperature, top_p = True, 0.0, 1.0

    z = torch.randn(80, generator=torch.Generator().manual_seed(3))
    p = torch.softmax(z, -1)
    np.testing.assert_allclose(root_stats(z, S), (float(entropy(p)), float(top2_margin(p))), rtol=1e-5)
    S.greedy, S.temperature, S.top_p = False, 0.7, 0.9
    p = draft_probs(z, 0.7, 0.9)
    assert root_stats(z, S) == (float(entropy(p)), float(top2_margin(p)))


def test_compose_path_level_by_level_equals_whole_tree():
    from models.features.nodes import compose_path

    parents = [-1, -1, 0, 0, 2, 1, 4]
    scores = [0.9, 0.5, 0.8, 0.3, 0.7, 0.6, 0.95]
    for how in ("product", "min"):
        whole = compose_path(scores, parents, how)
        part = compose_path(scores[:4], parents[:4], how)
        assert np.array_equal(compose_path(scores, parents, how, part), whole)
        assert whole[6] == (0.9 * 0.8 * 0.7 * 0.95 if how == "product" else 0.7)
