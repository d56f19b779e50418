"""DDP stays quiet under spatial_tp: a depthwise weight's gradient from a channels_last convolution has other
strides than the weight on its size-1 dim (the same memory); the strategy hands DDP the weight's strides, so
no "Grad strides do not match bucket view strides" warning (and no copy) on every depthwise layer."""

from __future__ import annotations

import warnings

import lightning as L

from lightning_spatial import SpatialParallelStrategy
from tests.spmd import as_torchrun, run_spmd
from tests.strategy.lit import Images, LitModel, loader


def _quiet():
    as_torchrun()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=SpatialParallelStrategy(2),
            max_epochs=1,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
        ).fit(LitModel("convnext_atto"), loader(Images(4, 32, 64), 2))
    noise = [str(w.message) for w in caught if "Grad strides do not match" in str(w.message)]
    assert not noise, noise[0]


def test_no_grad_stride_warnings_from_ddp():
    run_spmd(_quiet, 2)
