"""Feature ablation for disco_plus: test AUROC per feature group, with the features decode computes (models.features).

    python -m bench.feature_ablation [train=TRAIN_TRACES] [test=TEST_TRACES] [out_dir=results/stop_heads]

Defaults are the heads' traces of results/stop_heads (`python -m train +experiment=disco_plus_mbpp
split_limits.test=500` makes them in traces/): trained on the heads' 60 train prompts (MBPP 511-570; the draft was
distilled on 601-974, conf/dataset/mbpp.yaml), tested on all 500 test prompts, 128 tokens each.
Per feature set (DISCO, +verify, +copy, +token, all) two models are fitted on the same rows:
- `gbm`: a gradient-boosted probe (scikit-learn, fixed settings; token ids as categorical: the 250 most frequent ids
  of the training rows, the rest pooled) — what the signal allows;
- `disco_plus`: the disco_plus head itself (models.heads, logit = a·logit(max q) + FFN), full-batch Adam with early
  stopping on a 20% prompt hold-out of the training rows — what the shipped head gets from it.
Writes ablation.json and ablation.md under out_dir, next to max q and −H_q (the training-free scores).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.metrics import roc_auc_score

from bench import command, repo_path, write_result
from utils.cli import UserError, hydra_entry

SETS = {"DISCO": [], "+verify": ["verify"], "+copy": ["copy"], "+token": ["token"], "all": ["verify", "copy", "token"]}
N_IDS = 250


def load(folder: Path, spec):
    from eval.continuations import load_greedy_traces
    from models.features.spec import features_from_columns, needed_columns

    cols, manifest = load_greedy_traces(folder, list(needed_columns(spec)))
    lack = [c for c in needed_columns(spec) if c not in cols]
    if lack:
        raise UserError(f"{folder} lacks column(s) {lack} (made before disco_plus features); regenerate it with "
                        "python -m data_gen ... overwrite=true")
    y = (cols["draft_token"] == cols["target_token"]).astype(np.float32)
    return features_from_columns(cols, spec), y, np.asarray(cols["prompt_id"]), manifest


def gbm_auroc(x_tr, y_tr, x_te, y_te, token_cols) -> float:
    x_tr, x_te = x_tr.numpy().astype(np.float64), x_te.numpy().astype(np.float64)
    cat = [i in token_cols for i in range(x_tr.shape[1])]
    for col in token_cols:  # categorical codes: frequent ids keep their own code
        ids, counts = np.unique(x_tr[:, col], return_counts=True)
        keep = {v: i for i, v in enumerate(ids[np.argsort(-counts, kind="stable")][:N_IDS])}
        x_tr[:, col] = [keep.get(v, N_IDS) for v in x_tr[:, col]]
        x_te[:, col] = [keep.get(v, N_IDS) for v in x_te[:, col]]
    model = HistGradientBoostingClassifier(max_iter=300, learning_rate=0.05, max_leaf_nodes=15, random_state=0,
                                           categorical_features=cat)
    model.fit(x_tr, y_tr)
    return float(roc_auc_score(y_te, model.predict_proba(x_te)[:, 1]))


def head_auroc(spec, x_tr, y_tr, prompts, x_te, y_te, seed: int = 0) -> float:
    """The disco_plus head, trained full-batch on the training rows (early stopping on a prompt hold-out)."""
    from models.heads import build_head

    torch.manual_seed(seed)
    uniq = np.unique(prompts)
    rng = np.random.default_rng(seed)
    hold = set(rng.choice(uniq, size=max(1, len(uniq) // 5), replace=False).tolist())
    val = torch.as_tensor(np.isin(prompts, list(hold)))
    head = build_head("disco_plus", spec, {"hidden": 64, "dropout": 0.1})
    fit = x_tr[~val]
    mean, std = fit.mean(0), fit.std(0)
    tok = spec.token_columns()
    mean[tok], std[tok] = 0.0, 1.0
    head.set_normalization(mean, std)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3, weight_decay=1e-4)
    yt = torch.as_tensor(y_tr)
    best, best_state, bad = -1.0, None, 0
    for _ in range(400):
        head.train()
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head(x_tr[~val]), yt[~val])
        loss.backward()
        opt.step()
        head.eval()
        with torch.no_grad():
            auc = roc_auc_score(y_tr[val.numpy()], head(x_tr[val]).numpy())
        if auc > best + 1e-4:
            best, best_state, bad = auc, {k: v.clone() for k, v in head.state_dict().items()}, 0
        else:
            bad += 1
            if bad >= 40:
                break
    head.load_state_dict(best_state)
    head.eval()
    with torch.no_grad():
        return float(roc_auc_score(y_te, head(x_te).numpy()))


def run(cfg: DictConfig) -> None:
    from models.features.spec import FeatureSpec

    train, test = repo_path(cfg.train), repo_path(cfg.test)
    torch.set_num_threads(1)
    spec_all = FeatureSpec("disco_plus", groups=["verify", "copy", "token"])
    x_tr, y_tr, p_tr, man_tr = load(train, spec_all)
    x_te, y_te, _, man_te = load(test, spec_all)
    if man_tr.get("pair_id") != man_te.get("pair_id"):
        raise UserError(f"{train} comes from pair {man_tr.get('pair_id')}, {test} from {man_te.get('pair_id')}")
    names = spec_all.names
    rows = {}
    for label, groups in SETS.items():
        spec = FeatureSpec("disco_plus", groups=groups)
        cols = [names.index(n) for n in spec.names]
        a, b = x_tr[:, cols], x_te[:, cols]
        rows[label] = {"groups": groups, "dim": spec.dim,
                       "gbm": gbm_auroc(a, y_tr, b, y_te, spec.token_columns()),
                       "disco_plus": head_auroc(spec, a, y_tr, p_tr, b, y_te)}
        print(label, rows[label], flush=True)
    result = {
        "command": command("feature_ablation"),
        "train": str(train), "test": str(test), "train_rows": len(y_tr), "test_rows": len(y_te),
        "train_acceptance": float(y_tr.mean()), "test_acceptance": float(y_te.mean()),
        "baselines": {"max_q": float(roc_auc_score(y_te, x_te[:, 0].numpy())),
                      "neg_entropy": float(roc_auc_score(y_te, -x_te[:, 10].numpy()))},
        "features": {"verify": names[12:17], "copy": names[17:20], "token": names[20:22]},
        "auroc": rows,
    }
    lines = [f"Test AUROC per feature group (`{result['command']}`): trained on `{train.name}` "
             f"({len(y_tr)} rows, acceptance {y_tr.mean():.3f}), tested on `{test.name}` ({len(y_te)} rows, "
             f"acceptance {y_te.mean():.3f}). Training-free scores on the test rows: max q "
             f"{result['baselines']['max_q']:.3f}, −H_q {result['baselines']['neg_entropy']:.3f}.", "",
             "| features | dim | gradient-boosted probe | disco_plus head |", "|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['dim']} | {r['gbm']:.3f} | {r['disco_plus']:.3f} |")
    lines += ["", "Groups (models/features.py): verify = " + ", ".join(result["features"]["verify"])
              + "; copy = " + ", ".join(result["features"]["copy"]) + "; token = "
              + ", ".join(result["features"]["token"]) + "."]
    write_result(repo_path(cfg.out_dir), "ablation", result, lines)


if __name__ == "__main__":
    hydra_entry("bench/feature_ablation")(run)()
