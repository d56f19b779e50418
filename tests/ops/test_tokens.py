"""Tokens from sharded maps: merging sharded spatial dims (and the camera dim) into one token dim keeps the data
where it is, token-wise layers run on the shards, reductions over tokens are exact, and views map back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_spatial import SpatialTensor, shard
from tests.ops.cases import DTYPES, check_cases
from tests.spmd import LAYOUTS, axes, run_spmd

B, N, C, H = 2, 3, 4, 5


def _w(layout: str) -> int:
    return 19 if layout == "w3" else 8


def _map(layout):
    return torch.randn(B, C, H, _w(layout))


def _cameras(layout):
    return torch.randn(B, N, C, H, _w(layout))


def _camera_tokens(x):
    """(B, N, C, h, w) -> (B, N*h*w, C), PETR's token order."""
    b, n, c, h, w = x.shape
    return x.permute(0, 1, 3, 4, 2).reshape(b, n * h * w, c)


def _back_to_maps(t, like):
    """(B, N*h*w, C) -> (B*N, C, h, w): the spatial layout again, so that a halo conv can follow."""
    b, n, _, h, w = like.shape
    return t.view(b, n, h, w, -1).permute(0, 1, 4, 2, 3).flatten(0, 1)


def _seeded(op, seed=7):
    def run(*args):
        torch.manual_seed(seed)  # the same stream for the reference and the sharded call
        return op(*args)

    return run


CASES = {
    "flatten_transpose_linear": (
        lambda lay: [_map(lay), torch.randn(6, C), torch.randn(6)],
        lambda x, w, b: F.linear(x.flatten(2).transpose(1, 2), w, b),
        [0],
    ),
    "camera_tokens_and_back_to_a_conv": (
        lambda lay: [_cameras(lay), torch.randn(6, C), torch.randn(2, 6, 3, 3)],
        lambda x, w, k: F.conv2d(_back_to_maps(F.linear(_camera_tokens(x), w), x), k, padding=1),
        [0],
    ),
    "cameras_into_batch_flatten_0_1": (
        lambda lay: [_cameras(lay), torch.randn(2, C, 3, 3)],
        lambda x, k: F.conv2d(x.flatten(0, 1), k, padding=1).unflatten(0, (B, N)),
        [0],
    ),
    "unflatten_back": (
        lambda lay: [_map(lay), torch.randn(3, C, 3, 3)],
        lambda x, k: F.conv2d(F.gelu(x.flatten(2)).unflatten(2, x.shape[-2:]), k, padding=1),
        [0],
    ),
    "movedim_position_embedding_layer_norm_dropout": (
        lambda lay: [_map(lay), torch.randn(H * _w(lay), C), torch.randn(C), torch.randn(C)],
        _seeded(
            lambda x, pos, g, b: F.dropout(F.layer_norm(x.flatten(2).movedim(1, -1) + pos, (C,), g, b), 0.3).sum(1)
        ),
        [0],
    ),
    "camera_tokens_transpose_flatten": (
        lambda lay: [_cameras(lay), torch.randn(C), torch.randn(C)],
        lambda x, g, b: F.layer_norm(x.transpose(1, 2).flatten(2).transpose(1, 2), (C,), g, b).mean(1),
        [0],
    ),
    "tokens_merged_with_batch": (
        lambda lay: [_map(lay), torch.randn(5, C)],
        lambda x, w: F.linear(x.flatten(2).transpose(1, 2).reshape(-1, C), w).view(B, -1, 5).amax(1),
        [0],
    ),
    "reductions_over_tokens": (
        lambda lay: [_cameras(lay)],
        lambda x: (
            lambda t: (t.sum(1), t.mean(1), t.amax(1), t.amin(1), t.var(1), t.std(1), t.logsumexp(1), t.softmax(1))
        )(_camera_tokens(x)),
        [0],
    ),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_token_ops_match_one_device(layout, dtype):
    run_spmd(check_cases, LAYOUTS[layout][0], layout, dtype, CASES)


def _layouts(layout):
    x = shard(_cameras(layout), axes(layout))
    tokens = _camera_tokens(x)
    assert isinstance(tokens, SpatialTensor) and tokens.shape == (B, N * H * _w(layout), C)
    assert {s.dim for s in tokens.shard_layout.shards} == {-2}  # one merged token dim, no data moved
    assert tokens.to_local().numel() == x.to_local().numel()
    back = tokens.view(B, N, H, _w(layout), C).permute(0, 1, 4, 2, 3)
    assert back.shard_layout == x.shard_layout  # the spatial layout again


@pytest.mark.parametrize("layout", ["w3", "2x2"])
def test_tokens_keep_the_data_where_it_is_and_map_back(layout):
    run_spmd(_layouts, LAYOUTS[layout][0], layout)
