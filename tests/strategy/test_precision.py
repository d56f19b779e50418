"""Every Lightning precision plugin runs the standard loop (training, validation, logging, progress bar,
checkpointing) on sharded batches without one gather fallback: metadata questions such as Lightning's
``torch.is_floating_point(batch)`` answer from the shard and its layout."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision

from lightning_spatial import SpatialFallbackWarning, SpatialParallelStrategy, SpatialTensor
from tests.strategy.lit import Images, LitModel, loader

STEPS = 2


class FallbacksAreErrors(L.Callback):
    """Inside every rank: a fallback raises (the warning as an error, beside the strategy's fallback="error"), and
    the batches really are sharded."""

    def setup(self, trainer, pl_module, stage):
        warnings.filterwarnings("error", category=SpatialFallbackWarning)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        assert isinstance(batch["image"], SpatialTensor) and isinstance(batch["mask"], SpatialTensor)

    def on_train_end(self, trainer, pl_module):
        assert trainer.global_step == STEPS


def _precision(name: str) -> dict:
    """Trainer arguments. On CPU Lightning reads "16-mixed" as bf16: fp16 autocast with a gradient scaler is
    asked for as an explicit plugin."""
    if name == "16-mixed":
        return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}
    return {"precision": name}


@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true"])
def test_every_precision_plugin_trains_without_a_fallback(precision, tmp_path):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SpatialParallelStrategy(2, "width", fallback="error", start_method="fork"),
        max_steps=STEPS,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path),
        default_root_dir=tmp_path,
        callbacks=[FallbacksAreErrors()],
        **_precision(precision),
    )
    trainer.fit(LitModel("segnet"), loader(Images(4, 16, 24), 2), loader(Images(2, 16, 24, seed=1), 2))
    assert list(tmp_path.rglob("*.ckpt")) and list(tmp_path.rglob("metrics.csv"))
