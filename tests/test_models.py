"""Contract test over timm model families: forward, input gradient, every parameter's gradient and every
buffer (BatchNorm running statistics) of the unchanged model on shards equal the single-process model's, and
no op falls back to gathering (every op runs spatially).

float64 with a float64 tolerance (``oracle.RTOL_FLOAT64``), so that ill-conditioned BatchNorm statistics at
these tiny sizes cannot hide a real error."""

from __future__ import annotations

import copy

import pytest
import timm
import torch

from lightning_spatial import SpatialTensor
from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd

MODELS = [
    "convnext_atto",
    "convnextv2_atto",
    "resnet18",
    "resnet50d",
    "regnetx_002",
    "regnety_002",
    "efficientnet_b0",
    "mobilenetv3_small_100",
]


def _case(layout, name, train):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=5).double().train(train)
    models = {False: model, True: copy.deepcopy(model)}  # BatchNorm buffers: one copy per side
    x = torch.randn(2, 3, 64, 96 if layout == "w3" else 64, dtype=torch.float64)
    check(
        lambda x: models[isinstance(x, SpatialTensor)](x),
        [x],
        sharded=[0],
        axes=axes(layout),
        modules=(models[False], models[True]),
    )


@pytest.mark.slow
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("layout", ["w2", "2x2"])
@pytest.mark.parametrize("name", MODELS)
def test_timm_model_runs_spatially_and_exactly(name, layout, train):
    run_spmd(_case, LAYOUTS[layout][0], layout, name, train)
