"""Would the draft's or the target's hidden state, more training prompts, or the draft's distribution after a node
lift a node head past the joint probability (issue 30)?

    python -m bench.tree_node_signals [out_dir=results/trees]

Issue 30 asks a node head to beat the joint draft probability by 0.03 path AUROC; the shipped conditional plus head
leads by 0.010 (0.971 vs 0.961), its conditional AUROC 0.968 against the node's own q 0.960. The head's path score
is the product of its conditional P(accepted | parent accepted) along the root path, so a lead on the path label
can only come from a lead on the conditional task. This probe measures the conditional task with the inputs the
tree traces do not store: the draft's last hidden state at the parent (SPRINTER's feature, 576 floats a node, left
out of the tree traces for size), the target's last hidden state (what the last verification computed: EAGLE's
feature) and five times the training prompts.

The conditional population is rebuilt from the chain heads' MBPP traces (target-greedy continuations): at every
position of the target's path the parent is on the path, and its children in a width-4 tree are the draft's top-4
tokens there (label: the child is the target's token), one teacher-forced draft pass per prompt. Features:
- `node`: rank, q of the token, the parent distribution's entropy and top-10 probabilities (tree_node's inputs that
  do not depend on depth);
- `copy`: copy_len / lookup_hit / lookup_len of the token after the context (models.features.ContextIndex, the copy
  group of tree_node_plus);
- `draft_hidden`: the parent's hidden state, 16 principal components fitted on the training rows;
- `target_hidden`: the target's hidden state at the position before the parent (the one whose logits chose the
  parent), 16 principal components. In a tree that is the newest state the target has computed for a child of the
  root; deeper nodes would see older ones, so this is the probe's best case.
Scored by a gradient-boosted probe (sklearn), trained on the heads' 60 MBPP train prompts and tested on the first
250 test prompts; the `more data` rows add test prompts 251-500 to the training rows (a learning curve only: no
head ships from them).

A second table maps a conditional lead onto the path label the bar reads, on the MBPP tree traces (the first
`tree_prompts` test prompts): synthetic conditional heads logit(s) = logit(q) + beta * (2y - 1) on the nodes whose
parent is on the path (y: the node is the target's token) and s = q elsewhere, composed by product along the root
path as the learned builder composes its head. beta = 0 is the joint probability. Writes tree_node_signals.{json,md}
under out_dir.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from scipy.special import expit, logit
from sklearn.decomposition import PCA
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.metrics import roc_auc_score
from tqdm import tqdm

from bench import command, repo_path
from bench.extra_features import hidden_states
from data_gen.traces import _head
from eval.continuations import load_greedy_traces
from models.distributions import draft_probs, entropy
from models.features.context import ContextIndex
from models.features.trace import continuation_starts
from models.pair import load_pair
from utils.cli import UserError, hydra_entry
from utils.files import write_result

WIDTH, TOPK, PCS, TEST_PROMPTS = 4, 10, 16, 250
HEAD_KEYS = ("test/auroc_cond", "test/auroc_cond_q_token", "test/auroc_path", "test/auroc_path_joint")
SETS = {"node": [], "+copy": ["copy"], "+draft_hidden": ["draft_hidden"],
        "+copy +draft_hidden": ["copy", "draft_hidden"], "+copy +target_hidden": ["copy", "target_hidden"],
        "+copy +draft_hidden +target_hidden": ["copy", "draft_hidden", "target_hidden"]}
HIDDEN = ("draft_hidden", "target_hidden")
MORE_DATA = ["+copy", "+copy +draft_hidden"]
BETAS = [0.0, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5]


@torch.no_grad()
def load(pair, folder: Path) -> dict:
    """Per prompt, the conditional node rows: node features, copy features, the parent's draft hidden state, the
    target's hidden state one position earlier, label."""
    cols, _ = load_greedy_traces(folder, ["prompt_tokens", "context_token", "position", "prompt_id"])
    first = np.flatnonzero(continuation_starts(cols))
    ends = np.append(first[1:], len(cols["position"]))
    ctx = cols["context_token"].astype(np.int64)
    prompts = []
    for a, b in tqdm(list(zip(first, ends)), desc=f"teacher-forced draft ({folder.name})", mininterval=5):
        prompt = [int(t) for t in cols["prompt_tokens"][a]]
        seq, p0 = prompt + ctx[a:b].tolist(), len(prompt) - 1
        hidden = hidden_states(pair.draft, seq)[p0 : p0 + b - a]
        target_hidden = hidden_states(pair.target, seq)[p0 - 1 : p0 - 1 + b - a]
        q = draft_probs(_head(pair.draft, hidden, pair.vocab_size)).float()
        top, ent = q.topk(TOPK, -1), entropy(q)  # the entropy the node heads read (DraftStep's)
        index, node, copy, y = ContextIndex(prompt), [], [], []
        for r in range(b - a):
            probs, toks = top.values[r].numpy(), top.indices[r].tolist()
            for k in range(WIDTH):
                node.append([k + 1, probs[k], float(ent[r]), *probs])
                copy.append(index.copy_features(toks[k]))
                y.append(toks[k] == int(ctx[a + r]))
            index.push(int(ctx[a + r]))
        prompts.append({"node": np.asarray(node, np.float32), "copy": np.asarray(copy, np.float32),
                        "draft_hidden": np.repeat(hidden.float().numpy(), WIDTH, axis=0),
                        "target_hidden": np.repeat(target_hidden.float().numpy(), WIDTH, axis=0),
                        "y": np.asarray(y, np.int64)})
    return prompts


