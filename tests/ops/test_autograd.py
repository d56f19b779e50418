"""Gradients w.r.t. sharded inputs: ``torch.autograd.grad`` and ``x.grad`` are exact and sharded like ``x``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_spatial import SpatialTensor, fallback_mode, gather, shard
from tests.oracle import assert_rel_close
from tests.spmd import LAYOUTS, axes, run_spmd


def _case(layout):
    torch.manual_seed(0)
    full, w = torch.randn(2, 3, 10, 9), torch.randn(4, 3, 3, 3)
    reference = full.clone().requires_grad_()
    F.conv2d(reference, w, padding=1).square().mean().backward()
    x = shard(full, axes(layout)).requires_grad_()
    weight = w.clone().requires_grad_()
    loss = F.conv2d(x, weight, padding=1).square().mean()  # replicated: seeded with 1/S of its gradient per rank
    (direct,) = torch.autograd.grad(loss, x, retain_graph=True)
    loss.backward(torch.tensor(1.0 / LAYOUTS[layout][0]))  # what the strategy's backward does
    for how, got in (("torch.autograd.grad", direct), ("x.grad", x.grad)):
        assert isinstance(got, SpatialTensor) and got.shard_layout == x.shard_layout, how
        assert_rel_close(gather(got), reference.grad, how)
    seeded = shard(full, axes(layout)).requires_grad_()  # y.backward(g) with a sharded y: g sharded like it
    upstream = torch.randn(2, 4, 10, 9)
    with fallback_mode("error"):  # seeded by the handler, not gathered by the fallback
        F.conv2d(seeded, w, padding=1).backward(shard(upstream, axes(layout)))
    ref_seeded = full.clone().requires_grad_()
    F.conv2d(ref_seeded, w, padding=1).backward(upstream)
    assert isinstance(seeded.grad, SpatialTensor) and seeded.grad.shard_layout == seeded.shard_layout
    assert_rel_close(gather(seeded.grad), ref_seeded.grad, "y.backward(g)")
    weight_share = weight.grad.clone()  # a replicated input's gradient is this rank's share of the true one
    dist.all_reduce(weight_share)
    ref_weight = w.clone().requires_grad_()
    F.conv2d(full, ref_weight, padding=1).square().mean().backward()
    assert_rel_close(weight_share, ref_weight.grad, "weight gradient summed over ranks")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gradients_of_sharded_inputs(layout):
    run_spmd(_case, LAYOUTS[layout][0], layout)
