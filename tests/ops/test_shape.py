"""Views, permutes, concatenation and channel-wise linear layers on sharded tensors; replicated operands of the
global size joining sharded ones (an upsampled 1x1 map, as in DeepLabV3's ASPP pooling)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_spatial import SpatialTensor, shard
from tests.ops.cases import raises_like_one_device
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
    # numpy's ``axis=`` (torch's parser maps it to ``dim``)
    "stack_chunk_unbind_axis": lambda x, w: torch.stack(x.chunk(2, axis=1)[1].unbind(axis=1), axis=1) * w[0, 0],
    "unbind_channels_last": lambda x, w: torch.stack(x.permute(0, 2, 3, 1).unbind(-1), 1) * w[0, 0],
    # replicated operands of the global size take this rank's rows: never a gather
    "cat_aspp_pooling": lambda x, w: torch.cat([x, _upsampled(x.mean((2, 3), keepdim=True) * w[0, 0], x)], 1),
    "cat_replicated_upsampled": lambda x, w: torch.cat((_upsampled(_map(w), x), x), dim=-3),
    "concatenate_replicated": lambda x, w: torch.concatenate([x, _upsampled(_map(w), x, "nearest")], axis=1),
    "stack_replicated": lambda x, w: torch.stack([_upsampled(_map(w), x), x[:, 1:2]], -1),
    "add_replicated_upsampled": lambda x, w: x + _upsampled(_map(w), x, "nearest"),  # an FPN top-down add
    "cat_replicated_tokens": lambda x, w: torch.cat([x.flatten(2).mT, _upsampled(_map(w), x).flatten(2).mT], -1),
}

GATHER_OPS = {  # cut a sharded dim: exact through the gather fallback
    "cat_width": lambda x, w: torch.cat([x, x], -1) * w[0, 1],
    "cat_axis_width": lambda x, w: torch.cat([x, x * w[0, 1]], axis=-1),
    "chunk_axis_width": lambda x, w: x.chunk(2, axis=-1)[1] * w[0, 1],
    "unbind_axis_width": lambda x, w: torch.stack(x.unbind(axis=-1)[1:], -1) * w[0, 1],
}


def _map(w: torch.Tensor) -> torch.Tensor:
    """A small replicated (2, 1, 3, 4) map made of the replicated input ``w``: its gradient is checked too."""
    return w.expand(2, 1, 3, 4)


def _upsampled(small: torch.Tensor, like: torch.Tensor, mode: str = "bilinear") -> torch.Tensor:
    """``small`` (replicated) resized to ``like``'s global size: plain torch, a replicated full-size map."""
    return F.interpolate(small, size=like.shape[-2:], mode=mode)


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


BAD_JOINS = {  # calls torch rejects: its error type before any communication (cat: the meta kernel's wording)
    "cat_broadcast": (lambda x, r: torch.cat([x, r], 1), (2, 3, 5, 1), False),  # cat does not broadcast
    "cat_other_width": (lambda x, r: torch.cat([x, r], 1), (2, 3, 5, 3), False),
    "stack_other_size": (lambda x, r: torch.stack([x, r], 1), (2, 3, 5, 8), True),
    "chunk_dim_out_of_range": (lambda x, r: x.chunk(2, dim=4), (1,), True),
    "unbind_dim_out_of_range": (lambda x, r: x.unbind(axis=-5), (1,), True),
}


@pytest.mark.parametrize("name", list(BAD_JOINS))
def test_bad_joins_raise_torchs_error_before_communicating(name):
    op, replicated, same_message = BAD_JOINS[name]
    inputs = [torch.randn(2, 4, 5, 8), torch.randn(replicated)]
    run_spmd(raises_like_one_device, 2, "w2", op, inputs, [0], same_message, timeout=30)
