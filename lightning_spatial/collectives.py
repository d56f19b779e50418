"""Autograd-correct collectives under the split-gradient convention.

A replicated tensor's gradient is held as splits across its spatial group that sum to the true gradient
(docs/design.md, "Gradients"). So sharded -> replicated by all-reduce has an all-reduce as adjoint, and
all-gather (the fallback for unhandled ops) has a reduce-scatter as adjoint.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .layout import partition


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, op) -> torch.Tensor:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            raise ValueError(f"all_reduce supports SUM, MAX and MIN, got {op}")
        ctx.group, ctx.op = group, op
        out = x.contiguous().clone()
        dist.all_reduce(out, op=op, group=group)
        if op != dist.ReduceOp.SUM:
            ctx.save_for_backward(x, out)
        return out

    @staticmethod
    @once_differentiable  # the collective carries no graph: refuse a second derivative rather than miss terms
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        if ctx.op != dist.ReduceOp.SUM:
            # The extreme's owner(s) take the gradient (ties share it, as torch's amax does).
            x, out = ctx.saved_tensors
            hit = (x == out).to(grad.dtype)
            count = hit.clone()
            dist.all_reduce(count, group=ctx.group)
            grad = grad * hit / count
        return grad, None, None


def all_reduce(x: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Differentiable all-reduce over ``group`` (SUM, MAX or MIN)."""
    return _AllReduce.apply(x, group, op)


def across(x: torch.Tensor, axes: Iterable, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Differentiable all-reduce of a partial result over several mesh axes (``Axis`` or anything with an
    ``.axis``, e.g. the ``DimShard``s of the reduced dims), one after the other for 2-D tiles."""
    for a in axes:
        x = all_reduce(x, getattr(a, "axis", a).group, op)
    return x


def across_detached(x: torch.Tensor, axes: Iterable, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``across`` for values that need no gradient (a softmax shift, an index, a count): in place, no graph."""
    x = x.detach().clone(memory_format=torch.contiguous_format)  # NCCL reduces dense row-major tensors only
    for a in axes:
        dist.all_reduce(x, op=op, group=getattr(a, "axis", a).group)
    return x


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    """channels_last(_3d) for a tensor laid out so (that is how its ``stride()`` describes the global tensor)."""
    for fmt, ndim in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if x.dim() == ndim and not x.is_contiguous() and x.is_contiguous(memory_format=fmt):
            return fmt
    return torch.contiguous_format


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group, n: int) -> torch.Tensor:
        parts = dist.get_world_size(group)
        bounds = partition(n, parts)
        longest = bounds[0][1] - bounds[0][0]
        ctx.dim, ctx.group, ctx.bounds = dim, group, bounds
        padded = x
        if x.shape[dim] < longest:  # gloo needs equal sizes: pad the short shards, cut after
            pad_shape = list(x.shape)
            pad_shape[dim] = longest - x.shape[dim]
            padded = torch.cat([x, x.new_zeros(pad_shape)], dim)
        padded = padded.contiguous(memory_format=_memory_format(x))  # the full tensor keeps x's memory format
        pieces = [torch.empty_like(padded) for _ in range(parts)]
        dist.all_gather(pieces, padded, group=group)
        return torch.cat([p.narrow(dim, 0, b - a) for p, (a, b) in zip(pieces, bounds)], dim)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        # Reduce-scatter of the split gradients; all-reduce then slice keeps uneven shards simple.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        a, b = ctx.bounds[dist.get_rank(ctx.group)]
        return grad.narrow(ctx.dim, a, b - a), None, None, None


def all_gather(x: torch.Tensor, dim: int, group, global_size: int) -> torch.Tensor:
    """Differentiable all-gather of shards of a dim of ``global_size`` split by the partition rule."""
    return _AllGather.apply(x, dim, group, global_size)


__all__ = ["across", "across_detached", "all_gather", "all_reduce"]
