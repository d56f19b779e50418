"""Per-sample masks, flips and cumulative sums on shards: single-device results, no gather.

Simple-BEV's random flip augmentation (``x[keep] = torch.flip(x[keep], [-1])`` with a per-sample numpy mask), index
lists over samples or cameras, flips along sharded dims (each rank fetches its mirrored rows), and ``cumsum`` along
sharded dims and token dims merged from sharded maps (an exclusive scan of the ranks' totals).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.ops.cases import DTYPES, check_cases, raises_like_one_device
from tests.spmd import LAYOUTS, run_spmd

B, C, H = 4, 3, 5
KEEP = np.array([True, False, True, True])  # Simple-BEV draws it with np.random.choice([0, 1], B).astype(bool)


def _w(layout: str) -> int:
    return 7 if layout == "w3" else 6


def _map(layout):
    return torch.randn(B, C, H, _w(layout))


def _flip_chosen_samples(x, keep):
    x = x * 1.0  # a new tensor to assign into (the leaf itself cannot be written in place)
    x[keep] = torch.flip(x[keep], [-1])
    return x


def _flip_chosen_bev(x):
    x = x * 1.0
    x[KEEP] = torch.flip(x[KEEP], [-1])  # Simple-BEV: one numpy mask along width, another along height
    x[~KEEP] = torch.flip(x[~KEEP], [-2])
    return x


CASES = {
    "per_sample_flip_with_a_mask_tensor": (
        lambda lay: [_map(lay), torch.from_numpy(KEEP)],
        _flip_chosen_samples,
        [0],
    ),
    "per_sample_flips_with_numpy_masks": (lambda lay: [_map(lay)], _flip_chosen_bev, [0]),
    "select_samples_by_list_and_tensor": (
        lambda lay: [_map(lay)],
        lambda x: (x[[0, 2]], x[torch.tensor([3, 1, 1])], x[:, [2, 0]], x[np.int64(1)]),
        [0],
    ),
    "mask_over_samples_and_channels": (
        lambda lay: [_map(lay), torch.rand(B, C) > 0.4],
        lambda x, m: x[m] * 2,
        [0],
    ),
    "assign_a_replicated_value_under_a_mask": (
        lambda lay: [_map(lay), torch.randn(1, 1, _w(lay))],
        lambda x, v: _assign(x, torch.from_numpy(KEEP), v),
        [0],
    ),
    "flip_sharded_dims": (
        lambda lay: [_map(lay)],
        lambda x: (x.flip(-1), torch.flip(x, [-2, -1]), torch.flip(x, (1,)), x.flip(3, 0)),
        [0],
    ),
    "cumsum_along_sharded_and_other_dims": (
        lambda lay: [_map(lay)],
        lambda x: (x.cumsum(-1), torch.cumsum(x, dim=2), x.cumsum(1), x.cumsum(-1, dtype=torch.float64)),
        [0],
    ),
    "cumsum_along_tokens": (  # tokens merged from the sharded map: one factor (w2, h2, w3) or two (2x2 tiles)
        lambda lay: [_map(lay)],
        lambda x: (x.flatten(2).cumsum(-1), x.flatten(1).cumsum(1), x.permute(0, 2, 3, 1).flatten(1, 2).cumsum(1)),
        [0],
    ),
    "cumsum_of_a_mask": (lambda lay: [_map(lay)], lambda x: (x > 0).flatten(2).cumsum(-1), [0]),
}


def _assign(x, keep, v):
    x = x * 1.0
    x[keep] = v
    x[keep, 1:] += v * 0.5
    return x


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_masks_flips_and_scans_match_one_device(layout, dtype):
    run_spmd(check_cases, LAYOUTS[layout][0], layout, dtype, CASES)


@pytest.mark.parametrize(
    "op",
    [lambda x: x.cumsum(4), lambda x: x.flip(-5)],
    ids=["cumsum", "flip"],
)
def test_a_dim_out_of_range_raises_torchs_error_before_communicating(op):
    run_spmd(raises_like_one_device, 2, "w2", op, [torch.randn(B, C, H, 6)], [0], timeout=30)
