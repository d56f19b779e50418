"""F.pad on sharded dims in every mode, including crops and pads wider than a shard."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd

LAYOUT_NAMES = list(LAYOUTS)

PADS = [(1, 1, 1, 1), (3, 0, 0, 2), (0, 5, 4, 1)]
MODES = [("constant", None), ("constant", 1.5), ("reflect", None), ("replicate", None), ("circular", None)]


def _case(layout, pad, mode, value):
    torch.manual_seed(12)
    x = torch.randn(2, 3, 9, 23 if layout == "w3" else 12)
    check(lambda x: F.pad(x, pad, mode=mode, value=value), [x], sharded=[0], axes=axes(layout))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("mode,value", MODES)
def test_pad(layout, pad, mode, value):
    run_spmd(_case, LAYOUTS[layout][0], layout, pad, mode, value)


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("pad", [(2, 3), (-1, 2, 1, -2), (-3, -4, 0, 0)])
def test_constant_pad_of_one_dim_and_crops(layout, pad):
    run_spmd(_case, LAYOUTS[layout][0], layout, pad, "constant", None)
