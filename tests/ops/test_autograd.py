"""Gradients w.r.t. sharded inputs: ``torch.autograd.grad`` and ``x.grad`` are exact and sharded like ``x``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

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


def _checkpointed(layout):
    """A checkpointed block under ``y.backward(g)`` and ``torch.autograd.grad`` of a sharded ``y`` (the handlers'
    path into autograd): the forward that the backward recomputes runs on shards, with halos, as the first did."""
    torch.manual_seed(0)
    full, w, upstream = torch.randn(2, 3, 10, 9), torch.randn(3, 3, 3, 3), torch.randn(2, 3, 10, 9)

    def block(x):
        return F.conv2d(F.gelu(F.conv2d(x, w, padding=1)), w, padding=1)

    reference = full.clone().requires_grad_()
    block(reference).backward(upstream)
    with fallback_mode("error"):
        x, y = (shard(full, axes(layout)).requires_grad_() for _ in range(2))
        checkpoint(block, x, use_reentrant=False).backward(shard(upstream, axes(layout)))
        (direct,) = torch.autograd.grad(checkpoint(block, y, use_reentrant=False), y, shard(upstream, axes(layout)))
    for how, got in (("y.backward(g)", x.grad), ("torch.autograd.grad", direct)):
        assert isinstance(got, SpatialTensor) and got.shard_layout == x.shard_layout, how
        assert_rel_close(gather(got), reference.grad, how)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_checkpoint_recomputes_on_shards_inside_the_handlers_backward(layout):
    run_spmd(_checkpointed, LAYOUTS[layout][0], layout)
