"""Traces → (features, labels) tensors for a stop head, split by prompt, normalised on train.

Labels come from `data_gen.labels.make_labels` (so a τ sweep reuses the same traces) and features from
`models.features.features_from_columns` (the vectors decode builds per drafted token, or per token-tree node for the
node kinds). Per row it also keeps the position the feature kind buckets by (`FeatureKind.positions`: the position in
the draft round, or a node's depth − 1) and the trace columns of the kind's training-free baselines (`base`), so the
test report compares the head with them on the same rows. The trace splits are the dataset's prompt splits; `setup`
asserts no prompt_id sits in two of them. A conditional label scheme's row mask (`data_gen.labels.make_mask`:
on_path_given_parent keeps the nodes whose parent is on the path) drops the other rows from every split, so fitting,
calibration, the threshold and the test metrics see only the rows it labels; for node kinds the test split also keeps
all of its nodes (`data["test"]["nodes"]`: features, on_path, parent rows, baselines), for the report's two views of
a node head (eval.classifier.node_views).
"""

from __future__ import annotations

import logging

import lightning as L
import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

from data_gen.contract import HEAD_SPLITS as SPLITS
from data_gen.contract import trace_columns
from data_gen.labels import is_soft, make_labels, make_mask, make_weights, required_columns, weight_columns
from eval.metrics import baseline_columns
from models.features.spec import FeatureSpec, features_from_columns, needed_columns
from utils.cli import UserError

log = logging.getLogger(__name__)


