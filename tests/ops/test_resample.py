"""F.interpolate / nn.Upsample over sharded dims: every mode, align_corners, scale factors and sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd

LAYOUT_NAMES = list(LAYOUTS)

RESIZES = [  # (size, scale_factor, recompute_scale_factor)
    (None, 2, None),
    (None, 1.5, None),
    (None, 0.7, None),
    (None, (2.3, 0.55), True),
    ((17, 29), None, None),
    ((4, 6), None, None),
]


def _case(layout, mode, align_corners, size, scale_factor, recompute, dtype=torch.float32):
    torch.manual_seed(9)
    x = torch.randn(2, 3, 9, 23 if layout == "w3" else 12, dtype=dtype)
    kwargs = {"align_corners": align_corners} if align_corners is not None else {}

    def op(x):
        return F.interpolate(
            x, size=size, scale_factor=scale_factor, mode=mode, recompute_scale_factor=recompute, **kwargs
        )

    check(op, [x], sharded=[0], axes=axes(layout))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize(
    "mode,align_corners",
    [
        ("nearest", None),
        ("nearest-exact", None),
        ("bilinear", False),
        ("bilinear", True),
        ("bicubic", False),
        ("bicubic", True),
        ("area", None),
    ],
)
@pytest.mark.parametrize("size,scale_factor,recompute", RESIZES)
def test_interpolate(layout, mode, align_corners, size, scale_factor, recompute):
    run_spmd(_case, LAYOUTS[layout][0], layout, mode, align_corners, size, scale_factor, recompute)


@pytest.mark.parametrize("layout", ["w3", "2x2"])
@pytest.mark.parametrize("mode,align", [("nearest", None), ("bilinear", False), ("bilinear", True), ("bicubic", False)])
@pytest.mark.parametrize("size,scale_factor,recompute", [RESIZES[1], RESIZES[4]])
def test_interpolate_in_float64_computes_coordinates_in_double(layout, mode, align, size, scale_factor, recompute):
    """torch computes a double tensor's source coordinates in double (float32 coordinates: errors of 5e-7)."""
    run_spmd(_case, LAYOUTS[layout][0], layout, mode, align, size, scale_factor, recompute, torch.float64)


def _upsample_module_case(layout):
    torch.manual_seed(10)
    up = torch.nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
    check(up, [torch.randn(1, 2, 6, 13 if layout == "w3" else 8)], sharded=[0], axes=axes(layout))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_upsample_module(layout):
    run_spmd(_upsample_module_case, LAYOUTS[layout][0], layout)


def _linear_1d_case(align_corners):
    from lightning_spatial.primitives import Axis

    torch.manual_seed(11)
    check(
        lambda x: F.interpolate(x, scale_factor=1.7, mode="linear", align_corners=align_corners),
        [torch.randn(2, 3, 20)],
        sharded=[0],
        axes={-1: Axis.from_group()},
    )


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("align_corners", [False, True])
def test_linear_1d(ranks, align_corners):
    run_spmd(_linear_1d_case, ranks, align_corners)


def _channels_last_case(layout, mode, align_corners):
    from lightning_spatial.tensor import SpatialTensor

    torch.manual_seed(12)
    x = torch.randn(2, 5, 9, 23 if layout == "w3" else 12).to(memory_format=torch.channels_last)

    def op(x):
        out = F.interpolate(x, scale_factor=1.5, mode=mode, align_corners=align_corners)
        local = out.to_local() if isinstance(out, SpatialTensor) else out
        assert local.is_contiguous(memory_format=torch.channels_last), local.stride()
        return out

    check(op, [x], sharded=[0], axes=axes(layout))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("mode,align_corners", [("nearest", None), ("bilinear", False)])
def test_interpolate_keeps_channels_last(layout, mode, align_corners):
    """A channels_last input resamples to a channels_last result, as torch's own kernels return it (what a
    following convolution reads without a copy)."""
    run_spmd(_channels_last_case, LAYOUTS[layout][0], layout, mode, align_corners)
