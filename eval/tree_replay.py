"""Replay token-tree builders on `tree` traces under the cost model: what each tree would gain, without decoding.

    python -m eval.tree_replay traces=FOLDER ['policies=[tree_static,sequoia,eagle2]'] [prompts=500] out_dir=DIR

A `tree` trace (python -m data_gen trace=tree) holds, at every position t of the target's greedy continuation y, the
candidate tree the draft grows there (EAGLE-2's expansion, models.tree.TopkExpander) with each node's greedy label
`on_path` (its root path is y[t : t + depth]). Greedy decoding stays on y, so a round at t is replayed noise-free:
the builder picks nodes from the recorded tree (`pick`, decode.tree_builders), the accepted length is the deepest
on-path picked node (its ancestors are picked: picks are ancestor-closed, and checked), the round emits accepted + 1
tokens and t advances by that (decode.loop's own `rounds`: the recorded trees stand in for the draft,
`CandidateTrees`, and their on-path labels for the target, `OnPath`). Builders: `policies` (the tree builders of conf/policy/, built as decode builds them,
sized on the trace's cost profile) and the chains `chain_K` (K rank-1 nodes, the width-1 tree = greedy chain
drafting of K tokens) for K = 1 .. the trace depth and `chain_ev` (the expected-value stop rule's chain), so the best
tree is compared with the best chain (`best_tree_vs_chain`).

Agreement with decode: eagle2 with the trace's top-k picks exactly decode's nodes, so its rounds are decode's up to
draft numerics (decode's draft cache is built round by round, the trace's position by position: near-tied joints can
order differently); a static shape's nodes the trace lacks (an unexpanded parent, a rank past the trace's top-k) are
paid for and never accepted (a lower bound on its τ). Time is the cost model (`CostProfile.round_steps`): a tree
round costs its root draft call (the profile's cold cost when it has one), one draft call per level it ran on (priced
by the nodes it ran on) and a tree-attention pass over nodes + 1; the chains `chain_*` are priced as decode's chain
loop runs them (one-token draft calls, a causal pass); against one target step per token (prefills excluded on both
sides). A trace's profile measured before the tree curves prices tree rounds as chains. Intervals: 95% bootstrap
over prompts (utils.stats), paired across builders.
Writes tree_replay.json, tree_replay.md and speedup.png (each builder's cost-model speedup with its interval).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf import DictConfig
from tqdm.auto import tqdm

from data_gen.kinds import manifest_kind
from decode.drafter import Drafter, Sampling, TreeProposal, Verdict
from decode.loop import GenResult, rounds
from models.cost import CostProfile
from models.tree import Tree
from utils.cli import UserError, command, hydra_entry, output_dir
from utils.files import write_text_atomic

COLUMNS = ["prompt_id", "position", "node", "parent", "depth", "rank", "token", "joint", "on_path", "length"]
METRICS = ("tau", "nodes", "levels", "speedup")


@dataclass
class Candidates:
    """One prompt's recorded trees: `trees[t]` and `on_path[t]` at every position t of its continuation of length n;
    `rows[t]`: the trace rows of tree t's nodes (where a learned builder's head scores are read)."""

    prompt_id: str
    n: int
    trees: list[Tree]
    on_path: list[np.ndarray]
    rows: list[np.ndarray]
    first_empty: bool = False  # the drafter proposes nothing before the target's prefill (EAGLE-3: decode.eagle3)


def check_trace(manifest: dict, folder) -> dict:
    """The trace's tree settings; anything but a greedy stride-1 `tree` trace refused in one line."""
    tree = manifest.get("tree") or {}
    kind = manifest_kind(manifest)
    if kind is None or not kind.tree:
        raise UserError(f"{folder} holds {manifest.get('trace_kind')} traces; this needs tree traces "
                        "(python -m data_gen trace=tree split=... limit=...)")
    if int(tree.get("stride", 1)) != 1:
        raise UserError(f"{folder} has a tree every {tree['stride']} positions; the replay lands on every position: "
                        "make the traces with trace.stride=1")
    return tree