def stack(prompts: list[dict]) -> dict:
    return {k: np.concatenate([p[k] for p in prompts]) for k in prompts[0]}


def auroc(train: dict, test: dict, groups: list[str], pca: dict[str, PCA]) -> float:
    def block(data):
        parts = [data["node"]] + [pca[g].transform(data[g]) if g in pca else data[g] for g in groups]
        return np.concatenate(parts, 1)

    model = HistGradientBoostingClassifier(max_iter=300, learning_rate=0.05, random_state=0)
    model.fit(block(train), train["y"])
    return float(roc_auc_score(test["y"], model.predict_proba(block(test))[:, 1]))


def path_map(folder: Path, prompts: int) -> list[dict]:
    """Conditional and path AUROC of the synthetic heads (module docstring) on the first `prompts` prompts' trees."""
    from data_gen.contract import trace_columns
    from data_gen.store import load_traces
    from models.features.nodes import compose_path, parent_on_path_rows, parent_rows

    ds, _ = load_traces(folder)
    cols = trace_columns(ds, ["prompt_id", "position", "node", "parent", "q_token", "on_path"])
    keep = np.isin(cols["prompt_id"], np.unique(cols["prompt_id"])[:prompts])  # whole trees: a prompt's rows
    cols = {k: v[keep] for k, v in cols.items()}
    par = parent_rows(cols)
    y = cols["on_path"].astype(bool)
    cond = parent_on_path_rows(par, y)
    logit_q = logit(np.clip(cols["q_token"].astype(np.float64), 1e-9, 1 - 1e-9))
    out = []
    for beta in BETAS:
        s = expit(logit_q + np.where(cond, beta * (2 * y - 1), 0.0))
        out.append({"beta": beta, "auroc_cond": float(roc_auc_score(y[cond], s[cond])),
                    "auroc_path": float(roc_auc_score(y, compose_path(s, par, "product")))})
    return out


def tree_probe_rows(folder: Path, spec) -> dict:
    """A tree trace's nodes as probe rows: `node` (the row a node head of feature spec `spec` reads: the kind's
    `from_columns`), `look` (expanded, and the entropy and top-2 of the draft's distribution after the node: its
    children's draft_entropy / draft_topk; 0 / −1 for a node the draft never ran on), the on-path label, the
    conditional rows and each row's parent row."""
    from data_gen.contract import trace_columns
    from data_gen.store import load_traces
    from models.features.nodes import parent_on_path_rows, parent_rows
    from models.features.spec import feature_kind

    kind = feature_kind(spec.kind)
    ds, _ = load_traces(folder)
    c = trace_columns(ds, list(dict.fromkeys([*kind.columns(spec), "parent", "draft_entropy", "draft_topk", "joint",
                                              "q_token", "on_path"])))
    par = parent_rows(c)
    kids = np.flatnonzero(c["parent"] >= 0)
    look = np.zeros((len(par), 4))
    look[:, 1] = -1.0
    look[par[kids]] = np.column_stack([np.ones(len(kids)), c["draft_entropy"][kids], c["draft_topk"][kids, :2]])
    y = c["on_path"].astype(bool)
    return {"node": kind.from_columns(c, spec).numpy(), "look": look, "y": y, "cond": parent_on_path_rows(par, y),
            "par": par, "joint": c["joint"], "q": c["q_token"]}


