"""`python -m eval.tree_bar`: issue 30's bar — do learned token trees pay? — assembled as one JSON from its inputs.

    python -m eval.tree_bar [inputs.sweep=FILE] [inputs.replay=FILE] [inputs.wall=FILE] [inputs.head=FILE]
        [inputs.ceiling=FILE] [out=results/trees/bar.json]

Writes (and bar.md beside it)

    {"replay": {"prompts", "tau_learned", "tau_eagle2", "nodes_learned", "nodes_eagle2", "node_saving",
                "node_saving_ci", "best_tree_vs_chain", ...},
     "wall": {"prompts", "best_tree_speedup", "best_chain_speedup", ...},
     "auroc": {"head", "joint_prob"}, "ceiling": {"rank_vector", "static_tree_vs_chain"}, "sources", "pass"}

from eval.tree_sweep's JSON (node saving at equal τ: (tau_learned, nodes_learned) is the learned curve's point at
τ_eagle2, so tau_learned = tau_eagle2 by construction; `tau_learned_at_equal_nodes` is the other reading),
eval.tree_replay's JSON (best tree ÷ best chain, cost model), a decode summary.json of the wall-clock run (best tree
builder against the best chain policy; the oracle reads the target's output — an upper bound, not a method — so
it is no chain candidate), a node head's results.json or export record (AUROC on the on-path label against the joint's:
test/auroc_path and test/auroc_path_joint, or test/auroc and test/auroc_joint for a path head; train/job.py) and
eval.tree_ceiling's ceiling.json. `pass` holds each criterion of the issue as true/false. A missing input is one
error line naming the file and the command that makes it; nothing is written unless every input reads.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from utils.cli import UserError, hydra_entry
from utils.files import jsonl_path, write_text_atomic

MAKES = {  # the command that makes each input (in the error line and, where the file records none, in `sources`)
    "sweep": "python -m eval.tree_sweep traces=<MBPP test tree traces> learned=CKPT c2t=CKPT prompts=500 "
             "out_dir=results/trees/sweep",
    "replay": "python -m eval.tree_replay traces=<MBPP test tree traces> 'policies=[tree_static,sequoia,eagle2,"
              "learned_tree:CKPT,c2t:CKPT]' prompts=500 out_dir=results/trees/replay",
    "wall": "python -m decode 'policies=[expected_value,oracle,tree_static,sequoia,eagle2,learned_tree:CKPT]' "
            "limit=100 max_new_tokens=128 out_dir=results/tree_wall",
    "head": "python -m train +experiment=tree_mbpp, then python -m train.export <run>/checkpoints/best.ckpt "
            "models/weights/heads/tree_node_mbpp.ckpt",
    "ceiling": "python -m eval.tree_ceiling out_dir=results/trees",
}


def load(name: str, path) -> dict:
    path = Path(str(path))
    if not path.is_file():
        raise UserError(f"inputs.{name}: {path} is missing; make it with `{MAKES[name]}` or pass inputs.{name}=FILE")
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise UserError(f"inputs.{name}: {path} is not JSON; remake it with `{MAKES[name]}`") from None


def need(d: dict, key: str, name: str, path):
    if d.get(key) is None:
        raise UserError(f"inputs.{name}: {path} has no '{key}'; it is not the output of `{MAKES[name]}`")
    return d[key]


def replay_part(sweep: dict, replay: dict, learned: str, paths) -> tuple[dict, list[str]]:
    """Node saving at equal τ (the sweep) and best tree ÷ best chain (the ordinary replay), on the same prompts."""
    ns = need(sweep, "node_saving", "sweep", paths.sweep)
    fams, ref = ns["families"], ns["reference"]
    if learned not in fams:
        raise UserError(f"inputs.sweep: {paths.sweep} has no {learned} curve ({sorted(fams)}); rerun the sweep with "
                        "learned=CKPT")
    r = fams[learned]
    b = need(replay, "best_tree_vs_chain", "replay", paths.replay)
    out = {"prompts": sweep["settings"]["prompts"], "tau_learned": r["tau"], "tau_eagle2": ref["tau"],
           "nodes_learned": r["nodes"], "nodes_eagle2": ref["nodes"], "node_saving": r["saving"],
           "node_saving_ci": r["saving_ci"], "best_tree_vs_chain": b["value"], "best_tree_vs_chain_ci": b["ci"],
           "best_tree": replay.get("best_tree"), "best_chain": replay.get("best_chain"),
           "reference_nodes": sweep["settings"].get("reference_nodes"),
           "tau_learned_at_equal_nodes": r.get("tau_at_equal_nodes"),
           "others": {f: {k: v[k] for k in ("nodes", "saving", "saving_ci")} for f, v in fams.items() if f != learned}}
    notes = [f"sweep, {f}: {v['note']}" for f, v in fams.items() if v.get("note")]
    s, t = sweep["settings"], replay.get("settings", {})
    if (s.get("traces"), s.get("prompts")) != (t.get("traces"), t.get("prompts")):
        notes.append(f"the sweep ({s.get('prompts')} prompts of {s.get('traces')}) and the replay "
                     f"({t.get('prompts')} prompts of {t.get('traces')}) are not on the same prompts")
    return out, notes


def wall_part(summary: dict, folder: Path, resamples: int) -> tuple[dict, list[str]]:
    """Best tree builder vs best chain policy (oracle excluded: an upper bound, not a method) by wall-clock speedup,
    with 95% intervals over prompts from the run's prompts.jsonl when it is there."""
    from eval.bar import key_class, per_prompt

    classes = {k: key_class(k) for k in summary if k != "target"}
    trees = {k: summary[k]["speedup"] for k, c in classes.items() if c is not None and c.tree}
    chains = {k: summary[k]["speedup"] for k, c in classes.items() if c is not None and not c.tree and not c.oracle}
    if not trees or not chains:
        raise UserError(f"inputs.wall: {folder / 'summary.json'} needs tree builders and chain policies, has "
                        f"{sorted(summary)}; decode with `{MAKES['wall']}`")
    tree, chain = max(trees, key=trees.get), max(chains, key=chains.get)
    run = json.loads((folder / "run.json").read_text()) if (folder / "run.json").is_file() else {}
    n = int(summary[tree]["n_prompts"])
    tokens = run.get("max_new_tokens") or summary[tree]["new_tokens"] / max(n, 1)
    out = {"prompts": n, "best_tree_speedup": trees[tree], "best_chain_speedup": chains[chain], "best_tree": tree,
           "best_chain": chain, "ratio": trees[tree] / chains[chain], "ratio_ci": None, "max_new_tokens": tokens,
           "speedup": {k: summary[k]["speedup"] for k in classes}, "machine": run.get("machine"),
           "oracle": "excluded from best_chain: it reads the target's output (an upper bound, not a method)"}
    notes = []
    if jsonl_path(folder / "prompts.jsonl"):
        from utils.stats import bootstrap_ci

        ids, pp = per_prompt(folder / "prompts.jsonl", [tree, chain], ("new_tokens", "wall_s"))

        def stat(idx, axis=-1):
            tps = {m: pp[m]["new_tokens"][idx].sum(-1) / pp[m]["wall_s"][idx].sum(-1) for m in (tree, chain)}
            return np.stack([tps[tree] / tps[chain]])

        out["ratio_ci"] = bootstrap_ci(len(ids), stat, resamples, method="percentile")[0]
    else:
        notes.append(f"no {folder / 'prompts.jsonl'}: the wall ratio has no interval")
    sv = [summary.get(k, {}).get("speedup") for k in ("sequoia", "expected_value")]
    out["sequoia_vs_expected_value"] = sv[0] / sv[1] if None not in sv else None
    if None in sv:
        notes.append("the wall run lacks sequoia or expected_value: sequoia_vs_expected_value not measured")
    return out, notes