def candidates_from_columns(cols: dict, prompts: int | None = None) -> list[Candidates]:
    """Columns of a tree trace (any row order) as per-prompt candidate trees, prompts in order of first appearance."""
    pids = np.asarray(cols["prompt_id"])
    _, first = np.unique(pids, return_index=True)
    order_ids = [pids[i] for i in sorted(first)][: prompts if prompts else None]
    out = []
    for pid in order_ids:
        idx = np.flatnonzero(pids == pid)
        idx = idx[np.lexsort((cols["node"][idx], cols["position"][idx]))]
        n = int(cols["length"][idx[0]])
        trees: list[Tree | None] = [None] * n
        on: list[np.ndarray | None] = [None] * n
        rows: list[np.ndarray | None] = [None] * n
        pos = cols["position"][idx]
        for t in range(n):
            sel = idx[pos == t]
            if len(sel) == 0:
                raise UserError(f"prompt {pid} has no candidate tree at position {t}; regenerate the trace (stride=1)")
            trees[t] = Tree(root_q=None, tokens=cols["token"][sel].tolist(), parents=cols["parent"][sel].tolist(),
                            depth=cols["depth"][sel].tolist(), joint=cols["joint"][sel].astype(float).tolist(),
                            rank=cols["rank"][sel].tolist())
            on[t] = cols["on_path"][sel].astype(bool)
            rows[t] = sel
        out.append(Candidates(str(pid), n, trees, on, rows))
    return out


def accepted(tree: Tree, on_path: np.ndarray, picked: list[int]) -> int:
    """The depth of the deepest on-path picked node whose ancestors are all picked (0: none)."""
    chosen, best = set(picked), 0
    for node in picked:
        if not on_path[node] or tree.depth[node] <= best:
            continue
        cur = tree.parents[node]
        while cur >= 0 and cur in chosen:
            cur = tree.parents[cur]
        if cur < 0:
            best = tree.depth[node]
    return best


class CandidateTrees(Drafter):
    """A prompt's recorded candidate trees as a drafter: at position t the builder picks nodes of tree t (`pick`:
    decode.tree_builders), and the round's draft calls and verified nodes are what decode would run
    (`replay_cost`), priced by the profile as a tree round (a chain of `chains` as the chain loop runs it)."""

    name = "candidate_trees"

    def __init__(self, builder, cand: Candidates, profile):
        super().__init__(builder)
        self.cand, self.profile = cand, profile

    def start(self, prompt_ids, s, lookahead=None) -> None:
        self.t, self.cost = 0, 0.0
        self.record = {"tokens": [], "accepted": [], "nodes": [], "levels": []}

    def propose(self, budget: int, res) -> TreeProposal:
        tree = self.cand.trees[self.t]
        if self.cand.first_empty and res.target_calls == 0:  # the first round: the target's prefill alone
            self.levels, self.nodes, self.calls = [], 0, 0
            return TreeProposal(tree, 0, [])
        picked = self.policy.pick(tree)
        self.levels, self.nodes = self.policy.replay_cost(tree, picked)
        self.calls = 1 + len(self.levels)
        return TreeProposal(tree, 0, picked)

    def commit(self, v: Verdict, res) -> None:
        b, emit = self.policy, min(len(v.kept) + 1, self.cand.n - self.t)
        for key, x in zip(self.record, (emit, len(v.kept), self.nodes, self.calls)):  # levels: draft calls
            self.record[key].append(x)
        self.cost += self.profile.round_steps(self.calls, self.nodes, None if b.chain_loop else self.levels)
        self.t += emit


class OnPath:
    """The target of a tree trace: a round accepts the deepest on-path picked node whose ancestors are picked."""

    def __init__(self, cand: Candidates):
        self.cand, self.t = cand, 0

    def verify(self, proposal: TreeProposal, s, res) -> Verdict:
        tree, t = proposal.tree, self.t
        acc = accepted(tree, self.cand.on_path[t], proposal.nodes)
        self.t = t + acc + 1
        res.target_calls += 1
        return Verdict([], [0] * acc, 0, len(proposal.nodes), None, None, None, proposal=proposal)


