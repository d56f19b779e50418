"""Trainer(strategy="spatial_tp") reaches the single-device weights on the same global batch."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_spatial import SpatialParallelStrategy
from tests.oracle import assert_rel_close
from tests.strategy.lit import Images, LitModel, loader

STEPS = 3


def fit(model, strategy, devices, data, batch_size, **trainer_kwargs):
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, deterministic=False, **trainer_kwargs,
    )
    trainer.fit(model, loader(data, batch_size))
    return trainer


def single_device(name, data, batch):
    model = LitModel(name)
    fit(model, "auto", 1, data, batch)
    return model


def assert_same_weights(ours, reference, tolerance=1e-4):
    for (key, expected), actual in zip(reference.state_dict().items(), ours.state_dict().values()):
        if expected.is_floating_point():
            err = (actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)
            assert err <= tolerance, f"{key}: relative difference {err:.2e}"
        else:
            assert torch.equal(actual, expected), key


CASES = [  # (model, spatial_size, shard_dim, devices, sync_batchnorm, height, width)
    ("convnext_atto", 2, "width", 2, False, 32, 64),
    ("convnext_atto", 3, "width", 3, False, 32, 96),
    ("convnext_atto", 2, "height", 2, False, 64, 32),
    ("convnext_atto", (2, 2), "width", 4, False, 64, 64),
    ("resnet18", 2, "width", 2, False, 32, 64),
    ("resnet18", (2, 2), "width", 4, False, 64, 64),
    ("segnet", 2, "width", 2, False, 16, 24),
    ("segnet", 3, "height", 3, False, 26, 16),  # uneven: 9, 9, 8 rows
    ("segnet", (2, 2), "width", 4, False, 16, 20),
    ("segnet", 2, "width", 4, True, 16, 24),  # data x spatial: 2 replicas of 2 ranks, BatchNorm synced
    ("convnext_atto", 2, "width", 4, False, 32, 64),  # data x spatial without BatchNorm
]


@pytest.mark.slow
@pytest.mark.parametrize("name,spatial,shard_dim,devices,sync_bn,height,width", CASES)
def test_spatial_training_matches_single_device(name, spatial, shard_dim, devices, sync_bn, height, width):
    data = Images(4, height, width)
    reference = single_device(name, data, 4)
    data_size = devices // (spatial if isinstance(spatial, int) else spatial[0] * spatial[1])
    ours = LitModel(name)
    strategy = SpatialParallelStrategy(spatial, shard_dim, start_method="fork")
    fit(ours, strategy, devices, data, 4 // data_size, sync_batchnorm=sync_bn)
    assert_same_weights(ours, reference)
