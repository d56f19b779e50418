"""Views, permutes, concatenation and channel-wise linear layers on sharded tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_spatial import SpatialTensor, shard
from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd

LAYOUT_NAMES = list(LAYOUTS)

LOCAL_OPS = {  # keep every sharded dim whole: must run without a fallback
    "permute_linear_permute": lambda x, w: F.linear(x.permute(0, 2, 3, 1), w).permute(0, 3, 1, 2),
    "group_view": lambda x, w: x.view(x.shape[0], 2, 2, *x.shape[2:]).sum(2) * w.sum(),
    "reshape_minus_one": lambda x, w: x.reshape(-1, *x.shape[2:]) * w[0, 0],
    "transpose_mT": lambda x, w: x.transpose(2, 3).mT * w[0, 1],
    "unsqueeze_squeeze": lambda x, w: x.unsqueeze(2).squeeze(2).unsqueeze(-1).squeeze(-1) * w[0, 2],
    "cat_chunk_channels": lambda x, w: sum(torch.cat([x, x * 2], 1).chunk(4, dim=1)) * w[1, 0],
    "split_stack_unbind": lambda x, w: torch.stack(x.split([1, 3], 1)[1].unbind(1), 1) * w[1, 1],
    "movedim_expand": lambda x, w: x.movedim(1, -1).unsqueeze(1).expand(-1, 2, -1, -1, -1).sum(1) * w[1, 2],
    "flatten_channels": lambda x, w: x.view(2, 2, 2, *x.shape[2:]).flatten(1, 2) * w[2, 0],
    # the same arguments twice on different layouts (permutations are cached per layout and arguments)
    "permute_list_twice": lambda x, w: x.permute([0, 1, 3, 2]).permute([0, 1, 3, 2]) * w[2, 1],
    "movedim_keywords": lambda x, w: x.movedim(source=(1, 2), destination=(3, 1)) * w[2, 2],
    # merge the sharded dims into one token dim (tests/ops/test_tokens.py has more)
    "flatten_tokens": lambda x, w: F.linear(x.flatten(2).transpose(1, 2), w),
    "view_tokens": lambda x, w: x.view(x.shape[0], x.shape[1], -1) * w[0, 0],
}

GATHER_OPS = {  # cut a sharded dim: exact through the gather fallback
    "cat_width": lambda x, w: torch.cat([x, x], -1) * w[0, 1],
}


def _case(layout, name, ops, allow_fallback):
    torch.manual_seed(6)
    x, w = torch.randn(2, 4, 5, 19 if layout == "w3" else 8), torch.randn(3, 4)
    check(ops[name], [x, w], sharded=[0], axes=axes(layout), allow_fallback=allow_fallback)


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("name", list(LOCAL_OPS))
def test_shape_ops_stay_local(layout, name):
    run_spmd(_case, LAYOUTS[layout][0], layout, name, LOCAL_OPS, False)


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("name", list(GATHER_OPS))
def test_shape_ops_that_cut_a_sharded_dim_gather(layout, name):
    run_spmd(_case, LAYOUTS[layout][0], layout, name, GATHER_OPS, True)


def _layout_moves(layout):
    x = shard(torch.randn(2, 4, 6, 8), axes(layout))
    y = x.permute(0, 2, 3, 1)
    assert isinstance(y, SpatialTensor) and y.shape == (2, 6, 8, 4)
    assert {s.dim for s in y.shard_layout.shards} == {x_dim - 1 for x_dim in (s.dim for s in x.shard_layout.shards)}


@pytest.mark.parametrize("layout", ["w2", "2x2"])
def test_permute_moves_the_sharded_dims(layout):
    run_spmd(_layout_moves, LAYOUTS[layout][0], layout)