def lookahead(train_folder: Path, test_folder: Path, spec) -> dict:
    """Conditional and path AUROC of the probe on a node head's inputs (feature spec `spec`), without and with the
    lookahead (module docstring); the joint's path AUROC and q's conditional one beside."""
    from models.features.nodes import compose_path

    train, test = tree_probe_rows(train_folder, spec), tree_probe_rows(test_folder, spec)
    out = {"train_nodes": int(len(train["y"])), "test_nodes": int(len(test["y"])),
           "joint_path": float(roc_auc_score(test["y"], test["joint"])),
           "q_cond": float(roc_auc_score(test["y"][test["cond"]], test["q"][test["cond"]]))}
    for label, groups in (("node", ["node"]), ("+lookahead", ["node", "look"])):
        model = HistGradientBoostingClassifier(max_iter=300, learning_rate=0.05, random_state=0)
        model.fit(np.concatenate([train[g] for g in groups], 1)[train["cond"]], train["y"][train["cond"]])
        s = model.predict_proba(np.concatenate([test[g] for g in groups], 1))[:, 1]
        out[label] = {"cond": float(roc_auc_score(test["y"][test["cond"]], s[test["cond"]])),
                      "path": float(roc_auc_score(test["y"], compose_path(s, test["par"], "product")))}
    return out


