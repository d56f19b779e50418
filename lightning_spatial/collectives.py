"""Autograd-correct collectives under the split-gradient convention.

A replicated tensor's gradient is held as splits across its spatial group that sum to the true gradient
(docs/design.md, "Gradients"). So sharded -> replicated by all-reduce has an all-reduce as adjoint, and
all-gather (the fallback for unhandled ops) has a reduce-scatter as adjoint.

Each collective is also a torch custom op, which is what code traced by ``torch.compile`` calls: dynamo
records it as one graph node (its Python, the collective included, runs at every call) instead of tracing
process groups. A custom op names its group by the axis's global ranks (``mesh.group_of``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch._library.effects import EffectType
from torch.autograd.function import once_differentiable

from .layout import partition
from .mesh import Axis, group_of
from .run import current


def communicates(op: str) -> None:
    """Mark a custom op that exchanges messages as an ordered effect under torch.compile: every rank's graph runs
    such ops in the order it traced them (the same on every rank), even where a rank's graph differs (an edge rank
    only sends, a corner has no neighbour on one side) and an op's result is unused there; the compiler may then
    neither drop nor merge them, nor reorder them against each other (two ranks waiting in different ops hang)."""
    torch.library._register_effectful_op(op, EffectType.ORDERED)


SUM, MAX, MIN = "sum", "max", "min"  # reductions by name: dynamo (torch 2.11) cannot hash a ReduceOp
_OPS = {SUM: dist.ReduceOp.SUM, MAX: dist.ReduceOp.MAX, MIN: dist.ReduceOp.MIN}
_NAMES = {op: name for name, op in _OPS.items()}


def _reduced(x: torch.Tensor, group, op: str) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, op=_OPS[op], group=group)
    return out


def _reduced_grad(grad: torch.Tensor, x, out, op: str, reduce: Callable) -> torch.Tensor:
    """The adjoint of an all-reduce whose own all-reduce of sums is ``reduce``."""
    grad = reduce(grad)
    if op != SUM:
        # The extreme's owner(s) take the gradient (ties share it, as torch's amax does).
        hit = (x == out).to(grad.dtype)
        grad = grad * hit / reduce(hit)
    return grad


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, op: str) -> torch.Tensor:
        ctx.group, ctx.op = group, op
        out = _reduced(x, group, op)
        if op != SUM:
            ctx.save_for_backward(x, out)
        return out

    @staticmethod
    @once_differentiable  # the collective carries no graph: refuse a second derivative rather than miss terms
    def backward(ctx, grad: torch.Tensor):
        x, out = ctx.saved_tensors if ctx.op != SUM else (None, None)
        return _reduced_grad(grad, x, out, ctx.op, lambda t: _reduced(t, ctx.group, SUM)), None, None


@torch.library.custom_op("lightning_spatial::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, ranks: list[int], op: str) -> torch.Tensor:
    return _reduced(x, group_of(ranks), op)


@_all_reduce_op.register_fake
def _(x, ranks, op):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_reduce_setup(ctx, inputs, output):
    x, ctx.ranks, ctx.op = inputs
    ctx.save_for_backward(*((x, output) if ctx.op != SUM else ()))


def _all_reduce_backward(ctx, grad):
    x, out = ctx.saved_tensors if ctx.op != SUM else (None, None)
    return _reduced_grad(grad, x, out, ctx.op, lambda t: _all_reduce_op(t, ctx.ranks, SUM)), None, None


_all_reduce_op.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)
communicates("lightning_spatial::all_reduce")


def _op_name(op) -> str:
    name = op if isinstance(op, str) else _NAMES.get(op)
    if name not in _OPS:
        raise ValueError(f"all_reduce supports SUM, MAX and MIN, got {op}")
    return name


def _axis(group: Axis | dist.ProcessGroup | None) -> Axis:
    return group if isinstance(group, Axis) else Axis.from_group(group)


def all_reduce(x: torch.Tensor, group: Axis | dist.ProcessGroup | None = None, op: str = SUM) -> torch.Tensor:
    """Differentiable all-reduce over a mesh axis or process group (default: the world): ``"sum"``, ``"max"``
    or ``"min"`` (or a ``ReduceOp`` of these, outside compiled code)."""
    op, axis = _op_name(op), _axis(group)
    if torch.compiler.is_dynamo_compiling():
        return _all_reduce_op(x, list(axis.ranks), op)
    return _AllReduce.apply(x, axis.group, op)


def across(x: torch.Tensor, axes: Iterable, op=SUM) -> torch.Tensor:
    """Differentiable all-reduce of a partial result over several mesh axes (``Axis`` or anything with an
    ``.axis``, e.g. the ``DimShard``s of the reduced dims), one after the other for 2-D tiles."""
    for a in axes:
        x = all_reduce(x, getattr(a, "axis", a), op)
    return x


def across_detached(x: torch.Tensor, axes: Iterable, op=SUM) -> torch.Tensor:
    """``across`` for values that need no gradient (a softmax shift, an index, a count): in place, no graph."""
    if torch.compiler.is_dynamo_compiling():
        return across(x.detach(), axes, op)
    x = x.detach().clone(memory_format=torch.contiguous_format)  # NCCL reduces dense row-major tensors only
    reduce_op = _OPS[_op_name(op)]
    for a in axes:
        dist.all_reduce(x, op=reduce_op, group=getattr(a, "axis", a).group)
    return x


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    """channels_last(_3d) for a tensor laid out so (that is how its ``stride()`` describes the global tensor)."""
    for fmt, ndim in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if x.dim() == ndim and not x.is_contiguous() and x.is_contiguous(memory_format=fmt):
            return fmt
    return torch.contiguous_format


def _padded(x: torch.Tensor, dim: int, longest: int) -> torch.Tensor:
    """``x`` grown to ``longest`` rows along ``dim`` (gloo needs equal sizes), in its own memory format."""
    if x.shape[dim] < longest:
        pad_shape = list(x.shape)
        pad_shape[dim] = longest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad_shape)], dim)
    return x.contiguous(memory_format=_memory_format(x))  # the full tensor keeps x's memory format


def _receiving(like: torch.Tensor) -> torch.Tensor:
    """A buffer for what a collective receives. Fake groups (``Run.zero_undelivered``: ``FakeRank``, the planner's
    probe) deliver nothing: there it reads as zeros, not as uninitialised memory, where a NaN would spread into
    every gradient (and stop a detector's Hungarian matching)."""
    return torch.zeros_like(like) if current().zero_undelivered else torch.empty_like(like)


def _gathered(x: torch.Tensor, dim: int, group, bounds) -> torch.Tensor:
    padded = _padded(x, dim, bounds[0][1] - bounds[0][0])
    pieces = [_receiving(padded) for _ in bounds]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([p.narrow(dim, 0, b - a) for p, (a, b) in zip(pieces, bounds)], dim)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, axis: Axis, n: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.bounds = dim, axis.group, partition(n, axis.size)
        return _gathered(x, dim, ctx.group, ctx.bounds)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        # Reduce-scatter of the split gradients; all-reduce then slice keeps uneven shards simple.
        a, b = ctx.bounds[dist.get_rank(ctx.group)]
        return _reduced(grad, ctx.group, SUM).narrow(ctx.dim, a, b - a), None, None, None


@torch.library.custom_op("lightning_spatial::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, dim: int, ranks: list[int], n: int) -> torch.Tensor:
    out = _gathered(x, dim, group_of(ranks), partition(n, len(ranks)))
    return out.contiguous(memory_format=_memory_format(x))  # strides as the fake's


@_all_gather_op.register_fake
def _(x, dim, ranks, n):
    shape = list(x.shape)
    shape[dim] = n
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=_memory_format(x))


def _all_gather_setup(ctx, inputs, output):
    x, ctx.dim, ctx.ranks, n = inputs
    ctx.bounds = partition(n, len(ctx.ranks))
    ctx.me = ctx.ranks.index(dist.get_rank())


def _all_gather_backward(ctx, grad):
    a, b = ctx.bounds[ctx.me]
    return _all_reduce_op(grad, ctx.ranks, SUM).narrow(ctx.dim, a, b - a), None, None, None


_all_gather_op.register_autograd(_all_gather_backward, setup_context=_all_gather_setup)
communicates("lightning_spatial::all_gather")


def all_gather(x: torch.Tensor, dim: int, group: Axis | dist.ProcessGroup | None, global_size: int) -> torch.Tensor:
    """Differentiable all-gather over a mesh axis or process group of shards of a dim of ``global_size`` split by
    the partition rule."""
    axis = _axis(group)
    if torch.compiler.is_dynamo_compiling():
        return _all_gather_op(x, dim, list(axis.ranks), global_size)
    return _AllGather.apply(x, dim, axis, global_size)


def _scattered(x: torch.Tensor, dim: int, group, bounds) -> torch.Tensor:
    """The sum over ``group`` of ``x``'s rows ``bounds[me]`` along ``dim``: one reduce-scatter (each rank receives
    only its rows' sums; uneven parts as the partition rule gives them)."""
    me = dist.get_rank(group)
    parts = [x.narrow(dim, a, b - a).contiguous() for a, b in bounds]
    out = _receiving(parts[me])
    dist.reduce_scatter(out, parts, group=group)
    return out


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, axis: Axis, bounds) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.bounds = dim, axis.group, bounds
        return _scattered(x, dim, ctx.group, ctx.bounds)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        # every rank's partial sum enters every row of the result: each takes the whole gradient
        return _gathered(grad, ctx.dim, ctx.group, ctx.bounds), None, None, None


def reduce_scatter(x: torch.Tensor, dim: int, axis: Axis, inner: int = 1) -> torch.Tensor:
    """Differentiable reduce-scatter of partial sums over a mesh axis: this rank's rows of the sum along ``dim``,
    whose ``dim // inner`` outer rows are sharded by the partition rule (``inner`` > 1: a token dim whose outer
    factor is the sharded one). Its adjoint is an all-gather: each rank's partial takes the whole gradient."""
    bounds = tuple((a * inner, b * inner) for a, b in partition(x.shape[dim] // inner, axis.size))
    return _ReduceScatter.apply(x, dim, axis, bounds)


__all__ = ["MAX", "MIN", "SUM", "across", "across_detached", "all_gather", "all_reduce", "reduce_scatter"]
