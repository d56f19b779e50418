"""Bad input raises a clear error before any communication, never a wrong tensor.

Only rank 0 makes the bad call while the other ranks wait at a final barrier: an op that communicated
before raising would hang there, and the harness reports the time-out.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_spatial import LayoutError, shard
from tests.spmd import LAYOUTS, axes, run_spmd


def _rank0_raises(layout, build, error, match):
    mesh_axes = axes(layout)  # building process groups is itself collective: every rank does it
    if dist.get_rank() == 0:
        with pytest.raises(error, match=match):
            build(mesh_axes)
    dist.barrier()


CASES = {
    "different layouts": (
        "2x2",
        lambda ax: shard(torch.randn(1, 2, 8, 8), {-1: ax[-1]}) + shard(torch.randn(1, 2, 8, 8), {-2: ax[-2]}),
        LayoutError,
        "different layouts",
    ),
    "different global sizes": (
        "w2",
        lambda ax: shard(torch.randn(1, 2, 8, 8), ax) * shard(torch.randn(1, 2, 8, 9), ax),
        LayoutError,
        "different layouts",
    ),
    "replicated operand of another size": (
        "w2",
        lambda ax: shard(torch.randn(1, 2, 8, 8), ax) + torch.randn(1, 2, 8, 5),
        LayoutError,
        "replicated tensor of shape .1, 2, 8, 5. .* must have size 1 .broadcast. or 8 there",
    ),
    "dim smaller than its ranks": (
        "w3",
        lambda ax: shard(torch.randn(1, 2, 8, 2), ax),
        LayoutError,
        "size 2, smaller than its 3 ranks",
    ),
    "layer_norm over channels of another size": (
        "w2",
        lambda ax: F.layer_norm(shard(torch.randn(1, 8, 3, 2), {-2: ax[-1]}), (3,)),
        RuntimeError,
        r"Given normalized_shape=\[3\], expected input with shape \[\*, 3\], but got input of size",
    ),
    "conv output smaller than its ranks": (
        "w3",
        lambda ax: F.conv2d(shard(torch.randn(1, 2, 8, 9), ax), torch.randn(2, 2, 4, 4), stride=4),
        LayoutError,
        "conv2d: output size 2 along dim -1 .input 9. is smaller than its 3 ranks",
    ),
    "pool output smaller than its ranks": (
        "w2",
        lambda ax: F.max_pool2d(shard(torch.randn(1, 2, 8, 3), ax), 3),
        LayoutError,
        "max_pool2d: output size 1",
    ),
    "conv over a sharded channel dim": (
        "w2",
        lambda ax: F.conv2d(shard(torch.randn(1, 4, 8, 8), {-3: ax[-1]}), torch.randn(2, 4, 3, 3)),
        LayoutError,
        "conv2d: .* sharded along dim -3, which is not one of its 2 spatial dims",
    ),
    "sharded weight": (
        "w2",
        lambda ax: F.conv2d(shard(torch.randn(1, 2, 8, 8), ax), shard(torch.randn(2, 2, 3, 4), ax)),
        LayoutError,
        "conv2d: weight is sharded",
    ),
    "sharded bias": (
        "w2",
        lambda ax: F.linear(shard(torch.randn(1, 8, 6), {-2: ax[-1]}), torch.randn(4, 6), shard(torch.randn(8, 4), ax)),
        LayoutError,
        "linear: bias is sharded",
    ),
    "linear over sharded tokens merged into its features": (
        "w2",
        lambda ax: F.linear(shard(torch.randn(1, 2, 3, 4), ax).flatten(-2), torch.randn(5, 12)),
        LayoutError,
        r"linear: the last dim \(features\) is sharded",
    ),
    "reflect pad wider than the image": (
        "w2",
        lambda ax: F.pad(shard(torch.randn(1, 2, 8, 4), ax), (4, 4), mode="reflect"),
        ValueError,
        "reflect padding .4, 4. must be smaller than the dim size 4",
    ),
    "pool padding over half the kernel": (
        "w2",
        lambda ax: F.avg_pool2d(shard(torch.randn(1, 2, 8, 8), ax), 2, padding=2),
        ValueError,
        "pad should be at most half of kernel size",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_before_communicating(case):
    layout, build, error, match = CASES[case]
    run_spmd(_rank0_raises, LAYOUTS[layout][0], layout, build, error, match, timeout=30)
