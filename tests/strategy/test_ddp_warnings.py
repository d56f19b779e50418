"""DDP stays quiet under spatial_tp: a depthwise weight's gradient from a channels_last convolution has other
strides than the weight on its size-1 dim (the same memory); the strategy hands DDP the weight's strides, so
no "Grad strides do not match bucket view strides" warning (and no copy) on every depthwise layer. And on a GPU
no "AccumulateGrad node's stream does not match" from every backward: DDP is built on the training's stream."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import lightning as L
import pytest
import torch

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


_FIT_ON_ONE_GPU = """
import warnings
import lightning as L
from lightning_spatial import SpatialParallelStrategy
from tests.strategy.lit import Images, LitModel, loader
warnings.filterwarnings("error", message="The AccumulateGrad node's stream does not match")
trainer = L.Trainer(accelerator="gpu", devices=1, strategy=SpatialParallelStrategy(1), max_epochs=1, logger=False,
                    enable_progress_bar=False, enable_checkpointing=False)
trainer.fit(LitModel("convnext_atto"), loader(Images(4, 32, 64), 2))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams need a GPU")
def test_no_stream_mismatch_warning_from_ddp_on_a_gpu():
    """A fresh process: torch gives that warning once per process, and an earlier test may have spent it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _FIT_ON_ONE_GPU], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
