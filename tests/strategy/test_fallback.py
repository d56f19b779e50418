"""``SpatialParallelStrategy(fallback=...)``: an op without a spatial handler raises (naming the op, the module
path and the bytes it would gather), warns once, or gathers silently; the strategy's settings last for the run."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

from lightning_spatial import LayoutError, SpatialFallbackWarning, SpatialParallelStrategy, run
from tests.spmd import as_torchrun, run_spmd
from tests.strategy.lit import Images, LitModel, loader


class Cumprod(torch.nn.Module):
    """A product scan along the sharded width: no spatial handler, so it takes the gather fallback."""

    def forward(self, x):
        return x.cumprod(-1) / x.shape[-1]


def _fit(fallback: str) -> None:
    model = LitModel("segnet")
    model.model.head = torch.nn.Sequential(model.model.head, Cumprod())
    strategy = SpatialParallelStrategy(2, fallback=fallback)
    L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False, enable_progress_bar=False
    ).fit(model, loader(Images(4, 16, 24), 2))


def _modes():
    as_torchrun()  # Trainers run inside these ranks, one after the other
    message = (
        r"Tensor.cumprod in module 'model.head.1' \(Cumprod\) has no spatial handler, and fallbacks are errors .*: "
        r"it would gather [0-9.]+ (B|KiB|MiB) "
    )
    with pytest.raises(LayoutError, match=message):
        _fit("error")
    assert run.current() is run._RUNS[0], "the run outlived its Trainer"
    assert torch._dynamo.config.optimize_ddp is True, "dynamo's DDP graph splitting was left off"
    assert torch._dynamo.config.automatic_dynamic_shapes is True, "dynamo's automatic dynamic shapes were left off"
    assert run.current().fallback == "warn" and run.current().module_names == {}, "the run's settings leaked"
    for mode, expected in (("warn", 1), ("silent", 0)):  # 4 steps call the op; each run announces anew
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _fit(mode)
        fallbacks = [str(w.message) for w in caught if w.category is SpatialFallbackWarning]
        assert len(fallbacks) == expected, (mode, fallbacks)
        assert all("in module 'model.head.1' (Cumprod)" in m for m in fallbacks), fallbacks


def test_fallback_mode_error_warn_silent():
    run_spmd(_modes, 2)
