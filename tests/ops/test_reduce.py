"""Reductions and softmax over sharded, unsharded and all dims."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_spatial.primitives import Axis, DimShard, Layout
from lightning_spatial.tensor import wrap
from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd

LAYOUT_NAMES = list(LAYOUTS)

OPS = {
    "sum_w": lambda x: x.sum(-1),
    "sum_hw_keepdim": lambda x: torch.sum(x, (2, 3), keepdim=True),
    "sum_all": lambda x: x.sum(),
    "sum_channels": lambda x: x.sum(1),  # unsharded: local, the layout shifts
    "mean_hw": lambda x: x.mean((-2, -1)),
    "mean_all": lambda x: torch.mean(x),
    "amax_w": lambda x: x.amax(-1),
    "amin_hw": lambda x: torch.amin(x, (2, 3), keepdim=True),
    "var_hw": lambda x: x.var((2, 3)),
    "var_w_biased": lambda x: torch.var(x, -1, correction=0, keepdim=True),
    "std_all": lambda x: x.std(),
    "norm2_hw": lambda x: x.norm(p=2, dim=(2, 3), keepdim=True),
    "vector_norm_1": lambda x: torch.linalg.vector_norm(x, 1, dim=(-1, -2)),
    "vector_norm_inf": lambda x: torch.linalg.vector_norm(x, math.inf, dim=-1),
    "vector_norm_3": lambda x: torch.linalg.vector_norm(x, 3, dim=(1, 2, 3)),
    "logsumexp_hw": lambda x: torch.logsumexp(x, (2, 3)),
    "softmax_w": lambda x: F.softmax(x, dim=-1),
    "softmax_h": lambda x: x.softmax(-2),
    "log_softmax_w": lambda x: torch.log_softmax(x, -1),
    "softmax_channels": lambda x: F.softmax(x, dim=1),
    "var_unbiased_positional": lambda x: x.var(False),  # a bool is unbiased, not a dim
    "std_unbiased_positional": lambda x: torch.std(x, False),
    "vector_norm_0": lambda x: torch.linalg.vector_norm(x, 0, dim=(-1, -2)),  # a (zero) gradient, as torch's
    "all_finite": lambda x: torch.isfinite(x).all(),
    "any_w": lambda x: (x > 1).any(-1),
    "max_w": lambda x: x.max(-1),  # values (gradient to the chosen element) and global indices
    "min_h_keepdim": lambda x: torch.min(x, 2, keepdim=True),
    "max_channels": lambda x: x.max(1),
    "max_all": lambda x: x.max(),
    "max_pair": lambda x: torch.max(x, x * 0.5),
    "argmax_w": lambda x: x.argmax(-1),
    "argmin_all": lambda x: torch.argmin(x),
    "argmax_channels": lambda x: x.argmax(1),
    "argmax_all_keepdim": lambda x: x.argmax(keepdim=True),
    # a reduced operand broadcasts back against the shards (2x2: sharded along one dim only, size 1 along the other)
    "centre_rows": lambda x: x - x.mean(-1, keepdim=True),
    "over_column_max": lambda x: x.amax(-2, keepdim=True) / x.abs().add(1),
}


def _case(layout, name):
    torch.manual_seed(5)
    x = torch.randn(2, 3, 7, 23 if layout == "w3" else 10)
    check(OPS[name], [x], sharded=[0], axes=axes(layout))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("name", list(OPS))
def test_reduction(layout, name):
    run_spmd(_case, LAYOUTS[layout][0], layout, name)


def test_bad_reductions_raise_torchs_error_before_any_communication():
    x = wrap(torch.randn(2, 3, 4, 5), Layout((DimShard(-1, Axis((0, 1), 0), 10),)))  # no group: messages fail
    with pytest.raises(IndexError, match=r"Dimension out of range \(expected to be in range of \[-4, 3\], but got 4\)"):
        x.sum(4)
    with pytest.raises(RuntimeError, match="dim 3 appears multiple times in the list of dims"):
        x.amax((3, -1))
    with pytest.raises(RuntimeError, match="mean\\(\\): could not infer output dtype"):
        x.long().mean(-1)
