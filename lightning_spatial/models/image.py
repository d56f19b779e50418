"""A timm backbone trained for image classification or dense segmentation: the recipes' main module.

It is an ordinary LightningModule; under ``strategy="spatial_tp"`` its activations are sharded without any
change here. Weights: ``pretrained=False`` by default (no hub is reachable); pass ``checkpoint_path`` to
load local timm weights (a ``.safetensors``/``.pth`` file for the same architecture).
"""

from __future__ import annotations

import os
from typing import Literal

import lightning as L
import timm
import torch
import torch.nn.functional as F
import torchmetrics

from .._arguments import integers, numbers, positive
from ..tensor import unwrap
from .optim import adamw

TASKS = ("classification", "segmentation")
IGNORED = -100  # F.cross_entropy's ignore_index: a target pixel that counts for nothing
OPTIMIZERS = ("adamw", "sgd")


class ImageTask(L.LightningModule):
    def __init__(
        self,
        backbone: str = "convnext_atto",
        task: Literal["classification", "segmentation"] = "classification",
        num_classes: int = 3,
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        optimizer: Literal["adamw", "sgd"] = "adamw",
        checkpoint_path: str | None = None,
        grad_checkpointing: bool = False,
    ):
        super().__init__()
        _check_choice("task", task, TASKS)
        _check_choice("optimizer", optimizer, OPTIMIZERS)
        integers(1, num_classes=num_classes)
        positive(lr=lr)
        numbers(0, weight_decay=weight_decay)
        self.save_hyperparameters()
        overlay = _weights_overlay(backbone, checkpoint_path, task) if checkpoint_path else None
        common = {"pretrained": checkpoint_path is not None, "pretrained_cfg_overlay": overlay}
        if task == "classification":
            self.backbone = timm.create_model(backbone, num_classes=num_classes, **common)
            self.head = None
        else:
            self.backbone = timm.create_model(backbone, features_only=True, out_indices=(-1,), **common)
            self.head = torch.nn.Conv2d(self.backbone.feature_info.channels()[-1], num_classes, 1)
        if grad_checkpointing:
            self.backbone.set_grad_checkpointing(True)
        metric = torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro")
        self.train_accuracy, self.val_accuracy = metric.clone(), metric.clone()

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if image.dtype != self.dtype:
            raise ValueError(
                f"image is {image.dtype} but the model's parameters are {self.dtype}: give {self.dtype} images "
                "(normalised; Trainer(precision=...) converts a batch to its dtype)"
            )
        if self.head is None:
            return self.backbone(image)
        features = self.backbone(image)[-1]
        return F.interpolate(self.head(features), size=image.shape[-2:], mode="bilinear", align_corners=False)

    def on_before_batch_transfer(self, batch: dict[str, torch.Tensor], dataloader_idx: int) -> dict[str, torch.Tensor]:
        """The targets checked on the host, before they go to the device (reading them there would wait for the
        device every step): int64 (B,) labels or (B, H, W) masks in [0, num_classes) (-100: cross_entropy's ignored
        value). Of a sharded mask this rank reads its own part. (``forward`` checks the image's dtype: in the
        automatic plan's probe this hook meets the batch before the Trainer converts the module's precision.)"""
        image = batch["image"]
        key = "label" if self.head is None else "mask"
        if key in batch:  # not in prediction
            expected = (image.shape[0],) if self.head is None else (image.shape[0], *image.shape[-2:])
            _check_target(key, batch[key], expected, self.hparams.num_classes)
        return batch

    def _step(self, batch, stage: str, accuracy: torchmetrics.Metric):
        logits = self(batch["image"])
        target = batch["label"] if self.head is None else batch["mask"]
        loss = F.cross_entropy(logits, target)
        # training values rank-local per step, validation synced per epoch (why: models/bev/base.py)
        self.log(f"{stage}_loss", loss, sync_dist=stage != "train", prog_bar=True)
        if self.head is None:
            accuracy(logits, target)
            self.log(f"{stage}_acc", accuracy, prog_bar=True)
        return loss

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train", self.train_accuracy)

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val", self.val_accuracy)

    def predict_step(self, batch, batch_idx):
        return self(batch["image"])

    def configure_optimizers(self):
        h = self.hparams
        if h.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=h.lr, momentum=0.9, weight_decay=h.weight_decay)
        return adamw(self.parameters(), lr=h.lr, weight_decay=h.weight_decay)


def _check_target(key: str, target: torch.Tensor, shape: tuple[int, ...], num_classes: int) -> None:
    if target.dtype != torch.int64 or tuple(target.shape) != shape:
        raise ValueError(f"{key} must be int64 {shape} to match the images, got {target.dtype} {tuple(target.shape)}")
    local = unwrap(target)[0]
    outside = ((local < 0) | (local >= num_classes)) & (local != IGNORED)
    if outside.any():
        where = outside.nonzero()[0].tolist()
        raise ValueError(
            f"{key} of sample {where[0]} holds {local[tuple(where)].item()}, outside [0, {num_classes}): the model has "
            f"num_classes={num_classes} (model.num_classes: the data's class count, background included for masks)"
        )


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _weights_overlay(backbone: str, path: str, task: str) -> dict:
    """timm keeps a checkpoint's classifier only when its size equals the pretrained config's ``num_classes``
    (else it drops it), so tell timm the file's size: a fine-tuned head of our size loads, an ImageNet head
    of another size is dropped."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint_path {path!r} is not a file (local timm weights: .safetensors or .pth)")
    overlay = {"file": path}
    classifier = getattr(timm.models.get_pretrained_cfg(backbone), "classifier", None)
    if task == "classification" and isinstance(classifier, str):
        weight = timm.models.load_state_dict(path).get(f"{classifier}.weight")
        if weight is not None:
            overlay["num_classes"] = weight.shape[0]
    return overlay