def replay_prompt(builder, cand: Candidates, profile) -> dict:
    """Greedy rounds along y, in decode.loop's own `rounds`; returns per-round lists (tokens emitted, accepted,
    nodes, levels) and the cost."""
    drafter = CandidateTrees(builder, cand, profile)
    drafter.start([], Sampling())
    rounds(drafter, OnPath(cand), Sampling(), cand.n, GenResult(tokens=[]))
    return {**drafter.record, "cost": drafter.cost}


def chains(depth: int, profile) -> dict:
    """The width-1 trees: K rank-1 nodes (greedy chain drafting of K tokens) for K = 1 .. depth, and `chain_ev`, the
    rank-1 chain under the expected-value stop rule (`expected_value` with a=1, b=0: a one-node Sequoia shape whose
    spine runs to `depth`, drafted while the next token pays), the adaptive chain the cost-aware builders contain."""
    from decode.tree_builders import Sequoia, TreeStatic

    out = {f"chain_{k}": TreeStatic(branching=[1] * k, max_depth=k, profile=profile) for k in range(1, depth + 1)}
    out["chain_ev"] = Sequoia(rank_probs=[1.0], max_nodes=1, max_depth=1, spine_depth=depth, profile=profile)
    for b in out.values():  # decode drafts these in its chain loop: one-token draft calls, a causal pass
        b.chain_loop = True
    return out


def builders(cfg: DictConfig, tree: dict, profile) -> tuple[dict, dict]:
    """The listed tree builders as decode builds them (conf/policy + policy.* overrides, sized on `profile`), plus
    notes on settings the trace bounds; non-tree policies refused."""
    from decode.methods import methods_from_cfg
    from decode.policies import build_policy

    out, notes = {}, {}
    for m in methods_from_cfg(cfg):
        if not m.policy_class.tree:
            raise UserError(f"{m.key} is not a token-tree builder; list tree builders (tree_static, sequoia, eagle2, "
                            "c2t:CKPT, learned_tree:CKPT) "
                            "or replay chain policies with python -m eval.replay")
        b = build_policy(m.spec, m.params, profile=profile, target=m.target)
        if hasattr(b, "topk") and int(b.topk) != int(tree.get("topk", 4)):
            raise UserError(f"{m.key} expands the top {b.topk} but the trace's trees the top {tree.get('topk')}; pass "
                            f"policy.{m.key}.topk={tree.get('topk')} or make traces with trace.tree_topk={b.topk}")
        if hasattr(b, "topk") and b.max_depth > int(tree.get("depth", 5)):
            notes[m.key] = f"max_depth {b.max_depth} capped at the trace depth {tree['depth']}"
            b.max_depth = b.max_len = int(tree["depth"])
        out[m.key] = b
    return out, notes


def head_scores(builder, ds, manifest: dict, folder) -> np.ndarray | None:
    """A learned builder's head P(on path) for every trace row (None for the others): the head reads the rows'
    stored node columns, the ones decode computes from its tree (models.features.nodes.node_columns)."""
    bundle = getattr(builder, "bundle", None)
    if bundle is None:
        return None
    from data_gen.contract import trace_columns

    if bundle.pair_id != manifest.get("pair_id"):
        raise UserError(f"{builder.name}'s head ({bundle.path}) was trained on pair {bundle.pair_id} but {folder} "
                        f"holds traces of {manifest.get('pair_id')}; replay it on its own pair's traces")
    drafter = manifest.get("drafter", "student")
    if bundle.drafter != drafter:
        raise UserError(f"{builder.name}'s head ({bundle.path}) was trained on {bundle.drafter}'s trees but {folder} "
                        f"holds {drafter}'s; replay it on its own drafter's traces")
    kind = builder.kind
    x = kind.from_columns(trace_columns(ds, list(kind.columns(bundle.spec))), bundle.spec)
    return bundle.prob(x).reshape(-1).double().cpu().numpy()