def auroc_part(head: dict, path) -> tuple[dict, list[str]]:
    """The head's AUROC against the joint probability's on the on-path label. The joint is a path score, so a
    conditional head (labels=on_path_given_parent) is scored by its composed P(on path) (test/auroc_path); its own
    label's AUROC, where the joint is no natural baseline, goes to the notes."""
    key = "test/auroc_path" if "test/auroc_path" in head else "test/auroc"
    joint = "test/auroc_path_joint" if key == "test/auroc_path" else "test/auroc_joint"
    auroc = {"head": need(head, key, "head", path), "joint_prob": need(head, joint, "head", path)}
    notes = []
    if key == "test/auroc_path" and head.get("test/auroc") != head.get(key):
        notes.append(f"head, on its own label: AUROC {head['test/auroc']:.3f} vs joint "
                     f"{head.get('test/auroc_joint', float('nan')):.3f} and the node's own q "
                     f"{head.get('test/auroc_q_token', float('nan')):.3f}; the bar reads the on-path label")
    return auroc, notes


def wall_command(folder: Path) -> str | None:
    """decode's command, rebuilt from run.json (decode records its settings, not its command line)."""
    p = folder / "run.json"
    if not p.is_file():
        return None
    r = json.loads(p.read_text())
    return (f"python -m decode pair={r.get('pair')} dataset={r.get('dataset')} split={r.get('split')} "
            f"limit={r.get('limit')} max_new_tokens={r.get('max_new_tokens')} "
            f"'policies=[{','.join(r.get('policies') or [])}]' out_dir={folder}  (rebuilt from run.json)")


