"""Trainer(strategy="spatial_tp") reaches the single-device weights on the same global batch."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_spatial import SpatialParallelStrategy
from tests.strategy.lit import Images, LitModel, loader

STEPS = 3


def fit(model, strategy, devices, data, batch_size, **trainer_kwargs):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=False,
        **trainer_kwargs,
    )
    L.seed_everything(1234)  # the same random stream (dropout) for the reference and every rank
    trainer.fit(model, loader(data, batch_size))
    return trainer


def single_device(name, data, batch):
    model = LitModel(name)
    fit(model, "auto", 1, data, batch)
    return model


def assert_same_weights(ours, reference, tolerance=1e-4, zero_floor=0.0):
    """Relative max difference per tensor. Tensors that single-device training leaves at zero up to
    rounding (max |w| <= zero_floor: e.g. a BatchNorm bias whose true gradient is exactly zero because the
    next layer is conv + BatchNorm) hold only rounding noise; they must stay below the floor in ours too."""
    for (key, expected), actual in zip(reference.state_dict().items(), ours.state_dict().values()):
        if not expected.is_floating_point():
            assert torch.equal(actual, expected), key
        elif expected.abs().max() <= zero_floor:
            assert actual.abs().max() <= zero_floor, f"{key}: {actual.abs().max():.2e} should stay ~0"
        else:
            err = (actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)
            assert err <= tolerance, f"{key}: relative difference {err:.2e}"


CASES = [  # (model, spatial_size, shard_dim, devices, sync_batchnorm, height, width); fp32, relative 1e-4
    ("convnext_atto", 2, "width", 2, False, 32, 64),
    ("convnext_atto", 3, "width", 3, False, 32, 96),
    ("convnext_atto", 2, "height", 2, False, 64, 32),
    ("convnext_atto", (2, 2), "width", 4, False, 64, 64),
    ("resnet18", 2, "width", 2, False, 32, 64),
    ("convnextv2_atto", 2, "width", 2, False, 32, 64),  # GlobalResponseNorm
    ("regnety_002", 2, "width", 2, False, 32, 64),  # squeeze-excitation gates, BatchNorm
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


@pytest.mark.slow
def test_efficientnet_matches_single_device_in_float64():
    """EfficientNet-B0 at test sizes is ill-conditioned: BatchNorm over 8 values per channel at the last
    stage, and BatchNorm biases with exactly zero true gradient. One device alone, fed the same batch in
    another order, moves conv_stem by 1.8e-3 (fp32) after 3 steps, so fp32 cannot show exactness at 1e-4
    here. In float64 ours agrees with one device to ~1e-11 (a manual loop shows it). The fork launcher hands
    the trained float64 weights back into this process's float32 model, so both sides are rounded to
    float32 once: we assert 2 float32 ulps (2e-7), 500 times tighter than fp32 conditioning allows."""
    data = Images(4, 64, 32)
    reference = LitModel("efficientnet_b0")
    fit(reference, "auto", 1, data, 4, precision="64-true")
    ours = LitModel("efficientnet_b0")
    fit(
        ours,
        SpatialParallelStrategy(2, "height", start_method="fork"),
        2,
        data,
        4,
        precision="64-true",
        use_distributed_sampler=False,
    )  # the same sample order as the reference
    assert_same_weights(ours, reference.float(), tolerance=2e-7, zero_floor=1e-12)
