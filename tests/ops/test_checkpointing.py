"""Activation checkpointing on shards (``ops.checkpointing``): a checkpointed block's backward computes its forward
again on shards, as the first forward ran (halos, a pending BEV sum cut to the rank's cells), also under saved-tensor
hooks, which hand a checkpoint's saved inputs back as new plain tensors. Both kinds of checkpoint, on w2, w3
(uneven), h2 and 2x2, fp32 and float64, against one process: outputs and every gradient, fallbacks as errors."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd

MODES = {"w2": "x", "w3": "y", "h2": "xy", "2x2": "xy"}


def _case(layout: str, dtype: torch.dtype, reentrant: bool, hooks: bool, source: str):
    torch.manual_seed(0)
    feats = torch.randn(2, 3, 8, 12, dtype=dtype)
    weight = torch.randn(3, 3, 3, 3, dtype=dtype)
    grid = torch.rand(2, 7, 5, 2, dtype=dtype) * 2.2 - 1.1  # a 7 x 5 BEV grid sampled from the image

    def block(x):
        return F.conv2d(F.gelu(F.conv2d(x, weight, padding=1)), weight, padding=1)

    def op(x):
        if source == "pending":  # a sum into a BEV grid, pending until the checkpointed block reads it
            x = F.grid_sample(x, grid, align_corners=False)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if hooks else nullcontext():
            y = checkpoint(block, x, use_reentrant=reentrant)
        return y * y

    check(op, [feats], sharded=[0], axes=axes(layout), bev_shard=MODES[layout] if source == "pending" else None)


@pytest.mark.parametrize("source", ["shard", "pending"])
@pytest.mark.parametrize("hooks", [False, True], ids=["plain", "saved-tensor-hooks"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "float64"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_checkpointed_block_recomputes_on_shards(layout, dtype, reentrant, hooks, source):
    run_spmd(_case, LAYOUTS[layout][0], layout, dtype, reentrant, hooks, source)
