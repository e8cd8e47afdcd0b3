"""Signals the traces do not store: would they lift the stop head's AUROC (issue 16)?

    python -m bench.extra_features [out_dir=results/stop_heads]

The replay puts half of the static-K-opt → oracle gap at a head of AUROC ~0.95; the disco_plus features reach ~0.91.
This probe recomputes the draft's and the target's full outputs for every row of the heads' traces (one
teacher-forced pass of each model over prompt + continuation, the default pair) and adds, one group at a time, to the
disco_plus features (DISCO + verify + copy + token, `models.features`):
- `compete` — does the draft's own distribution lean towards a copy it did not pick: q of the prompt-lookup
  proposal, log q(proposal) − log q(x), the proposal's rank in q, the longest n-gram continuation among the draft's
  other top-5 tokens, the q mass of top-5 tokens continuing an n-gram of length ≥ 2, and x's copy length minus the
  best alternative's;
- `draft_hidden` — the draft's last hidden state, 16 principal components (fitted on the training rows);
- `target_hidden` — the target's last hidden state at the round's last verified row (free after a verification:
  the target computed it), 16 principal components;
- `target_skip` — log p(x) under the target's distribution at that row (how much the target, one token earlier,
  already expected x).
Each set is scored by the gradient-boosted probe of bench/feature_ablation.py (trained on the heads' 60 train prompts,
tested on the 500 test prompts). A second table asks the same of the *next* token, which the stop rule must guess
before drafting it: AUROC for the next row's acceptance on rows whose own token was accepted. Rounds are cut at
greedy mismatches as in the traces' verify columns. Writes extra_features.json / .md under out_dir.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from sklearn.decomposition import PCA
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.metrics import roc_auc_score
from tqdm import tqdm

from bench import REPO, command, repo_path, write_result
from data_gen.traces import _forward, _head
from eval.continuations import load_greedy_traces
from models.distributions import draft_probs
from models.features.context import ContextIndex
from models.features.spec import FeatureSpec, features_from_columns, needed_columns
from models.features.trace import continuation_starts, trace_round_positions
from models.pair import load_pair
from utils.cli import UserError, hydra_entry

TRACES = REPO / "traces" / "smollm2_135m--mbpp--target_ar-t0-p1-n128-s0--"  # the heads' traces (results/stop_heads)
SPEC = FeatureSpec("disco_plus", groups=("verify", "copy", "token"))
COMPETE = ["q_lookup", "logq_lookup_minus_x", "rank_lookup", "alt_copy_len", "copy_mass_top5", "copy_len_minus_alt"]
PCS = 16
SETS = {"disco_plus": [], "+compete": ["compete"], "+draft_hidden": ["draft_hidden"],
        "+target_hidden": ["target_hidden"], "+target_skip": ["target_skip"],
        "all": ["compete", "draft_hidden", "target_hidden", "target_skip"]}


def hidden_states(model, seq: list[int]) -> torch.Tensor:
    ids = torch.tensor([seq])
    return _forward(model, ids, torch.ones_like(ids), torch.arange(len(seq))[None])[0]


def compete_row(index: ContextIndex, q: torch.Tensor, top5: list[int], top5_q: list[float], x: int) -> list[float]:
    prop, _ = index.lookup()
    qx = float(q[x])
    if prop is None:
        lookup = [-1.0, -30.0, -1.0]
    else:
        ql = float(q[prop])
        lookup = [ql, float(np.log(ql + 1e-9) - np.log(qx + 1e-9)), float((q > ql).sum())]
    lens = [index.copy_features(t)[0] for t in top5]
    alt = max([n for t, n in zip(top5, lens) if t != x], default=0.0)
    mass = sum(p for p, n in zip(top5_q, lens) if n >= 2)
    return [*lookup, alt, mass, index.copy_features(x)[0] - alt]


@torch.no_grad()
def load(pair, name: str) -> dict:
    """The disco_plus features and the extra signals for every row of one trace folder."""
    names = list(dict.fromkeys([*needed_columns(SPEC), "prompt_tokens", "context_token"]))
    cols, _ = load_greedy_traces(Path(f"{TRACES}{name}"), names)
    x = features_from_columns(cols, SPEC).numpy()
    y = (cols["draft_token"] == cols["target_token"]).astype(np.int64)
    starts = continuation_starts(cols)
    first = np.flatnonzero(starts)
    ends = np.append(first[1:], len(y))
    pos = trace_round_positions(cols)
    last = np.arange(len(y)) - pos - 1  # the round's last verified row (the previous round's first rejection)
    has_last = ~starts[np.arange(len(y)) - pos]
    ctx, drafted = cols["context_token"].astype(np.int64), cols["draft_token"].astype(np.int64)
    d = pair.target.config.hidden_size
    compete = np.zeros((len(y), len(COMPETE)), np.float32)
    d_hidden = np.zeros((len(y), d), np.float32)
    t_hidden = np.zeros((len(y), d), np.float32)
    skip = np.zeros((len(y), 1), np.float32)
    for a, b in tqdm(list(zip(first, ends)), desc=f"teacher-forced passes ({name})", mininterval=5):
        prompt = [int(t) for t in cols["prompt_tokens"][a]]
        seq, p0 = prompt + ctx[a:b].tolist(), len(prompt) - 1
        dh = hidden_states(pair.draft, seq)[p0 : p0 + b - a]
        th = hidden_states(pair.target, seq)[p0 : p0 + b - a]
        q = draft_probs(_head(pair.draft, dh, pair.vocab_size))
        logp = torch.log_softmax(_head(pair.target, th, pair.vocab_size).float(), -1)
        d_hidden[a:b], t_hidden[a:b] = dh.float().numpy(), th.float().numpy()
        top = q.topk(5, -1)
        index = ContextIndex(prompt)
        for i in range(a, b):
            r = i - a
            compete[i] = compete_row(index, q[r], top.indices[r].tolist(), top.values[r].tolist(), int(drafted[i]))
            if has_last[i]:
                skip[i, 0] = float(logp[last[i] - a, drafted[i]])
            index.push(int(ctx[i]))
    t_prev = np.where(has_last[:, None], t_hidden[np.maximum(last, 0)], 0.0).astype(np.float32)
    nxt = np.zeros(len(y), bool)  # rows whose next row continues the round (so this row was accepted)
    nxt[:-1] = (pos[1:] == pos[:-1] + 1) & (y[:-1] == 1)
    y_next = np.append(y[1:], 0)
    return {"x": x, "y": y, "compete": compete, "draft_hidden": d_hidden, "target_hidden": t_prev,
            "target_skip": skip, "next": nxt, "y_next": y_next}


def gbm(x, y):
    return HistGradientBoostingClassifier(max_iter=300, learning_rate=0.05, random_state=0).fit(x, y)


def run(cfg: DictConfig) -> None:
    for name in ("train", "test-lim500"):
        if not Path(f"{TRACES}{name}").exists():
            raise UserError(f"no traces at {TRACES}{name}; make them with the commands in results/README.md")
    pair = load_pair("smollm2_135m")
    start = time.perf_counter()
    tr, te = load(pair, "train"), load(pair, "test-lim500")
    pcs = {g: PCA(PCS, random_state=0).fit(tr[g]) for g in ("draft_hidden", "target_hidden")}

    def block(data: dict, groups: list[str]) -> np.ndarray:
        parts = [data["x"]]
        for g in groups:
            parts.append(pcs[g].transform(data[g]) if g in pcs else data[g])
        return np.concatenate(parts, 1)

    current, following = {}, {}
    for label, groups in SETS.items():
        m = gbm(block(tr, groups), tr["y"])
        current[label] = float(roc_auc_score(te["y"], m.predict_proba(block(te, groups))[:, 1]))
        xt, xe = block(tr, groups)[tr["next"]], block(te, groups)[te["next"]]
        m = gbm(xt, tr["y_next"][tr["next"]])
        following[label] = float(roc_auc_score(te["y_next"][te["next"]], m.predict_proba(xe)[:, 1]))
        print(f"{label}: current {current[label]:.4f}, next {following[label]:.4f}", flush=True)
    max_q = float(roc_auc_score(te["y"], te["x"][:, 0]))
    max_q_next = float(roc_auc_score(te["y_next"][te["next"]], te["x"][te["next"], 0]))
    result = {"command": command("extra_features"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "pair": "smollm2_135m", "dtype": str(pair.dtype), "train_rows": int(len(tr["y"])),
              "test_rows": int(len(te["y"])), "next_test_rows": int(te["next"].sum()),
              "compete_columns": COMPETE, "principal_components": PCS, "seconds": round(time.perf_counter() - start),
              "auroc_current": current, "auroc_next": following, "max_q": max_q, "max_q_as_next_guess": max_q_next}
    lines = [f"Signals the traces do not store (`{result['command']}`, {result['date']}, {result['dtype']}): "
             f"gradient-boosted probe trained on the heads' MBPP train traces ({result['train_rows']} rows), tested on "
             f"the 500 test prompts ({result['test_rows']} rows; next token: {result['next_test_rows']} rows whose "
             f"own token was accepted). Max q: {max_q:.3f} (as a guess of the next token: {max_q_next:.3f}).", "",
             "| features | AUROC, this token | AUROC, the next token |", "|---|---|---|"]
    for label in SETS:
        lines.append(f"| {label} | {current[label]:.3f} | {following[label]:.3f} |")
    lines += ["", "disco_plus = DISCO + verify + copy + token (models.features); compete = " + ", ".join(COMPETE)
              + f"; hidden states as {PCS} principal components of the training rows."]
    write_result(repo_path(cfg.out_dir), "extra_features", result, lines)


if __name__ == "__main__":
    hydra_entry("bench/extra_features")(run)()