def assemble(cfg: DictConfig) -> dict:
    """The bar from the inputs (every one read before anything is written)."""
    paths = cfg.inputs
    data = {name: load(name, paths[name]) for name in MAKES}
    replay, notes = replay_part(data["sweep"], data["replay"], str(cfg.learned), paths)
    wall_folder = Path(str(paths.wall)).parent
    wall, wall_notes = wall_part(data["wall"], wall_folder, int(cfg.resamples))
    auroc, head_notes = auroc_part(data["head"], paths.head)
    notes += head_notes
    ceiling = {"rank_vector": need(data["ceiling"], "rank_vector", "ceiling", paths.ceiling),
               "static_tree_vs_chain": need(data["ceiling"], "static_tree_vs_chain", "ceiling", paths.ceiling)}
    c = cfg.criteria
    ci = replay["node_saving_ci"]
    passed = {
        "node_saving": replay["node_saving"] is not None and replay["node_saving"] >= float(c.node_saving)
        and ci is not None and ci[0] > 0,
        "auroc": auroc["head"] >= auroc["joint_prob"] + float(c.auroc_margin),
        "wall_tree_vs_chain": wall["best_tree_speedup"] >= float(c.wall_tree_vs_chain) * wall["best_chain_speedup"],
        "sequoia_vs_expected_value": wall["sequoia_vs_expected_value"] is not None
        and wall["sequoia_vs_expected_value"] >= float(c.sequoia_vs_expected_value),
        "replay_prompts": replay["prompts"] >= int(c.replay_prompts),
        "wall_size": wall["prompts"] >= int(c.wall_prompts) and wall["max_new_tokens"] >= int(c.wall_tokens),
    }
    recorded = {"sweep": data["sweep"].get("settings", {}).get("command"),
                "replay": data["replay"].get("settings", {}).get("command"), "wall": wall_command(wall_folder),
                "head": data["head"].get("command"), "ceiling": data["ceiling"].get("command")}
    sources = {n: {"file": str(paths[n]), "command": recorded[n] or MAKES[n]} for n in MAKES}
    return {"replay": replay, "wall": wall, "auroc": auroc, "ceiling": ceiling, "sources": sources, "pass": passed,
            "criteria": {k: float(v) for k, v in c.items()}, "notes": notes + wall_notes,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def markdown(bar: dict) -> str:
    r, w, a, ce, p, c = bar["replay"], bar["wall"], bar["auroc"], bar["ceiling"], bar["pass"], bar["criteria"]
    f = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    ci = lambda v: "" if not v else f" [{v[0]:.3f}, {v[1]:.3f}]"  # noqa: E731
    ok = lambda k: "yes" if p[k] else "**no**"  # noqa: E731
    lines = ["# Issue 30's bar (eval/tree_bar.py)", "", "| criterion | value | aim | met |", "|---|---|---|---|",
             f"| node saving vs eagle2 at equal τ ({r['prompts']} prompts; τ {f(r['tau_eagle2'])}: "
             f"{f(r['nodes_learned'])} vs {f(r['nodes_eagle2'])} nodes) | {f(r['node_saving'])}"
             f"{ci(r['node_saving_ci'])} | ≥ {c['node_saving']:g}, CI > 0 | {ok('node_saving')} |",
             f"| node AUROC: head vs joint probability | {f(a['head'])} vs {f(a['joint_prob'])} | "
             f"≥ joint + {c['auroc_margin']:g} | {ok('auroc')} |",
             f"| wall: best tree {w['best_tree']} vs best chain {w['best_chain']} ({w['prompts']} prompts × "
             f"{w['max_new_tokens']:g} tokens) | {f(w['best_tree_speedup'])}× vs {f(w['best_chain_speedup'])}× = "
             f"{f(w['ratio'])}{ci(w['ratio_ci'])} | ≥ {c['wall_tree_vs_chain']:g} | {ok('wall_tree_vs_chain')} |",
             f"| wall: sequoia ÷ expected_value | {f(w['sequoia_vs_expected_value'])} | "
             f"≥ {c['sequoia_vs_expected_value']:g} | {ok('sequoia_vs_expected_value')} |",
             f"| replay prompts | {r['prompts']} | ≥ {c['replay_prompts']:g} | {ok('replay_prompts')} |",
             f"| wall size | {w['prompts']} × {w['max_new_tokens']:g} | ≥ {c['wall_prompts']:g} × "
             f"{c['wall_tokens']:g} | {ok('wall_size')} |", "",
             f"Replay, best tree {r['best_tree']} ÷ best chain {r['best_chain']} (cost model): "
             f"{f(r['best_tree_vs_chain'])}{ci(r['best_tree_vs_chain_ci'])}. Ceiling: best static tree ÷ best chain "
             f"{f(ce['static_tree_vs_chain'])}; acceptance by rank " + ", ".join(f"{x:.3f}" for x in ce["rank_vector"])
             + ".", ""]
    lines += [f"- {n}" for n in bar["notes"]]
    lines += ["", "Sources:"] + [f"- {k}: `{v['file']}` — `{v['command']}`" for k, v in bar["sources"].items()]
    return "\n".join(lines) + "\n"


def run(cfg: DictConfig) -> dict:
    bar = assemble(cfg)
    out = Path(str(cfg.out))
    md = markdown(bar)
    write_text_atomic(out, json.dumps(bar, indent=1) + "\n")
    write_text_atomic(out.with_suffix(".md"), md)
    print(md)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return bar


@hydra_entry("tree_bar")
def main(cfg: DictConfig) -> dict:
    return run(cfg)


if __name__ == "__main__":
    main()
