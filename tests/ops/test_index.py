"""Scatters from sharded tokens into a replicated destination (BEV pooling) and gathers from sharded tokens by
replicated indices (top-k token selection), against one process: outputs and every gradient."""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import DTYPES, check_cases, raises_like_one_device
from tests.spmd import LAYOUTS, run_spmd

B, C, H, M = 2, 3, 5, 7  # M destination cells


def _w(layout: str) -> int:
    return 19 if layout == "w3" else 8


def tokens(x):
    return x.flatten(2).transpose(1, 2)  # (B, C, h, w) -> (B, h*w, C)


def _map(layout, channels=C):
    return torch.randn(B, channels, H, _w(layout))


def _cells(layout, *lead, high=M - 2):
    """Destination indices as a map sharded like the features (they come along with their tokens); the last
    two cells receive nothing."""
    return torch.randint(0, high, (*lead, H, _w(layout)))


def _dest():
    return torch.randn(B, M, C)


def _scatter_case(reduce, include_self):
    return (
        lambda lay: [_dest(), _map(lay), _cells(lay, B, C)],
        lambda d, x, i: d.scatter_reduce(1, tokens(i), tokens(x), reduce, include_self=include_self),
        [1, 2],
    )


SCATTERS = {
    "index_add_replicated_index": (
        lambda lay: [_dest(), _map(lay), torch.randint(0, M, (H * _w(lay),))],
        lambda d, x, i: d.index_add(1, i, tokens(x), alpha=0.5),
        [1],
    ),
    "index_add_sharded_index": (
        lambda lay: [_dest(), _map(lay), _cells(lay)],
        lambda d, x, i: torch.index_add(d, 1, i.flatten(), tokens(x)),
        [1, 2],
    ),
    "index_add_in_place": (
        lambda lay: [_dest(), _map(lay), _cells(lay)],
        lambda d, x, i: (d * 1).index_add_(1, i.flatten(), tokens(x)),
        [1, 2],
    ),
    "scatter_add": (
        lambda lay: [_dest(), _map(lay), _cells(lay, B, C)],
        lambda d, x, i: d.scatter_add(1, tokens(i), tokens(x)),
        [1, 2],
    ),
    "scatter_add_in_place_replicated_index": (
        lambda lay: [_dest(), _map(lay), torch.randint(0, M, (B, H * _w(lay), C))],
        lambda d, x, i: (d * 1).scatter_add_(1, i, tokens(x)),
        [1],
    ),
    **{f"scatter_reduce_{r}_{s}": _scatter_case(r, s) for r in ("sum", "mean", "amax", "amin") for s in (True, False)},
    "scatter_reduce_amax_in_place": (
        lambda lay: [_dest(), _map(lay), _cells(lay, B, C)],
        lambda d, x, i: (d * 1).scatter_reduce_(1, tokens(i), tokens(x), "amax"),
        [1, 2],
    ),
    "scatter_add_along_channels_map_stays_sharded": (
        lambda lay: [torch.randn(B, M, H, _w(lay)), _map(lay), _cells(lay, B, C)],
        lambda d, x, i: d.scatter_add(1, i, x),
        [1, 2],
    ),
    "index_put_accumulate_bev_cells": (
        lambda lay: [torch.randn(M, 4, C), _map(lay), _cells(lay), _cells(lay, high=4)],
        lambda d, x, i, j: d.index_put((i.flatten(), j.flatten()), tokens(x)[1], accumulate=True),
        [1, 2, 3],
    ),
    "index_put_accumulate_in_place": (
        lambda lay: [torch.randn(M, 4, C), _map(lay), _cells(lay), torch.randint(0, 4, (H * _w(lay),))],
        lambda d, x, i, j: (d * 1).index_put_((i.flatten(), j), tokens(x)[0], accumulate=True),
        [1, 2],
    ),
    "bincount_histc": (
        lambda lay: [_cells(lay, B), torch.randn(B, H, _w(lay))],
        lambda i, w: (
            torch.bincount(i.flatten(), minlength=3),
            i.flatten().bincount(w.detach().flatten(), minlength=M + 2),
            torch.histc(w.detach(), bins=6),
            torch.histc(w.detach(), bins=4, min=-1, max=1),
        ),
        [0, 1],
    ),
}

GATHERS = {
    "index_select_tokens": (
        lambda lay: [_map(lay), torch.tensor([3, 0, H * _w(lay) - 1, 3, 17])],
        lambda x, i: tokens(x).index_select(1, i),
        [0],
    ),
    "gather_selected_tokens": (
        lambda lay: [_map(lay), torch.randint(0, H * _w(lay), (B, 6, C))],
        lambda x, i: torch.gather(tokens(x), 1, i),
        [0],
    ),
    "take_along_dim_broadcast": (
        lambda lay: [_map(lay), torch.randint(0, H * _w(lay), (B, 6, 1))],
        lambda x, i: torch.take_along_dim(tokens(x), i, 1),
        [0],
    ),
    "gather_along_channels_per_pixel": (
        lambda lay: [_map(lay), _cells(lay, B, 2, high=C)],
        lambda x, i: x.gather(1, i),
        [0, 1],
    ),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_index_ops_match_one_device(layout, dtype):
    run_spmd(check_cases, LAYOUTS[layout][0], layout, dtype, {**SCATTERS, **GATHERS})


ERRORS = {  # name -> (inputs, op, sharded, same message): the same error as one device, before any message
    "index_select_out_of_range": (
        lambda: [_map("w2"), torch.tensor([0, H * 8])],
        lambda x, i: tokens(x).index_select(1, i),
        [0],
        True,
    ),
    "gather_out_of_range": (
        lambda: [_map("w2"), torch.full((B, 2, C), H * 8)],
        lambda x, i: tokens(x).gather(1, i),
        [0],
        True,
    ),
    "scatter_add_index_out_of_range_in_this_shard": (
        lambda: [_dest(), _map("w2"), torch.full((B, C, H, 8), M)],
        lambda d, x, i: d.scatter_add(1, tokens(i), tokens(x)),
        [1, 2],
        True,
    ),
    "index_add_index_of_another_length": (
        lambda: [_dest(), _map("w2"), torch.zeros(H * 8 - 1, dtype=torch.long)],
        lambda d, x, i: d.index_add(1, i, tokens(x)),
        [1],
        False,  # shapes are checked by torch's meta kernel, whose wording differs from the CPU kernel's
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_indices_raise_torchs_error_before_communicating(case):
    make, op, sharded, message = ERRORS[case]
    run_spmd(raises_like_one_device, 2, "w2", op, make(), sharded, message, timeout=30)
