"""How much would more features buy a stop head? A feature ablation on greedy target_ar traces.

    python -m bench.head_features train=TRACES|train=[TRACES,TRACES2,...] test=TRACES
        [out_dir=results/bench/head_features]

Fits one gradient-boosted classifier (scikit-learn, fixed settings) per training folder and feature set, predicting
acceptance (draft argmax = target argmax) from features a decoder has for free at each drafted token:
- `disco`: the DISCO head's inputs (top-10 q, H_q, position in round);
- `+history`: what the last verification and the round so far tell: the target's entropy at the token before the
  round, the previous drafted token's max q, the round's cumulative log max q, the acceptance rate over the last 16
  positions, the position in the continuation;
- `+tokens`: the drafted token's id and the previous token's id (categorical, the 250 most frequent ids of the
  training rows, the rest pooled);
- `+history+tokens`: both.
Reports test AUROC next to max q and −H_q (the scores max-confidence and SVIP/AdaEDL threshold). Read it with the
replay's curve (results/stop_heads/replay_mbpp): the AUROC a head would need for a given speedup. An analysis of what the signal
allows, not a head: these history features are not the ones decode reads. Issue 16 made verification, copy and token
features part of the contract (models.features, `model=disco_plus`); their ablation is bench.feature_ablation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import DictConfig, ListConfig
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.metrics import roc_auc_score

from bench import command, repo_path
from models.features.trace import continuation_starts, trace_round_positions
from utils.cli import UserError, hydra_entry
from utils.files import write_result

N_IDS = 250  # HistGradientBoosting's categorical features take < 255 categories
HISTORY = 16
COLUMNS = ["prompt_id", "kind", "position", "draft_token", "target_token", "draft_topk", "draft_entropy", "target_entropy"]


def load(folder: Path) -> tuple[dict, dict]:
    from eval.continuations import load_greedy_traces

    return load_greedy_traces(folder, COLUMNS)


def features(cols: dict) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(labels, {feature block: (N, d) array}) for one trace folder."""
    y = cols["draft_token"] == cols["target_token"]
    n = len(y)
    idx = np.arange(n)
    pos = trace_round_positions(cols)
    starts = continuation_starts(cols)
    round_start = idx - pos
    topk = np.asarray(cols["draft_topk"], dtype=np.float32)[:, :10]
    maxq = topk[:, 0]
    disco = np.column_stack([topk, cols["draft_entropy"], pos])

    t_ent = np.asarray(cols["target_entropy"], dtype=np.float32)
    first = starts[round_start]  # the round opens its continuation: no target step before it
    before = np.where(first, np.nan, t_ent[np.maximum(round_start - 1, 0)])
    before = np.where(np.isnan(before), np.nanmean(before) if (~first).any() else 0.0, before)
    prev_q = np.where(pos > 0, maxq[np.maximum(idx - 1, 0)], 1.0)
    logq = np.log(np.clip(maxq, 1e-9, 1.0))
    cum = np.cumsum(logq)
    cum_round = cum - np.where(round_start > 0, cum[np.maximum(round_start - 1, 0)], 0.0)
    cont_start = np.maximum.accumulate(np.where(starts, idx, 0))
    acc = np.concatenate([[0], np.cumsum(y)])
    lo = np.maximum(cont_start, round_start - HISTORY)
    seen = round_start - lo
    recent = np.where(seen > 0, (acc[round_start] - acc[lo]) / np.maximum(seen, 1), np.nan)
    recent = np.where(np.isnan(recent), np.nanmean(recent) if (seen > 0).any() else 0.5, recent)
    history = np.column_stack([before, prev_q, cum_round, recent, cols["position"]])

    prev_tok = np.where(starts, -1, np.roll(cols["target_token"], 1))  # on the target's path: the previous target token
    tokens = np.column_stack([cols["draft_token"], prev_tok]).astype(np.int64)
    return y.astype(int), {"disco": disco, "history": history, "tokens": tokens}


def id_codes(train_tokens: np.ndarray):
    ids, counts = np.unique(train_tokens, return_counts=True)
    keep = {int(t): i for i, t in enumerate(ids[np.argsort(-counts, kind="stable")][:N_IDS])}
    return lambda tok: np.vectorize(lambda t: keep.get(int(t), N_IDS))(tok)


SETS = {"disco": ["disco"], "+history": ["disco", "history"], "+tokens": ["disco", "tokens"],
        "+history+tokens": ["disco", "history", "tokens"]}


def fit_auroc(train: dict, y_train, test: dict, y_test, blocks: list[str]) -> float:
    code = id_codes(train["tokens"]) if "tokens" in blocks else None

    def matrix(f):
        parts = [code(f[b]) if b == "tokens" else f[b] for b in blocks]
        return np.column_stack(parts).astype(np.float64)

    cat = [False] * sum(train[b].shape[1] for b in blocks if b != "tokens") + ([True, True] if "tokens" in blocks else [])
    model = HistGradientBoostingClassifier(max_iter=300, learning_rate=0.05, max_leaf_nodes=15, random_state=0,
                                           categorical_features=cat)
    model.fit(matrix(train), y_train)
    return float(roc_auc_score(y_test, model.predict_proba(matrix(test))[:, 1]))


def run(cfg: DictConfig) -> None:
    folders = cfg.train if isinstance(cfg.train, (list, ListConfig)) else [cfg.train] if cfg.train else []
    if not folders or not cfg.test:
        raise UserError("give the trace folders: train=TRACES (or train=[A,B]) and test=TRACES")
    test_cols, test_man = load(repo_path(cfg.test))
    trains = [(str(f), *load(repo_path(f))) for f in folders]  # named as given, read from under the repository root
    y_test, f_test = features(test_cols)
    result = {"test": str(cfg.test), "test_rows": len(y_test), "test_acceptance": float(y_test.mean()),
              "baselines": {"max_q": float(roc_auc_score(y_test, f_test["disco"][:, 0])),
                            "neg_entropy": float(roc_auc_score(y_test, -f_test["disco"][:, 10]))},
              "train": []}
    for folder, cols, man in trains:
        if man.get("pair_id") != test_man.get("pair_id"):
            raise UserError(f"{folder} comes from pair {man.get('pair_id')}, the test traces from {test_man.get('pair_id')}")
        y, f = features(cols)
        row = {"folder": str(folder), "rows": len(y), "acceptance": float(y.mean()),
               "auroc": {name: fit_auroc(f, y, f_test, y_test, blocks) for name, blocks in SETS.items()}}
        result["train"].append(row)
    lines = [f"Test AUROC of a gradient-boosted head per feature set (`{command('head_features')}`); test traces "
             f"`{result['test']}` ({result['test_rows']} rows, acceptance {result['test_acceptance']:.3f}); "
             f"max q {result['baselines']['max_q']:.3f}, −H_q {result['baselines']['neg_entropy']:.3f}.", "",
             "| trained on | rows | acceptance | " + " | ".join(SETS) + " |", "|---|---|---|" + "---|" * len(SETS)]
    for row in result["train"]:
        lines.append(f"| `{row['folder']}` | {row['rows']} | {row['acceptance']:.3f} | "
                     + " | ".join(f"{row['auroc'][s]:.3f}" for s in SETS) + " |")
    write_result(repo_path(cfg.out_dir), "head_features", result, lines)


if __name__ == "__main__":
    hydra_entry("bench/head_features")(run)()