class TraceDataModule(L.LightningDataModule):
    """Feature/label tensors per split from loaded traces (`{split: datasets.Dataset}`).

    imbalance: `pos_weight` (BCE weight n_neg/n_pos on positives, from train), `sampler` (class-balanced sampling
    of train rows) or `none`; `reject_weight` r (SpecDec++ uses 6) instead weights rejected rows r times accepted ones
    (BCE pos_weight 1/r), whatever the class balance. Normalisation (mean/std of the train features) is exposed as
    `mean`/`std` for the head.
    """

    def __init__(
        self,
        traces: dict,
        labels_cfg: DictConfig,
        spec: FeatureSpec,
        batch_size: int = 512,
        num_workers: int = 0,
        imbalance: str = "pos_weight",
        normalize: bool = True,
        seed: int = 0,
        reject_weight: float | None = None,
    ):
        super().__init__()
        if imbalance not in ("pos_weight", "sampler", "none"):
            raise UserError(f"data.imbalance='{imbalance}' is not one of: pos_weight, sampler, none")
        if reject_weight is not None and (float(reject_weight) <= 0 or imbalance == "sampler"):
            raise UserError(f"data.reject_weight={reject_weight}: give a weight > 0, and not with data.imbalance=sampler "
                            "(both reweight the classes)")
        self.reject_weight = None if reject_weight is None else float(reject_weight)
        self.traces = traces
        self.labels_cfg = labels_cfg
        self.spec = spec
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.imbalance = imbalance
        self.normalize = normalize
        self.seed = int(seed)
        self.data: dict[str, dict] = {}
        self.mean = torch.zeros(spec.dim)
        self.std = torch.ones(spec.dim)
        self.pos_weight = 1.0

    def setup(self, stage: str | None = None) -> None:
        if self.data:
            return
        missing = [s for s in SPLITS if s not in self.traces]
        if missing:
            raise UserError(f"no traces for split(s) {missing}; train needs train, validation and test")
        prompts = {split: self._split(split) for split in SPLITS}
        for i, a in enumerate(SPLITS):
            for b in SPLITS[i + 1 :]:
                both = prompts[a] & prompts[b]
                if both:
                    raise UserError(
                        f"prompt(s) {sorted(both)[:3]} appear in both the {a} and {b} traces; splits must be by prompt"
                    )
        x = self.data["train"]["x"]
        if self.normalize:
            self.mean, self.std = x.mean(0), x.std(0) if len(x) > 1 else torch.ones(x.shape[1])
            tok = self.spec.token_columns()  # [] for a kind without token-id columns
            self.mean[tok], self.std[tok] = 0.0, 1.0  # token ids are embedded by the head, never normalised
        y = self.data["train"]["y"]
        pos, n = float(y.sum()), float(len(y))
        self.pos_weight = (n - pos) / pos if pos > 0 and self.imbalance == "pos_weight" else 1.0
        if self.reject_weight is not None:
            self.pos_weight = 1.0 / self.reject_weight
        for split in SPLITS:
            yy = self.data[split]["y"]
            log.info("%s: %d rows, %.1f%% positive (labels >= 0.5)", split, len(yy), 100 * float((yy >= 0.5).float().mean()))

    def _columns(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """(every trace column a split's tensors read, the feature columns, the node views' columns)."""
        kind = self.spec.family
        feature_cols = needed_columns(self.spec)
        tree_cols = ("on_path", "node", "parent", "position") if kind.tree else ()  # the test report's node views
        needed = (tuple(required_columns(self.labels_cfg)) + feature_cols + tuple(kind.position_columns)
                  + weight_columns(self.labels_cfg) + baseline_columns(kind.baselines) + tree_cols + ("prompt_id",))
        return needed, feature_cols, tree_cols

    def _split(self, split: str) -> set:
        """Fill `self.data[split]` (x, y, pos, w, base; and the test split's `nodes`) from its traces; returns its
        prompt ids."""
        kind = self.spec.family
        needed, feature_cols, tree_cols = self._columns()
        ds = self.traces[split]
        if len(ds) == 0:
            raise UserError(f"the {split} split has no trace rows; raise limit= or check dataset= and its splits")
        names = ds.column_names if hasattr(ds, "column_names") else list(ds)
        lack = [c for c in feature_cols if c not in names]
        if lack:
            raise UserError(f"{self.spec.kind} features need trace column(s) {lack} missing from the {split} traces"
                            f"{_missing_hint(lack, names, kind.tree)}")
        cols = trace_columns(ds, [c for c in dict.fromkeys(needed) if c in names])
        labels = make_labels(cols, self.labels_cfg)
        weights = make_weights(cols, self.labels_cfg)
        x = features_from_columns(cols, self.spec)
        pos = torch.as_tensor(kind.positions(cols), dtype=torch.long)
        base = {c: cols[c] for c in baseline_columns(kind.baselines) if c in cols}
        mask = make_mask(cols, self.labels_cfg)  # None: every row is labelled
        if split == "test" and kind.tree and all(c in cols for c in tree_cols):
            from models.features.nodes import parent_rows

            self.data.setdefault(split, {})["nodes"] = {"x": x, "on_path": np.asarray(cols["on_path"]).astype(bool),
                                                        "parent_row": parent_rows(cols), "base": dict(base)}
        if mask is not None:
            if not mask.any():
                raise UserError(f"the {split} split has no rows that labels={self.labels_cfg.name} labels")
            keep = torch.as_tensor(mask)
            x, pos, labels, weights = x[keep], pos[keep], labels[mask], weights[mask]
            base = {c: v[mask] for c, v in base.items()}
        self.data.setdefault(split, {}).update({"x": x, "y": torch.as_tensor(labels, dtype=torch.float32), "pos": pos,
                                                "w": torch.as_tensor(weights, dtype=torch.float32), "base": base})
        return set(np.asarray(cols["prompt_id"]).tolist())

    def _loader(self, split: str, train: bool = False) -> DataLoader:
        d = self.data[split]
        ds = TensorDataset(d["x"], d["y"], d["w"])
        gen = torch.Generator().manual_seed(self.seed)
        sampler = None
        if train and self.imbalance == "sampler":
            hard = (d["y"] >= 0.5).long()
            counts = torch.bincount(hard, minlength=2).clamp_min(1).float()
            sampler = WeightedRandomSampler((1.0 / counts)[hard], num_samples=len(hard), replacement=True, generator=gen)
        return DataLoader(
            ds,
            batch_size=self.batch_size,
            shuffle=train and sampler is None,
            sampler=sampler,
            generator=gen if train and sampler is None else None,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self):
        return self._loader("train", train=True)

    def val_dataloader(self):
        return self._loader("validation")

    def test_dataloader(self):
        return self._loader("test")

    @property
    def soft_labels(self) -> bool:
        return is_soft(self.labels_cfg)


def _missing_hint(lack: list[str], names: list[str], tree: bool) -> str:
    """What to do about feature columns a split's traces lack: which traces or which head they call for."""
    hint = " (regenerate with trace.store_hidden=true)" if "draft_hidden" in lack else ""
    if set(lack) & {"target_margin", "context_token", "prompt_tokens"}:
        hint = (" (made before disco_plus features existed: regenerate them with python -m data_gen and the "
                "same settings plus overwrite=true, or delete the trace folder and rerun train)")
    if tree and "on_path" in names:  # tree traces of an older TREE_FORMAT (data_gen.tree_format)
        hint = (" (tree traces made before these node columns existed: regenerate them with python -m "
                "data_gen trace=tree and the same settings plus overwrite=true)")
    elif tree:
        hint = " (node heads read token-tree traces: trace=tree)"
    elif "on_path" in names:
        hint = " (these are token-tree traces: train a node head, model=c2t | tree_node, labels=on_path)"
    return hint