def replay(builder, cands: list[Candidates], profile, scores: np.ndarray | None, desc: str) -> list[dict]:
    """replay_prompt over the prompts; a learned builder's trees carry its head's scores while it runs."""
    out = []
    for c in tqdm(cands, desc=desc, leave=False):
        for tree, rows in zip(c.trees, c.rows):
            tree.score = [] if scores is None else scores[rows].tolist()
        out.append(replay_prompt(builder, c, profile))
    for c in cands:
        for tree in c.trees:
            tree.score = []
    return out


def prompt_sums(reps: list[dict]) -> dict[str, np.ndarray]:
    """One builder's replay as per-prompt sums (tokens, rounds, nodes, levels, cost): what a bootstrap over prompts
    resamples, every ratio of sums recomputed from them."""
    out = {name: np.array([sum(r[name]) for r in reps], dtype=float) for name in ("tokens", "nodes", "levels")}
    out["rounds"] = np.array([len(r["tokens"]) for r in reps], dtype=float)
    out["cost"] = np.array([r["cost"] for r in reps], dtype=float)
    return out


def summarize(per: dict[str, list[dict]], resamples: int) -> dict:
    """Per builder: τ, verified nodes and draft levels per round, cost-model speedup (ratios of sums over prompts)
    with paired 95% bootstrap intervals; the best chain and `best_tree_vs_chain`."""
    from utils.stats import bootstrap_ci

    keys = list(per)
    each = [prompt_sums(per[k]) for k in keys]
    sums = {name: np.stack([e[name] for e in each]) for name in ("tokens", "nodes", "levels")}
    rounds, cost = np.stack([e["rounds"] for e in each]), np.stack([e["cost"] for e in each])
    num = {"tau": sums["tokens"], "nodes": sums["nodes"], "levels": sums["levels"], "speedup": sums["tokens"]}
    den = {"tau": rounds, "nodes": rounds, "levels": rounds, "speedup": cost}
    point = {m: num[m].sum(-1) / den[m].sum(-1) for m in METRICS}
    chain_keys = [k for k in keys if k.startswith("chain_")]
    tree_keys = [k for k in keys if not k.startswith("chain_")]
    best_chain = max(chain_keys, key=lambda k: point["speedup"][keys.index(k)]) if chain_keys else None
    best_tree = max(tree_keys, key=lambda k: point["speedup"][keys.index(k)]) if tree_keys else None

    def stat(idx, axis=-1):
        rows = [num[m][:, idx].sum(-1) / den[m][:, idx].sum(-1) for m in METRICS]
        if best_chain and best_tree:
            sp = rows[METRICS.index("speedup")]
            rows.append((sp[keys.index(best_tree)] / sp[keys.index(best_chain)])[None])
        return np.concatenate(rows, axis=0)

    n = rounds.shape[1]
    ci = bootstrap_ci(n, stat, n_resamples=resamples, method="percentile") if n > 1 else None
    table = {}
    for i, k in enumerate(keys):
        table[k] = {"prompts": n, "tokens": int(sums["tokens"][i].sum()), "rounds": int(rounds[i].sum())}
        for j, m in enumerate(METRICS):
            table[k][m] = float(point[m][i])
            table[k][f"{m}_ci"] = ci[j * len(keys) + i] if ci else None
    out = {"builders": table, "best_chain": best_chain, "best_tree": best_tree}
    if best_chain and best_tree:
        ratio = table[best_tree]["speedup"] / table[best_chain]["speedup"]
        out["best_tree_vs_chain"] = {"value": ratio, "ci": ci[-1] if ci else None}
    return out


