"""The partition rule and window arithmetic, checked against torch on one process (no communication)."""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch
import torch.nn.functional as F

from lightning_spatial.layout import (
    DimShard,
    Layout,
    adaptive_bins,
    conv_out_size,
    conv_window,
    partition,
    pool_out_size,
    source_index,
    transposed_window,
)
from lightning_spatial.mesh import Axis


@pytest.mark.parametrize("n,parts", [(8, 2), (97, 3), (5, 5), (13, 4), (1, 1)])
def test_partition_is_tensor_split(n, parts):
    expected = [(int(c[0]), int(c[-1]) + 1) for c in torch.arange(n).tensor_split(parts)]
    assert list(partition(n, parts)) == expected


CONV_CASES = [
    c
    for c in itertools.product([9, 16], [1, 3, 4, 7], [1, 2, 3], [0, 1, 3], [1, 2])
    if conv_out_size(c[0], c[1], c[2], c[3], c[3], c[4]) >= 1
]
POOL_CASES = [
    c for c in itertools.product([7, 10], [2, 3], [1, 2, 3], [0, 1], [1, 2], [False, True]) if c[3] <= c[1] // 2
]


@pytest.mark.parametrize("n,k,s,p,d", CONV_CASES)
def test_conv_window_reproduces_every_output_row(n, k, s, p, d):
    """Convolving only the window (zero-padded where it leaves [0, n)) gives the rows asked for, to float64
    rounding: a wrong window shifts rows by O(1); the CPU's conv kernel may sum a shorter input in another order
    (on some machines the window's rows differ from the full convolution's by one ulp)."""
    x, w = torch.randn(1, 1, n, dtype=torch.float64), torch.randn(1, 1, k, dtype=torch.float64)
    full = F.conv1d(x, w, stride=s, padding=p, dilation=d)
    assert full.shape[-1] == conv_out_size(n, k, s, p, p, d)
    padded = F.pad(x, (p, p + s * k * d))
    for lo, hi in partition(full.shape[-1], min(3, full.shape[-1])):
        a, b = conv_window(lo, hi, k, s, p, d)
        part = F.conv1d(padded[..., a + p : b + p], w, stride=s, dilation=d)
        torch.testing.assert_close(part, full[..., lo:hi], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize(
    "n,k,s,p,d,op", [(7, 3, 2, 1, 1, 1), (5, 1, 2, 0, 1, 1), (6, 2, 3, 0, 1, 2), (8, 4, 2, 1, 1, 0), (5, 3, 2, 2, 2, 1)]
)
def test_transposed_window_covers_its_rows(n, k, s, p, d, op):
    x, w = torch.randn(1, 1, n, dtype=torch.float64), torch.randn(1, 1, k, dtype=torch.float64)
    full = F.conv_transpose1d(x, w, stride=s, padding=p, output_padding=op, dilation=d)
    padded = F.pad(x, (3 * n, 3 * n))
    for lo, hi in partition(full.shape[-1], 3):
        a, b = transposed_window(lo, hi, k, s, p, d)
        part = F.conv_transpose1d(padded[..., a + 3 * n : b + 3 * n], w, stride=s, dilation=d)
        first = a * s - p
        torch.testing.assert_close(part[..., lo - first : hi - first], full[..., lo:hi], rtol=0, atol=1e-12)


@pytest.mark.parametrize("n,k,s,p,d,ceil", POOL_CASES)
def test_pool_out_size_matches_torch(n, k, s, p, d, ceil):
    out = F.max_pool1d(torch.randn(1, 1, n), k, s, p, d, ceil_mode=ceil)
    assert out.shape[-1] == pool_out_size(n, k, s, p, d, ceil)


@pytest.mark.parametrize("n,m", [(10, 3), (7, 7), (5, 9), (97, 1)])
def test_adaptive_bins_match_torch(n, m):
    x = torch.randn(1, 1, n, dtype=torch.float64)
    expected = F.adaptive_avg_pool1d(x, m)
    got = torch.stack([x[..., a:b].mean(-1) for a, b in adaptive_bins(n, m)], -1)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular", "constant"])
def test_source_index_matches_torch_pad(mode):
    n, pad = 6, 4
    x = torch.arange(n, dtype=torch.float64).view(1, 1, n)
    padded = F.pad(x, (pad, pad), mode=mode, **({"value": -1.0} if mode == "constant" else {})).flatten().tolist()
    assert [float(source_index(pos, n, mode)) for pos in range(-pad, n + pad)] == padded


def _token_layout(ih: int, iw: int):
    """Tokens (N=2 cameras x h=5 x w=7) of 2x3 tiles: two sharded factors of one merged dim."""
    h, w = DimShard(-2, Axis((0, 3), ih), 5, 2, 7), DimShard(-2, Axis((0, 1, 2), iw), 7, 10, 1)
    return Layout((h, w))


def test_token_positions_and_owners_partition_the_tokens_in_order():
    seen = []
    for ih in range(2):
        for iw in range(3):
            layout = _token_layout(ih, iw)
            pos = layout.positions(-2)
            assert torch.equal(pos, layout.take_local(torch.arange(70).view(70, 1)).flatten())
            assert bool((pos[1:] > pos[:-1]).all())  # local order is global order (top-k ties rely on it)
            owners = layout.owners(-2)
            assert torch.equal(owners[pos], torch.arange(len(pos)))
            assert int((owners >= 0).sum()) == len(pos)
            seen.append(pos)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(70))


