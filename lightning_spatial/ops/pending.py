"""Sums not yet reduced: a splat into a BEV grid ends sharded over the grid's cells instead of replicated.

A scatter of sharded sources (``index_add``, ``scatter_add``, ``index_put(accumulate=True)``) and a
``grid_sample`` of a sharded image leave every rank with a *partial* sum of the whole destination, which one
all-reduce makes whole on every rank. With ``Run.bev_shard`` set (``SpatialParallelStrategy(bev_shard=...)``)
the partial sum travels on as a ``PendingSum`` through the views that rearrange it (``view``, ``reshape``,
``permute``, ...), and the first other op reduces it: a tensor of at least 4 dims whose last two are a BEV plane
``(..., X, Y)`` is reduce-scattered along X, Y or both (2-D tiles), so each rank receives the sums of its own cells
only; anything smaller (a histogram, a flat ``(cells, C)`` table read as such) is all-reduced as before. The
adjoint of the reduce-scatter is an all-gather: every rank's partial takes the whole gradient.

The destination's own values (``dest + sums``) enter once, after the reduction, as they do without the option. A
pending sum read twice is reduced once.

Samples that every rank would compute whole (``grid_sample`` of a gathered input at replicated points: BEVFormer's
first cross-attention, before its BEV queries are sharded) are not computed until the first reader cuts them
(``pending_samples``): then each rank samples only the points of its own cells. Views that keep the samples' order
and their channel dim whole (``view``, ``reshape``, ``unflatten``, ...: BEVFormer's points split from its cells,
Simple-BEV's cameras split from the batch) stay lazy; any other op computes every sample first, as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch.utils._pytree import tree_map

from ..collectives import across, reduce_scatter
from ..fallback import is_inplace, name_of
from ..layout import DimShard, Layout, LayoutError
from ..mesh import Axis
from ..run import BEV_PLANE_DIMS, current
from ..tensor import SpatialTensor, _dynamo_compiling, _Plain, wrap
from .queries import GLOBAL, LOCAL

# views that keep the elements' order: lazy samples stay lazy through them (their channels kept whole)
_IN_ORDER = frozenset(
    {
        torch.Tensor.view,
        torch.Tensor.reshape,
        torch.reshape,
        torch.Tensor.flatten,
        torch.flatten,
        torch.Tensor.unflatten,
        torch.unflatten,
        torch.Tensor.unsqueeze,
        torch.unsqueeze,
        torch.Tensor.squeeze,
        torch.squeeze,
        torch.Tensor.contiguous,
    }
)
# ops that only rearrange the partial sums' elements: applied to the partial sums and the base, still pending
_VIEWS = _IN_ORDER | {
    torch.Tensor.permute,
    torch.permute,
    torch.Tensor.transpose,
    torch.transpose,
    torch.Tensor.movedim,
    torch.movedim,
}
_QUERIES = LOCAL | frozenset(GLOBAL)


class PendingSum(SpatialTensor):
    """This rank's partial sum of a whole destination (its data has the global shape), reduced by the first op
    that reads it (module docstring). A subclass of ``SpatialTensor`` so that its ``__torch_function__`` runs first
    wherever the two meet."""

    _axes: tuple[Axis, ...]
    _addend: torch.Tensor | None
    _reduced: torch.Tensor | None
    _whole: bool  # the same sum on every rank: cut, not reduced
    _samples: _Samples | None  # whole samples not computed yet (its data is then a placeholder without memory)

    def settled(self) -> torch.Tensor:
        return resolve(self)

    def to_local(self) -> torch.Tensor:
        settled = resolve(self)
        return settled.to_local() if isinstance(settled, SpatialTensor) else settled

    def __repr__(self, *, tensor_contents=None) -> str:  # local: printing must not communicate
        with _Plain():
            return f"PendingSum(over {len(self._axes)} axes, partial={self.as_subclass(torch.Tensor)!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _QUERIES:
            with _Plain():
                return func(*args, **kwargs)
        first = args[0] if args else None
        if func in _VIEWS and type(first) is PendingSum and first._samples is not None:
            return _viewed_samples(func, first, args[1:], kwargs)
        if func in _VIEWS and type(first) is PendingSum:
            with _Plain():
                partial = func(first.as_subclass(torch.Tensor), *args[1:], **kwargs)
                base = None if first._addend is None else func(first._addend, *args[1:], **kwargs)
            return pending(partial, first._axes, base, first._whole)
        if type(first) is PendingSum and is_inplace(func):
            raise LayoutError(
                f"{name_of(func)} writes into a BEV grid whose sums are not reduced yet "
                f"(bev_shard={current().bev_shard!r}), and the reduced grid is a new tensor: write the result to a "
                "new name (bev = bev + x instead of bev += x), or use bev_shard=None"
            )
        resolved = tree_map(lambda a: resolve(a) if type(a) is PendingSum else a, (args, kwargs))
        return func(*resolved[0], **resolved[1])


def pending(
    partial: torch.Tensor, axes: Sequence, base: torch.Tensor | None = None, whole: bool = False
) -> torch.Tensor:
    """``base + (the sum over axes of partial)``: pending under ``Run.bev_shard``, else reduced now (all-reduce).
    ``whole``: ``partial`` is already the sum, the same on every rank (``grid_sample`` of a gathered input), so it
    is cut to this rank's cells instead of reduced."""
    axes = _axes_of(axes)
    if not _defers(axes):
        total = partial if whole else across(partial, axes)
        return total if base is None else base + total
    with _Plain():
        out = partial.as_subclass(PendingSum)
    out._axes, out._addend, out._reduced, out._layout, out._whole = axes, base, None, Layout(()), whole
    out._samples = None
    return out