def markdown(res: dict) -> str:
    s = res["settings"]
    fmt = lambda v, c: f"{v:.3f}" + (f" [{c[0]:.3f}, {c[1]:.3f}]" if c else "")  # noqa: E731
    lines = [f"# Tree replay: {s['pair']}, {s['prompts']} prompts of {s['traces']}", "",
             f"Greedy, noise-free (eval/tree_replay.py); trees of top-{s['tree']['topk']} to depth "
             f"{s['tree']['depth']}; cost profile c = {s['c']:.3f}. 95% bootstrap intervals over prompts.", "",
             "| builder | τ (tokens/round) | verified nodes/round | draft levels/round | cost-model speedup |",
             "|---|---|---|---|---|"]
    for k, r in res["builders"].items():
        lines.append(f"| {k} | " + " | ".join(fmt(r[m], r[f"{m}_ci"]) for m in METRICS) + " |")
    if "best_tree_vs_chain" in res:
        b = res["best_tree_vs_chain"]
        lines += ["", f"best tree {res['best_tree']} vs best chain {res['best_chain']}: {fmt(b['value'], b['ci'])}×"]
    for k, note in res.get("notes", {}).items():
        lines.append(f"- {k}: {note}")
    return "\n".join(lines) + "\n"


@dataclass
class TreeTraces:
    """A `tree` trace folder opened for replaying: its rows (`ds`, where learned builders read their head's inputs),
    manifest, tree settings, cost profile and the first `prompts` prompts' candidate trees."""

    folder: Path
    ds: object
    manifest: dict
    tree: dict
    profile: CostProfile
    cands: list[Candidates]


def open_traces(cfg: DictConfig) -> TreeTraces:
    """`cfg.traces` (and `cfg.prompts`) as TreeTraces; a missing or wrong folder is one error line."""
    from data_gen.contract import trace_columns
    from data_gen.store import load_traces

    if not cfg.get("traces"):
        raise UserError("pass the trace folder: traces=FOLDER (python -m data_gen trace=tree split=test limit=N)")
    folder = Path(str(cfg.traces))
    if not folder.exists():
        raise UserError(f"no traces at {folder}; make them with python -m data_gen trace=tree split=... limit=...")
    ds, manifest = load_traces(folder)
    tree = check_trace(manifest, folder)
    cands = candidates_from_columns(trace_columns(ds, COLUMNS), int(cfg.prompts) if cfg.get("prompts") else None)
    first_empty = manifest_kind(manifest).first_round_empty
    for c in cands:
        c.first_empty = first_empty
    return TreeTraces(folder, ds, manifest, tree, CostProfile.from_dict(manifest["cost_profile"]), cands)


def run(cfg: DictConfig) -> dict:
    t = open_traces(cfg)
    folder, ds, manifest, tree, profile, cands = t.folder, t.ds, t.manifest, t.tree, t.profile, t.cands
    built, notes = builders(cfg, tree, profile)
    built.update(chains(int(tree.get("depth", 5)), profile))
    per = {k: replay(b, cands, profile, head_scores(b, ds, manifest, folder), f"tree_replay {k}")
           for k, b in built.items()}
    res = {"settings": {"command": command("eval.tree_replay"), "traces": str(folder), "pair": manifest.get("pair_id"),
                        "prompts": len(cands), "tree": tree,
                        "c": profile.cost_ratio, "cost_profile": profile.to_dict(),
                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "builders": {k: b.describe() for k, b in built.items()}},
           **summarize(per, int(cfg.get("resamples", 4000))), "notes": notes}
    out = output_dir(cfg.get("out_dir"))
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "tree_replay.json", json.dumps(res, indent=1) + "\n")
    write_text_atomic(out / "tree_replay.md", markdown(res))
    if cfg.get("plots", True):
        from eval.plots import speedup_bars

        speedup_bars({k: (r["speedup"], r["speedup_ci"]) for k, r in res["builders"].items()}, out / "speedup.png",
                     ylabel="cost-model speedup vs target-only\n(95% bootstrap CI over prompts)",
                     title=f"Tree replay, {len(cands)} prompts")
    print(markdown(res))
    print(f"wrote {out / 'tree_replay.json'}, tree_replay.md" + (" and speedup.png" if cfg.get("plots", True) else ""))
    return res


@hydra_entry("tree_replay", open_dicts=("policy",))
def main(cfg: DictConfig) -> dict:
    return run(cfg)


if __name__ == "__main__":
    main()
