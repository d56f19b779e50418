"""ImageTask's batch check: a bad image or target fails on the host before any optimizer step, naming the field,
the sample and the fix (cross_entropy's own error names no field; on a GPU it is a device-side assert)."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import pytest
import torch

from lightning_spatial import SpatialParallelStrategy
from lightning_spatial.models import ImageTask
from tests.strategy.lit import Images


class NoOptimizerStep(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        raise AssertionError("an optimizer step ran on a bad batch")


def _batch(edit) -> dict[str, torch.Tensor]:
    data = Images(2, 32, 64, classes=4, seed=1)
    return edit({k: torch.stack([data[i][k] for i in range(2)]) for k in ("image", "label", "mask")})


def _fit(task: str, batch: dict, devices: int = 1, strategy="auto") -> ImageTask:
    torch.manual_seed(0)
    model = ImageTask("resnet18", task, num_classes=4)
    L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[NoOptimizerStep()],
    ).fit(model, torch.utils.data.DataLoader([batch], batch_size=None))
    return model


def _set(key: str, index: tuple, value) -> Callable[[dict], dict]:
    def edit(batch):
        batch[key][index] = value
        return batch

    return edit


CASES = {  # name -> (task, edit of a good batch, message)
    "label_of_no_class": (
        "classification",
        _set("label", (1,), 4),
        r"label of sample 1 holds 4, outside \[0, 4\): the model has num_classes=4 \(model.num_classes",
    ),
    "negative_mask_pixel": (
        "segmentation",
        _set("mask", (0, 5, 9), -1),
        r"mask of sample 0 holds -1, outside \[0, 4\)",
    ),
    "int32_labels": (
        "classification",
        lambda b: {**b, "label": b["label"].int()},
        r"label must be int64 \(2,\) to match the images, got torch.int32 \(2,\)",
    ),
    "mask_of_another_size": (
        "segmentation",
        lambda b: {**b, "mask": b["mask"][..., :32]},
        r"mask must be int64 \(2, 32, 64\) to match the images, got torch.int64 \(2, 32, 32\)",
    ),
    "uint8_images": (
        "classification",
        lambda b: {**b, "image": b["image"].mul(50).clamp(0, 255).to(torch.uint8)},
        r"image is torch.uint8 but the model's parameters are torch.float32: give torch.float32 images",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_batch_fails_before_any_optimizer_step(case):
    task, edit, message = CASES[case]
    with pytest.raises(ValueError, match=message):
        _fit(task, _batch(edit))


def test_ignored_mask_pixels_train():
    """-100 is cross_entropy's ignore_index: such a pixel counts for nothing, and is no error."""
    with pytest.raises(AssertionError, match="an optimizer step ran"):  # the step is reached
        _fit("segmentation", _batch(_set("mask", (1, 3, 4), -100)))


def test_each_rank_reads_its_own_part_of_a_sharded_mask():
    """The bad pixel lies in the right half, rank 1's shard under width 2: that rank raises before any step."""
    with pytest.raises(Exception, match=r"mask of sample 1 holds 9, outside \[0, 4\)"):
        _fit("segmentation", _batch(_set("mask", (1, 30, 60), 9)), 2, SpatialParallelStrategy(2, start_method="fork"))