def _axes_of(axes: Sequence) -> tuple[Axis, ...]:
    return tuple(getattr(a, "axis", a) for a in axes)  # shards' axes, or axes


def _defers(axes: tuple[Axis, ...]) -> bool:
    """Whether sums over ``axes`` are left pending: under ``Run.bev_shard``, eagerly (compiled code reduces now)."""
    return current().bev_shard is not None and bool(axes) and not _dynamo_compiling()


class _Samples:
    """Samples left to compute: ``sample(points)`` maps points laid out as the samples, ``(N, k, ...)`` with the
    ``k`` coordinates in dim 1, to the samples ``(N, C, ...)``; run in the grad mode they were asked in. Viewed in
    order, the points keep the samples' layout with ``k`` in the channels' place, dim ``dim``."""

    def __init__(
        self,
        sample: Callable[[torch.Tensor], torch.Tensor],
        points: torch.Tensor,
        grad: bool | None = None,
        dim: int = 1,
    ) -> None:
        self.sample, self.points, self.dim = sample, points, dim
        self.grad = torch.is_grad_enabled() if grad is None else grad

    def at(self, points: torch.Tensor) -> torch.Tensor:
        """The samples at ``points`` (a block of ``self.points``' layout), laid out as those points."""
        lead, rest = points.shape[: self.dim], points.shape[self.dim + 1 :]
        with torch.set_grad_enabled(self.grad):
            out = self.sample(points.reshape(-1, *points.shape[self.dim :]))
        return out.reshape(*lead, out.shape[1], *rest)

    def laid_out(self, samples: Sequence[int], shape: Sequence[int]) -> _Samples | None:
        """The same samples, now of ``samples``' shape, viewed in order as ``shape``; None where the view splits or
        merges their channels (or leaves them among the BEV plane's last two dims)."""
        channels, lead = samples[self.dim], math.prod(samples[: self.dim])
        dim = next((j for j in range(len(shape) - 2) if math.prod(shape[:j]) == lead and shape[j] == channels), None)
        if dim is None:
            return None
        k = self.points.shape[self.dim]
        return _Samples(self.sample, self.points.reshape(*shape[:dim], k, *shape[dim + 1 :]), self.grad, dim)


def pending_samples(
    sample: Callable[[torch.Tensor], torch.Tensor], points: torch.Tensor, channels: int, axes: Sequence, like
) -> torch.Tensor:
    """``sample(points)``, the same on every rank (module docstring; ``_Samples`` for the layout of ``points``):
    under ``Run.bev_shard`` a pending sum that samples only this rank's cells when its first reader cuts it, else
    computed now. ``like``: a tensor of the samples' dtype and device, whether they need gradients."""
    axes = _axes_of(axes)
    if not _defers(axes):
        return sample(points)
    shape = (points.shape[0], channels, *points.shape[2:])
    return _lazy(_Samples(sample, points), shape, like, like.requires_grad or points.requires_grad, axes)


