"""Max, average and adaptive pooling on 2, 3 uneven, height and 2x2 layouts against the single-process op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd

LAYOUT_NAMES = list(LAYOUTS)


def _case(layout, op, height=11, width=None):
    torch.manual_seed(4)
    width = width or (41 if layout == "w3" else 18)
    x = torch.randn(2, 3, height, width)
    check(op, [x], sharded=[0], axes=axes(layout))


# (kernel, stride, padding, dilation, ceil_mode)
MAX_POOL = [
    (3, 2, 1, 1, False),  # ResNet stem pool
    (2, 2, 0, 1, False),
    (3, 2, 0, 1, True),
    (3, 1, 1, 1, False),
    (3, 2, 1, 2, False),
    (2, 3, 1, 1, True),
    ((3, 2), (2, 1), (1, 0), 1, True),
]


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("kernel,stride,padding,dilation,ceil_mode", MAX_POOL)
@pytest.mark.parametrize("return_indices", [False, True])
def test_max_pool2d(layout, kernel, stride, padding, dilation, ceil_mode, return_indices):
    def op(x):
        return F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode, return_indices)

    run_spmd(_case, LAYOUTS[layout][0], layout, op)


@pytest.mark.parametrize("layout", ["w2", "2x2"])
def test_max_pool2d_module_default_stride(layout):
    run_spmd(_case, LAYOUTS[layout][0], layout, torch.nn.MaxPool2d(3, padding=1, ceil_mode=True))


# (kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
AVG_POOL = [
    (2, 2, 0, False, True, None),
    (3, 2, 1, False, True, None),
    (3, 2, 1, False, False, None),
    (3, 2, 1, True, True, None),
    (3, 2, 1, True, False, None),
    (3, 1, 1, False, False, None),
    (4, 3, 2, True, True, None),
    (3, 2, 1, False, True, 5),
    ((2, 3), (1, 2), (1, 1), True, False, None),
]


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("kernel,stride,padding,ceil_mode,count_include_pad,divisor_override", AVG_POOL)
def test_avg_pool2d(layout, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override):
    def op(x):
        return F.avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)

    run_spmd(_case, LAYOUTS[layout][0], layout, op)


ADAPTIVE_SIZES = [1, (1, 1), 3, (2, 5), (None, 4), (7, 2), (13, 23)]  # global, shards kept, larger than input


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("size", ADAPTIVE_SIZES)
def test_adaptive_avg_pool2d(layout, size):
    run_spmd(_case, LAYOUTS[layout][0], layout, lambda x: F.adaptive_avg_pool2d(x, size))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("size", ADAPTIVE_SIZES)
@pytest.mark.parametrize("return_indices", [False, True])
def test_adaptive_max_pool2d(layout, size, return_indices):
    run_spmd(_case, LAYOUTS[layout][0], layout, lambda x: F.adaptive_max_pool2d(x, size, return_indices))


def _global_pool_is_replicated(layout):
    from lightning_spatial import SpatialTensor, shard

    torch.manual_seed(0)
    x = shard(torch.randn(2, 3, 6, 10), axes(layout))
    for out in (F.adaptive_avg_pool2d(x, 1), F.adaptive_max_pool2d(x, (1, 1))):
        assert type(out) is torch.Tensor and not isinstance(out, SpatialTensor)
        assert out.shape == (2, 3, 1, 1)


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_global_pooling_returns_a_replicated_plain_tensor(layout):
    run_spmd(_global_pool_is_replicated, LAYOUTS[layout][0], layout)


@pytest.mark.parametrize("kind", ["max", "avg", "adaptive_avg", "adaptive_max"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_pool1d(kind, ranks):
    ops = {
        "max": lambda x: F.max_pool1d(x, 3, 2, 1, ceil_mode=True),
        "avg": lambda x: F.avg_pool1d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
        "adaptive_avg": lambda x: F.adaptive_avg_pool1d(x, 5),
        "adaptive_max": lambda x: F.adaptive_max_pool1d(x, 1),
    }
    run_spmd(_pool1d_case, ranks, ops[kind])


def _pool1d_case(op):
    from lightning_spatial.primitives import Axis

    torch.manual_seed(8)
    check(op, [torch.randn(2, 3, 23)], sharded=[0], axes={-1: Axis.from_group()})


@pytest.mark.parametrize("layout", ["w3", "2x2"])
@pytest.mark.parametrize("kind", ["max", "avg", "adaptive_avg", "adaptive_max"])
def test_pool3d(layout, kind):
    ops = {
        "max": lambda x: F.max_pool3d(x, 3, 2, 1, return_indices=True),
        "avg": lambda x: F.avg_pool3d(x, (1, 3, 3), 2, (0, 1, 1), ceil_mode=True),
        "adaptive_avg": lambda x: F.adaptive_avg_pool3d(x, (2, 1, 3)),
        "adaptive_max": lambda x: F.adaptive_max_pool3d(x, (1, 3, 1), return_indices=True),
    }
    run_spmd(_pool3d_case, LAYOUTS[layout][0], layout, ops[kind])


def _pool3d_case(layout, op):
    torch.manual_seed(6)
    check(op, [torch.randn(1, 2, 5, 8, 13)], sharded=[0], axes=axes(layout))