def run(cfg: DictConfig) -> None:
    folders = {name: repo_path(f"{cfg.traces}{name}") for name in ("train", "test-lim500")}
    folders.update(tree=repo_path(cfg.tree_traces), tree_train=repo_path(cfg.tree_train),
                   tree_test=repo_path(cfg.tree_test))
    for folder in folders.values():
        if not folder.exists():
            raise UserError(f"no traces at {folder}; make them with the commands in results/README.md "
                            "(the stop heads' traces)")
    pair = load_pair("smollm2_135m")
    start = time.perf_counter()
    train_prompts, test_all = load(pair, folders["train"]), load(pair, folders["test-lim500"])
    train = stack(train_prompts)
    test, extra = stack(test_all[:TEST_PROMPTS]), stack(test_all[TEST_PROMPTS:])
    more = {k: np.concatenate([train[k], extra[k]]) for k in train}
    pca = {g: PCA(PCS, random_state=0).fit(train[g]) for g in HIDDEN}
    pca_more = {g: PCA(PCS, random_state=0).fit(more[g]) for g in HIDDEN}
    result_sets = {}
    for label, groups in SETS.items():
        result_sets[label] = auroc(train, test, groups, pca)
        print(f"{label}: {result_sets[label]:.4f}", flush=True)
    more_data = {label: auroc(more, test, SETS[label], pca_more) for label in MORE_DATA}
    q_token = float(roc_auc_score(test["y"], test["node"][:, 1]))
    synthetic = path_map(folders["tree"], int(cfg.tree_prompts))
    from models.heads import load_head

    head_spec = load_head(repo_path(cfg.head_record).with_suffix(".ckpt")).spec  # the shipped head's own inputs
    look = lookahead(folders["tree_train"], folders["tree_test"], head_spec)
    head = json.loads(repo_path(cfg.head_record).read_text())
    result = {"command": command("tree_node_signals"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "pair": "smollm2_135m", "dtype": str(pair.dtype), "width": WIDTH, "principal_components": PCS,
              "train_prompts": len(train_prompts), "train_rows": int(len(train["y"])),
              "more_data_rows": int(len(more["y"])),
              "test_prompts": TEST_PROMPTS, "test_rows": int(len(test["y"])),
              "positive_rate": float(test["y"].mean()), "q_token": q_token, "auroc": result_sets,
              "auroc_more_data": more_data, "tree_traces": str(cfg.tree_traces), "tree_prompts": int(cfg.tree_prompts),
              "synthetic": synthetic, "lookahead": look, "tree_train": str(cfg.tree_train),
              "tree_test": str(cfg.tree_test), "head": {k: head.get(k) for k in HEAD_KEYS},
              "seconds": round(time.perf_counter() - start)}
    ratio = result["more_data_rows"] / result["train_rows"]
    lines = [f"Conditional node AUROC — is a child of an on-path parent the target's token? (`{result['command']}`, "
             f"{result['date']}, {result['dtype']}; width-{WIDTH} children along the target's greedy path of the "
             f"MBPP chain traces). Gradient-boosted probe trained on the {len(train_prompts)} train prompts "
             f"({result['train_rows']} rows), tested on the first {TEST_PROMPTS} test prompts ({result['test_rows']} "
             f"rows, {result['positive_rate']:.3f} positive). The node's own q scores {q_token:.4f}.", "",
             f"| features | AUROC, {len(train_prompts)} train prompts | AUROC, + test prompts "
             f"{TEST_PROMPTS + 1}-{len(test_all)} ({ratio:.1f}x rows) |", "|---|---|---|"]
    for label in SETS:
        more_cell = f"{more_data[label]:.4f}" if label in more_data else ""
        lines.append(f"| {label} | {result_sets[label]:.4f} | {more_cell} |")
    lines += ["", f"node = rank, q(token), the parent's entropy and top-{TOPK} probabilities; copy = copy_len, "
              f"lookup_hit, lookup_len; draft_hidden = the parent's last hidden state as {PCS} principal components; "
              f"target_hidden = the target's hidden state at the position that chose the parent (the newest a "
              f"child of the tree's root could read), {PCS} principal components."]
    lines += ["", f"Conditional lead → path AUROC (synthetic heads on the first {cfg.tree_prompts} prompts' trees of "
              f"{cfg.tree_traces}; beta = 0 is the joint, the bar asks path AUROC ≥ joint + 0.03):", "",
              "| beta | conditional AUROC | path AUROC | path − joint |", "|---|---|---|---|"]
    for row in synthetic:
        lines.append(f"| {row['beta']:g} | {row['auroc_cond']:.4f} | {row['auroc_path']:.4f} | "
                     f"{row['auroc_path'] - synthetic[0]['auroc_path']:+.4f} |")
    lines += ["", f"The shipped head ({cfg.head_record}, its 24 test prompts' trees): conditional "
              f"{head['test/auroc_cond']:.4f} (q {head['test/auroc_cond_q_token']:.4f}), "
              f"path {head['test/auroc_path']:.4f} "
              f"(joint {head['test/auroc_path_joint']:.4f})."]
    lines += ["", f"A tree's own signal, the draft's distribution after a node (expanded, its entropy and top-2; node "
              f"heads' tree traces, {look['train_nodes']} train → {look['test_nodes']} test nodes of "
              f"{cfg.tree_train} → {cfg.tree_test}). Joint's path AUROC {look['joint_path']:.4f}, q's conditional "
              f"{look['q_cond']:.4f}:", "", "| probe inputs | conditional AUROC | path AUROC | path − joint |",
              "|---|---|---|---|"]
    for label in ("node", "+lookahead"):
        row = look[label]
        lines.append(f"| {label} | {row['cond']:.4f} | {row['path']:.4f} | {row['path'] - look['joint_path']:+.4f} |")
    lines += ["", f"node = the shipped head's row ({cfg.head_record}: {head_spec.kind}, groups "
              f"{', '.join(head_spec.groups)}): the parent distribution's top-{head_spec.k} and entropy, depth, joint, "
              "log joint, q, rank, the parent's q, the copy and verify groups."]
    write_result(repo_path(cfg.out_dir), "tree_node_signals", result, lines)


if __name__ == "__main__":
    hydra_entry("bench/tree_node_signals")(run)()