def _level_layout(ih: int, iw: int) -> Layout:
    """Two token sets one after another on 2 x 3 ranks: a 5 x 7 level (35 tokens) and a 2 x 4 level (8)."""
    h = DimShard(-2, Axis((0, 3), ih), 43, segments=((1, 5, 7), (1, 2, 4)))
    w = DimShard(-2, Axis((0, 1, 2), iw), 43, segments=((5, 7, 1), (2, 4, 1)))
    return Layout((w, h))


def test_token_segments_hold_each_ranks_tokens_of_every_set_in_order():
    seen = []
    for ih in range(2):
        for iw in range(3):
            layout = _level_layout(ih, iw)
            full = torch.arange(43).view(43, 1)
            mine = layout.take_local(full).flatten()
            first, second = layout.segments(-2)  # each set alone, as its own token layout
            expected = torch.cat([first.take_local(full[:35]), 35 + second.take_local(full[:8])]).flatten()
            assert torch.equal(mine, expected) and torch.equal(layout.positions(-2), mine)
            assert layout.local_sizes(-2) == [len(first.take_local(full[:35])), len(second.take_local(full[:8]))]
            assert layout.global_shape(torch.Size([3, len(mine), 4])) == (3, 43, 4)
            assert layout.local_shape([3, 43, 4]) == [3, len(mine), 4]
            seen.append(mine)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(43))
    assert "5x[7]x1 + 2x[4]x1 tokens" in _level_layout(0, 0).describe()
    with pytest.raises(ValueError, match="holds 2 token sets one after another"):
        _level_layout(0, 0).factors(-2)
    with pytest.raises(ValueError, match="list different token segments"):
        Layout((DimShard(-2, Axis((0, 3), 0), 35, segments=((1, 5, 7),)), _level_layout(0, 0).on(-2)[1]))


def test_a_layout_pickles_without_its_plans():
    """DataLoader workers receive layouts; plans kept with one may have keys pickle refuses (``x.mT``'s getter keys
    a permutation)."""
    from lightning_spatial.ops.shape import _moved

    layout = Layout((DimShard(-1, Axis((0, 1, 2), 1), 9),))
    _moved(layout, torch.Tensor.mT.__get__, 4, ((), ()))
    assert layout.plans, "the permutation's plan is kept with the layout"
    copy = pickle.loads(pickle.dumps(layout))
    assert copy == layout and copy.plans == {} and copy.dims == (-1,)
    assert copy.cut_for(torch.Size([2, 9])) == layout
