"""LightningModule for a stop head: BCE-with-logits (soft labels allowed), torchmetrics on val/test.

After each validation epoch the decision threshold is chosen on the validation scores (`threshold_mode=best_f1`,
via `eval.metrics.best_f1_threshold`) or kept fixed (`threshold_mode=fixed`); the checkpoint saved at that epoch
carries it, together with everything else decode needs (`on_save_checkpoint` → `checkpoint["specstop"]`).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torchmetrics import MetricCollection
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision, BinaryF1Score

from eval.metrics import best_f1_threshold, classification_metrics
from models.features.spec import FeatureSpec
from models.heads import CKPT_KEY, HeadBundle, build_head
from utils.cli import UserError


class StopHeadModule(L.LightningModule):
    def __init__(
        self,
        kind: str,
        spec: dict,
        arch: dict | None = None,
        labels: dict | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        pos_weight: float = 1.0,
        threshold_mode: str = "best_f1",
        threshold: float = 0.5,
        pair_id: str = "",
        tokenizer_hash: str = "",
        drafter: str = "student",
        mean: list | None = None,
        std: list | None = None,
        **spec_keys,
    ):
        """Built from `conf/model/<kind>.yaml` (its `_target_`) by the train job, which adds the feature spec sized
        from the traces, the labels and the fitted statistics. `spec_keys`: the yaml's feature-spec keys (`k`,
        `groups`, ...), already in `spec`; not hyperparameters of their own."""
        super().__init__()
        if threshold_mode not in ("best_f1", "fixed"):
            raise UserError(f"threshold_mode='{threshold_mode}' is not one of: best_f1, fixed")
        if isinstance(arch, DictConfig):  # as the yaml composed it; the checkpoint keeps a plain dict
            arch = OmegaConf.to_container(arch, resolve=True)
        if isinstance(labels, DictConfig):
            labels = OmegaConf.to_container(labels, resolve=True)
        self.save_hyperparameters(ignore=["mean", "std", *spec_keys])
        self.spec = FeatureSpec(**spec)
        self.head = build_head(kind, self.spec, arch)
        if mean is not None:
            self.head.set_normalization(torch.as_tensor(mean), torch.as_tensor(std))
        self.threshold = float(threshold)
        self.val_metrics = self._metrics("val/")
        self.test_metrics = self._metrics("test/")
        self._val_scores: list[torch.Tensor] = []
        self._val_labels: list[torch.Tensor] = []

    @staticmethod
    def _metrics(prefix: str) -> MetricCollection:
        return MetricCollection(
            {"auroc": BinaryAUROC(), "ap": BinaryAveragePrecision(), "f1_at_half": BinaryF1Score(threshold=0.5)},
            prefix=prefix,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)

    def _loss(self, logits, y, w=None):
        """BCE with logits (soft labels allowed), per-row weights w (labels.reach_weight) averaged as Σw·l / Σw."""
        pw = torch.tensor(self.hparams.pos_weight, device=logits.device)
        if w is None:
            return F.binary_cross_entropy_with_logits(logits, y, pos_weight=pw)
        per_row = F.binary_cross_entropy_with_logits(logits, y, pos_weight=pw, reduction="none")
        return (per_row * w).sum() / w.sum().clamp_min(1e-12)

    def training_step(self, batch, batch_idx):
        x, y, w = batch
        loss = self._loss(self(x), y, w)
        self.log("train/loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(y))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, w = batch
        logits = self(x)
        self.log("val/loss", self._loss(logits, y, w), on_epoch=True, prog_bar=True, batch_size=len(y))
        scores = torch.sigmoid(logits)
        self.val_metrics.update(scores, (y >= 0.5).long())
        self._val_scores.append(scores.detach().cpu())
        self._val_labels.append(y.detach().cpu())

    def on_validation_epoch_end(self):
        self.log_dict(self.val_metrics.compute(), prog_bar=True)
        self.val_metrics.reset()
        if not self._val_scores:
            return
        scores, labels = torch.cat(self._val_scores), torch.cat(self._val_labels)
        self._val_scores.clear()
        self._val_labels.clear()
        if self.hparams.threshold_mode == "best_f1":
            self.threshold, _ = best_f1_threshold(scores, labels)
        self.log("val/threshold", self.threshold)
        self.log("val/f1", classification_metrics(scores, labels, self.threshold)["f1"], prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y, w = batch
        logits = self(x)
        self.log("test/loss", self._loss(logits, y, w), on_epoch=True, batch_size=len(y))
        self.test_metrics.update(torch.sigmoid(logits), (y >= 0.5).long())

    def on_test_epoch_end(self):
        self.log_dict(self.test_metrics.compute())
        self.test_metrics.reset()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    def bundle(self) -> HeadBundle:
        """This module's head as decode will see it (same head object, eval mode not forced)."""
        h = self.hparams
        return HeadBundle(
            head=self.head,
            kind=h.kind,
            spec=self.spec,
            labels=dict(h.labels or {}),
            threshold=self.threshold,
            pair_id=h.pair_id,
            tokenizer_hash=h.tokenizer_hash,
            arch=dict(h.arch or {}),
            drafter=str(h.get("drafter", "student")),
        )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[CKPT_KEY] = self.bundle().meta()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        meta = checkpoint.get(CKPT_KEY) or {}
        self.threshold = float(meta.get("threshold", self.threshold))
