"""Matrix products of sharded operands: local products, and one all-reduce when the contracted dim is sharded.

``a @ b`` contracts ``a``'s last dim with ``b``'s second-to-last. A sharded row dim of ``a`` (tokens times a
weight), column dim of ``b`` (replicated queries times sharded keys: attention scores) or batch dim stays
sharded in the result, and a replicated operand is cut to the matching part. A sharded contracted dim
(attention weights times sharded values) leaves partial sums that one all-reduce over its axes completes: the
result is replicated, and the all-reduce's adjoint hands every rank the whole result gradient.
"""

from __future__ import annotations

import torch

from ..collectives import across
from ..fallback import fallback, name_of
from ..layout import DimShard, Layout, LayoutError
from ..tensor import adopt, unwrap
from ._common import moved_shards
from ._meta import meta_check


def _align(func, local: torch.Tensor, layout: Layout | None, want: tuple[DimShard, ...]) -> torch.Tensor:
    """``local`` cut to the shards in ``want`` it does not carry yet; a missing or size-1 dim broadcasts."""
    have = layout.shards if layout else ()
    for dim in sorted({s.dim for s in want}):
        mine, theirs = {s for s in have if s.dim == dim}, {s for s in want if s.dim == dim}
        if mine == theirs or (not mine and (local.dim() < -dim or local.shape[dim] == 1)):
            continue
        if mine:
            raise LayoutError(f"{name_of(func)}: the operands are sharded differently along dim {dim}")
        local = Layout(tuple(theirs)).take_local(local)
    return local


def _product(func):
    def product(input, other, *, out=None):
        if out is not None:
            raise ValueError(f"{name_of(func)}: out= is not supported on sharded tensors")
        meta_check(func, input, other)  # torch's own shape errors, before any message
        a, la = unwrap(input)
        b, lb = unwrap(other)
        sa, sb = (la.shards if la else ()), (lb.shards if lb else ())
        contracted = tuple(s for s in sa if s.dim == -1) or moved_shards((s for s in sb if s.dim == -2), -1)
        rows, cols = [s for s in sa if s.dim == -2], [s for s in sb if s.dim == -1]
        batch = tuple({s for s in (*sa, *sb) if s.dim <= -3})
        axes = [s.axis for group in (rows, cols, contracted, batch) for s in group]
        if a.dim() < 2 or b.dim() < 2 or len(axes) != len(set(axes)):
            return fallback(func, (input, other), {})  # vectors, or two roles split over the same ranks
        a = _align(func, a, la, (*contracted, *batch))
        b = _align(func, b, lb, (*moved_shards(contracted, -2), *batch))
        result = func(a, b)
        if contracted:
            result = across(result, contracted)
        kept = (*rows, *cols, *batch)
        return adopt(result, Layout(kept) if kept else None)

    return product


_matmul, _bmm = _product(torch.matmul), _product(torch.bmm)


def baddbmm(input, batch1, batch2, *, beta=1, alpha=1, out=None):
    """``beta * input + alpha * (batch1 @ batch2)``; the sum is element-wise on whatever layout results."""
    if out is not None:
        raise ValueError("baddbmm: out= is not supported on sharded tensors")
    meta_check(torch.baddbmm, input, batch1, batch2, beta=beta, alpha=alpha)
    product = _bmm(batch1, batch2)
    product = product if alpha == 1 else product * alpha
    return product if beta == 0 else torch.add(input if beta == 1 else input * beta, product)


HANDLERS = {
    torch.matmul: _matmul,
    torch.Tensor.matmul: _matmul,
    torch.Tensor.__matmul__: _matmul,
    torch.Tensor.__rmatmul__: lambda self, other: _matmul(other, self),
    torch.bmm: _bmm,
    torch.Tensor.bmm: _bmm,
    torch.baddbmm: baddbmm,
    torch.Tensor.baddbmm: baddbmm,
}

__all__ = ["HANDLERS"]
