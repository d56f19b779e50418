"""What the BEV detectors share as LightningModules: steps, logging, the optional metric, the optimizer.

A subclass calls ``save_hyperparameters(ignore=["metric"])`` (with ``lr``, ``weight_decay``, ``warmup_steps``,
``backbone_lr_mult``, ``num_classes`` and ``point_cloud_range`` among its arguments) and ``check_arguments`` on
them, builds ``self.encoder`` (an ``ImageEncoder``) and ``self.head`` (``loss(outputs, boxes, labels) -> dict``
whose "loss" entry is the total, ``decode(outputs) -> list of {"boxes", "scores", "labels"}``) and defines
``forward(batch) -> outputs``, which starts with ``self.check_batch(batch)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import lightning as L
import torch
import torchmetrics

from ..._arguments import integers, numbers, positive, sizes
from ..optim import adamw
from .batch import check_contents, check_shapes
from .bev_encoder import check_bev_encoder

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

    def check_batch(self, batch: dict[str, Any]) -> None:
        """``forward``'s check: shapes and the images' dtype against the parameters'; while the batch is on the CPU
        (reading it waits for no device) its values too. Raises ValueError naming the field and the sample."""
        temporal = self.hparams.get("temporal", False)
        check_shapes(batch, temporal, self.dtype)
        if batch["lidar2img"].device.type == "cpu":
            check_contents(batch, self.hparams.num_classes, temporal)

    def on_before_batch_transfer(self, batch: dict[str, Any], dataloader_idx: int) -> dict[str, Any]:
        """Every batch's shapes and values checked on the host, before a step trains on it: calibration, boxes,
        labels against ``num_classes`` (``batch.py``). Not the images' dtype: in the automatic plan's probe this
        hook meets the batch in the precision's dtype before the Trainer converts the module (``forward`` checks
        it)."""
        temporal = self.hparams.get("temporal", False)
        check_shapes(batch, temporal)
        check_contents(batch, self.hparams.num_classes, temporal)
        return batch

    def loss(self, outputs, batch) -> dict[str, torch.Tensor]:
        return self.head.loss(outputs, batch["boxes"], batch["labels"], self.mean_over_replicas)

    def mean_over_replicas(self, count: torch.Tensor) -> torch.Tensor:
        """A loss normaliser (the batch's box count) averaged over data-parallel replicas, as DETR does: their
        averaged gradients then equal one device's on the whole batch. Alone (no Trainer) and outside training: the
        count itself. Validation needs no gradients, and its replicas run different numbers of batches (unpadded
        sampling, docs/design.md): a collective per step there would wait forever for the replica that is done. Set
        up by Fabric: averaged while the module trains (``fabric.all_reduce``, over the data replicas under
        ``spatial_tp``)."""
        fabric = self._fabric
        if fabric is not None:
            averaged = self.training and fabric.world_size > 1
            return fabric.all_reduce(count.float(), reduce_op="mean") if averaged else count
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
        optimizer = adamw(groups, lr=lr, weight_decay=self.hparams.weight_decay)
        warmup = self.hparams.warmup_steps
        if not warmup:
            return optimizer
        # a linear ramp over the first steps (PETR's recipe): a transformer decoder trained from scratch at full
        # rate from step 0 can diverge in bf16
        ramp = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": ramp, "interval": "step"}}


def as_range(point_cloud_range: Sequence[float]) -> tuple[float, ...]:
    """Hydra passes lists; the grid wants a hashable tuple. A range that holds no box raises."""
    r = tuple(float(v) for v in point_cloud_range)
    if len(r) != 6 or not all(low < high for low, high in zip(r[:3], r[3:])):
        raise ValueError(
            f"point_cloud_range must be [x0, y0, z0, x1, y1, z1] (metres) with x0 < x1, y0 < y1, z0 < z1, got "
            f"{list(point_cloud_range)}"
        )
    return r


# argument -> the smallest value it takes; counts that may be empty (no queries, no detections) start at 0
_AT_LEAST = dict(
    num_classes=1, embed_dims=1, num_layers=1, num_heads=1, ffn_dims=1, depth_bins=1, context_channels=1,
    bev_channels=1, bev_layers=1, head_channels=1, z_bins=1, num_queries=0, denoise_groups=0, max_detections=0,
    warmup_steps=0, encoder_layers=1, z_anchors=1, sca_points=1, tsa_points=1, num_cameras=1,
)  # fmt: skip


def check_arguments(hparams: Mapping[str, Any]) -> None:
    """A detector's constructor arguments (its ``hparams``), each checked by name; raises naming the argument."""
    for name, minimum in _AT_LEAST.items():
        if name in hparams:
            integers(minimum, **{name: hparams[name]})
    positive(lr=hparams["lr"])
    numbers(0, weight_decay=hparams["weight_decay"], backbone_lr_mult=hparams["backbone_lr_mult"])
    if not 0 <= hparams.get("dropout", 0) < 1:
        raise ValueError(f"dropout must be in [0, 1), got {hparams['dropout']!r}")
    depth = hparams.get("depth_range")
    if depth is not None and (len(depth) != 2 or not 0 < depth[0] < depth[1]):
        raise ValueError(f"depth_range must be (near, far) metres with 0 < near < far, got {list(depth)}")
    if "bev_size" in hparams:
        sizes("bev_size", hparams["bev_size"])
    if "bev_encoder" in hparams:
        check_bev_encoder(hparams["bev_encoder"], hparams["bev_size"])
    as_range(hparams["point_cloud_range"])