def _lazy(samples: _Samples, shape: Sequence[int], like, requires_grad: bool, axes: tuple) -> PendingSum:
    """A pending sum of ``samples`` not computed yet: its data is a placeholder of their shape, without memory."""
    with _Plain():
        placeholder = like.new_empty(()).expand(shape).requires_grad_(requires_grad)
    out = pending(placeholder, axes, whole=True)
    out._samples = samples
    return out


def _viewed_samples(func, first: PendingSum, args: tuple, kwargs: dict) -> torch.Tensor:
    """A view of samples not computed yet: still lazy if it keeps their order and their channels whole, else every
    sample computed, then viewed (an ordinary whole pending sum)."""
    with _Plain():
        placeholder = first.as_subclass(torch.Tensor)
        try:
            shape = func(placeholder, *args, **kwargs).shape if func in _IN_ORDER else None
        except RuntimeError:
            shape = None
    viewed = None if shape is None else first._samples.laid_out(placeholder.shape, shape)
    if viewed is not None:
        return _lazy(viewed, shape, placeholder, placeholder.requires_grad, first._axes)
    whole = first._samples.at(first._samples.points)
    with _Plain():
        return pending(func(whole, *args, **kwargs), first._axes, None, True)


def resolve(p: PendingSum) -> torch.Tensor:
    """The pending sum reduced (once): sharded over its last two dims by ``Run.bev_shard`` if it is a BEV plane,
    else replicated."""
    if p._reduced is None:
        p._reduced = _reduce(p)
    return p._reduced


def plane_dims(p: torch.Tensor) -> tuple[int, ...]:
    """The dims a pending sum is reduce-scattered along (``Run.bev_shard``): its last two if it is a BEV plane (at
    least 4 dims), none if it is smaller (then it is all-reduced, replicated)."""
    return tuple(d - 2 for d in BEV_PLANE_DIMS.get(current().bev_shard, ())) if p.dim() >= 4 else ()


def _reduce(p: PendingSum) -> torch.Tensor:
    with _Plain():
        partial = p.as_subclass(torch.Tensor)
    mode = current().bev_shard
    dims = plane_dims(partial)
    for dim, axis in zip(dims, p._axes):
        if partial.shape[dim] < axis.size:
            raise LayoutError(
                f"the BEV grid {tuple(partial.shape)} has {partial.shape[dim]} cells along dim {dim}, fewer than its "
                f"{axis.size} ranks (bev_shard={mode!r}): use a finer grid, fewer spatial ranks, or "
                "bev_shard=None (a replicated grid)"
            )
    # one axis per plane dim; axes beyond them are all-reduced
    shards = [DimShard(d, a, partial.shape[d]) for d, a in zip(dims, p._axes)]
    layout = Layout(tuple(shards)) if shards else None
    if p._samples is not None:
        points = layout.take_local(p._samples.points) if layout else p._samples.points
        total = wrap(p._samples.at(points), layout)  # this rank's cells only
    elif p._whole:
        total = wrap(layout.take_local(partial).contiguous(), layout) if layout else partial  # frees the rest
    else:
        total = reduced_into(partial, p._axes, shards)
    return total if p._addend is None else total + p._addend  # a replicated addend is cut to this rank's cells


def reduced_into(partial: torch.Tensor, axes: Sequence[Axis], shards: Sequence[DimShard]) -> torch.Tensor:
    """The sum over ``axes`` of every rank's ``partial`` (the global shape), laid out as ``shards`` (each over one
    of ``axes``): a reduce-scatter along each sharded factor (a token dim is viewed as its factors for it), the axes
    no shard takes all-reduced first. No shards: replicated."""
    taken = {s.axis.ranks for s in shards}
    total = across(partial, [a for a in axes if a.ranks not in taken])
    layout = Layout(tuple(shards)) if shards else None
    for dim in layout.dims if layout else ():
        factors = layout.factors(dim)
        at = total.dim() + dim
        total = total.unflatten(at, [n for n, _ in factors])
        for k, (_, s) in enumerate(factors):
            if s is not None:
                total = reduce_scatter(total, at + k, s.axis)
        total = total.flatten(at, at + len(factors) - 1)
    return wrap(total, layout)


__all__ = ["PendingSum", "pending", "pending_samples", "plane_dims", "reduced_into", "resolve"]
