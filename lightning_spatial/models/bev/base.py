"""What the three BEV detectors share as LightningModules: steps, logging, the optional metric, the optimizer.

A subclass calls ``save_hyperparameters(ignore=["metric"])`` (with ``lr``, ``weight_decay``, ``warmup_steps`` and
``backbone_lr_mult`` among its arguments), builds ``self.encoder`` (an ``ImageEncoder``) and ``self.head``
(``loss(outputs, boxes, labels) -> dict`` whose "loss" entry is the total, ``decode(outputs) -> list of
{"boxes", "scores", "labels"}``) and defines ``forward(batch) -> outputs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import lightning as L
import torch
import torchmetrics

NUSCENES_RANGE = (-51.2, -51.2, -5.0, 51.2, 51.2, 3.0)
TARGETS = ("boxes", "labels", "attributes", "ignore_regions")  # the batch's per-sample lists the metric reads


class BEVDetector(L.LightningModule):
    TINY: ClassVar[dict[str, Any]] = {}  # a configuration for CPU tests, trained in seconds

    def __init__(self, metric: torchmetrics.Metric | None):
        super().__init__()
        # e.g. lightning_spatial.metrics.NuScenesDetection: update(preds, targets) with one dict per sample.
        self.val_metric = metric

    @classmethod
    def tiny(cls, **overrides):
        return cls(**{**cls.TINY, **overrides})

    def loss(self, outputs, batch) -> dict[str, torch.Tensor]:
        return self.head.loss(outputs, batch["boxes"], batch["labels"], self.mean_over_replicas)

    def mean_over_replicas(self, count: torch.Tensor) -> torch.Tensor:
        """A loss normaliser (the batch's box count) averaged over data-parallel replicas, as DETR does: their
        averaged gradients then equal one device's on the whole batch. Alone (no Trainer) and outside training: the
        count itself. Validation needs no gradients, and its replicas run different numbers of batches (unpadded
        sampling, docs/design.md): a collective per step there would wait forever for the replica that is done."""
        trainer = self._trainer
        if trainer is None or trainer.world_size == 1 or not trainer.training:
            return count
        return trainer.strategy.reduce(count.float(), reduce_op="mean")

    def decode(self, outputs) -> list[dict[str, torch.Tensor]]:
        return self.head.decode(outputs)

    def _step(self, batch, stage: str):
        outputs = self(batch)
        losses = self.loss(outputs, batch)
        size = batch["images"].shape[0]
        # per-step training values stay rank-local (Lightning's default): syncing them is a collective per value
        # per step, and Horovod's blocks the host until the forward has run; validation syncs once per epoch
        sync = stage != "train"
        self.log_dict({f"{stage}_{k}": v for k, v in losses.items()}, batch_size=size, sync_dist=sync)
        return outputs, losses["loss"]

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")[1]

    def validation_step(self, batch, batch_idx):
        outputs, _ = self._step(batch, "val")
        if self.val_metric is not None:
            keys = [key for key in TARGETS if key in batch]
            targets = [dict(zip(keys, values)) for values in zip(*(batch[key] for key in keys))]
            self.val_metric.update(self.decode(outputs), targets)

    def on_validation_epoch_end(self):
        if self.val_metric is None:
            return
        result = self.val_metric.compute()  # the same on every rank: syncing is a no-op that silences Lightning
        scalars = {f"val_{k}": v for k, v in result.items() if torch.as_tensor(v).numel() == 1}
        self.log_dict(scalars, sync_dist=True)
        self.val_metric.reset()

    def predict_step(self, batch, batch_idx):
        return self.decode(self(batch))

    def configure_optimizers(self):
        lr, mult = self.hparams.lr, self.hparams.backbone_lr_mult
        backbone = list(self.encoder.backbone.parameters())
        mine = {id(p) for p in backbone}
        groups = [{"params": [p for p in self.parameters() if id(p) not in mine]}]
        groups.append({"params": backbone, "lr": lr * mult})  # PETR's recipe: 0.1 for a pretrained backbone
        optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=self.hparams.weight_decay)
        warmup = self.hparams.warmup_steps
        if not warmup:
            return optimizer
        # a linear ramp over the first steps (PETR's recipe): a transformer decoder trained from scratch at full
        # rate from step 0 can diverge in bf16
        ramp = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": ramp, "interval": "step"}}


def as_range(point_cloud_range: Sequence[float]) -> tuple[float, ...]:
    """Hydra passes lists; the grid wants a hashable tuple."""
    return tuple(float(v) for v in point_cloud_range)
