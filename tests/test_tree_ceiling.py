"""models.tree_dp (Sequoia's static-tree DP) against brute force, and `python -m eval.tree_ceiling` end to end."""

from __future__ import annotations

import json
import random

import pytest

from omegaconf import OmegaConf

from eval.tree_ceiling import check, speedup
from models.cost import CostProfile
from models.tree_dp import TreeTable, best_static_tree, chain, run_levels, score_tree
from utils.cli import UserError

NEG = float("-inf")


def brute_force(p: list[float], n_max: int) -> dict[tuple[int, int], float]:
    """{(n, depth): best expected accepted} over every tree of ≤ n_max nodes (each node's parent any earlier node or
    the root, its rank any one its siblings do not use), scored by score_tree."""
    best: dict[tuple[int, int], float] = {}

    def grow(parents: list[int], ranks: list[int], depths: list[int]) -> None:
        if parents:
            key = (len(parents), max(depths))
            best[key] = max(best.get(key, NEG), score_tree(p, parents, ranks))
        if len(parents) == n_max:
            return
        for par in range(-1, len(parents)):
            used = {r for q, r in zip(parents, ranks) if q == par}
            for r in range(1, len(p) + 1):
                if r not in used:
                    grow(parents + [par], ranks + [r], depths + [1 if par < 0 else depths[par] + 1])

    grow([], [], [])
    return best


@pytest.mark.parametrize("seed,n_max,n_ranks", [(0, 6, 2), (1, 5, 3), (2, 4, 4), (3, 6, 3)])
def test_dp_equals_brute_force(seed, n_max, n_ranks):
    rng = random.Random(seed)
    raw = sorted((rng.random() for _ in range(n_ranks)), reverse=seed != 1)  # seed 1: increasing, skipping pays
    p = [x / (sum(raw) * 1.25) for x in raw]
    bf = brute_force(p, n_max)
    table = TreeTable(p, n_max)
    for n in range(1, n_max + 1):
        for d in range(1, n + 1):
            want = max((v for (m, e), v in bf.items() if m == n and e <= d), default=NEG)
            assert table.value(n, d) == pytest.approx(want, abs=1e-12), (n, d)
            if want > NEG:
                t = table.tree(n, d)
                assert len(t.parents) == n and t.depth <= d
                assert score_tree(p, t.parents, t.ranks) == pytest.approx(want, abs=1e-12)


def test_certain_rank_one_gives_a_chain():
    for n in (1, 4, 9):
        t = best_static_tree([1.0, 0.0, 0.0], n)
        assert t.expected_accepted == pytest.approx(n) and (t.parents, t.ranks) == chain(n) and t.depth == n


def test_score_tree_refuses_bad_trees():
    with pytest.raises(ValueError):
        score_tree([0.5, 0.2], [-1, -1], [1, 1])  # two rank-1 siblings
    with pytest.raises(ValueError):
        score_tree([0.5, 0.2], [1, -1], [1, 1])  # a parent after its child
    with pytest.raises(ValueError):
        best_static_tree([0.5, 0.5], 3, max_depth=1)  # three nodes need three ranks at depth 1


COSTS = CostProfile(key={}, draft_ms=[1.0], target_ms=[10.0] * 20, prefill_lengths=[1], prefill_target_ms=[10.0],
                    prefill_draft_ms=[1.0], context=1, repeats=1, draft_cold_ms=1.0)


def test_high_p1_chain_wins_and_flat_ranks_go_wide():
    p = [0.9] + [0.0] * 7
    for n in (2, 5, 8):
        t = best_static_tree(p, n)
        assert (t.parents, t.ranks) == chain(n)
    flat_p = [0.1] * 8
    k_best = max(range(1, 9), key=lambda k: speedup(score_tree(flat_p, *chain(k)), k, None, COSTS, True, calls=k))
    chain_s = speedup(score_tree(flat_p, *chain(k_best)), k_best, None, COSTS, True, calls=k_best)
    table = TreeTable(flat_p, 16)
    tree_s = max(speedup(table.tree(n, d).expected_accepted, n, run_levels(table.tree(n, d).parents), COSTS, True)
                 for n in range(1, 17) for d in range(1, n + 1) if table.value(n, d) > NEG)
    assert tree_s > 1.2 * chain_s
    wide = table.tree(8, 1)
    assert wide.depth == 1 and sorted(wide.ranks) == list(range(1, 9))
    # without tree curves a tree round costs what the chain's does, and the chains are static trees: never below
    from eval.tree_ceiling import analyse

    res = analyse({"rank_vector": [0.6, 0.1, 0.05, 0.02]}, COSTS, 8)
    assert res["static_tree_vs_chain"] >= 1 - 1e-9 and res["static_tree_vs_chain_flat"] >= 1 - 1e-9
    # dear level calls and tree passes: the same trees against the same chains fall below
    dear = CostProfile(**{**COSTS.__dict__, "draft_level_ms": [3.0] * 8, "target_tree_ms": [14.0] * 20})
    assert analyse({"rank_vector": [0.6, 0.1, 0.05, 0.02]}, dear, 8)["static_tree_vs_chain"] < 1


def test_command_on_the_tiny_pair(cli, tmp_path):
    out = tmp_path / "trees"
    r = cli("eval.tree_ceiling", "pair=tiny_random", "prompts=2", "tokens=8", "max_rank=4", "max_nodes=6",
            f"+pair.cache_dir={tmp_path}/cache", "profile.max_n=3", "profile.repeats=1", "profile.warmup=0",
            "profile.context=16", "profile.prefill_lengths=[8]", f"out_dir={out}", f"hydra.run.dir={tmp_path}/run")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "ceiling.json").read_text())
    for key in ("rank_vector", "beyond", "profile", "sizes", "static_tree_vs_chain", "static_tree_vs_chain_flat",
                "command", "pair", "dtype", "machine", "date_utc"):
        assert key in res, key
    assert len(res["rank_vector"]) == 4 and sum(res["rank_vector"]) + res["beyond"] == pytest.approx(1.0)
    assert [row["n"] for row in res["sizes"]] == list(range(1, 7)) and res["profile"]["extrapolated"]
    # a measured profile prices tree rounds by its tree curves, so a chain-shaped tree may trail the chain loop
    assert 0 < res["static_tree_vs_chain"] and 0 < res["static_tree_vs_chain_flat"]
    assert "| n | E |" in (out / "ceiling.md").read_text()


def test_bad_settings_are_one_line():
    with pytest.raises(UserError, match="max_nodes must be a positive integer"):
        check(OmegaConf.create({"prompts": 2, "tokens": 8, "max_rank": 4, "max_nodes": 0}))
