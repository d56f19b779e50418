"""Scatters from sharded sources into a replicated destination, and gathers from sharded sources by replicated
indices: local work on this rank's part, then one all-reduce of a destination- or result-sized tensor.

Scatters (``index_add``, ``scatter_add``, ``scatter_reduce``, ``index_put(accumulate=True)``, ``bincount``,
``histc``): the source is token- or spatially-sharded along the scattered dim and its indices come along with it
(sharded alike, or replicated at full size and cut to this rank's part). Each rank scatters its part into an
empty destination; one all-reduce combines them (sums; max/min for amax/amin; sums packed with counts for
mean); the destination's own values enter once. The all-reduce's adjoint hands every rank the destination's
whole gradient, from which the local scatter's backward takes its source's part. A source dim sharded *other*
than the scattered one lines up with the destination's: the destination is cut there and the result stays
sharded along it, without communication.

Gathers (``index_select``, ``gather``, ``take_along_dim``) from a source sharded along the gathered dim, by
replicated global indices (top-k token selection): each rank fills the entries it holds (``Layout.owners``),
zeros elsewhere, and the group sums; the backward adds each gradient to its owner's rows only.

Bad indices raise torch's own errors on the rank that holds them, before any message: shapes from the op on
meta tensors of the global sizes, ranges from the same op on the owner table or in the local scatter.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..collectives import MAX, MIN, across, across_detached
from ..fallback import fallback
from ..layout import Layout
from ..tensor import SpatialTensor, on_shard, unwrap, wrap
from ._common import layout_of, localize, moved_shards, negative_dim, split_shards
from ._meta import meta_check
from .pending import pending


def _part(func, t, layout: Layout | None):
    """``t`` (an index, a destination) as this rank's part next to ``layout``; ``None`` if sharded otherwise."""
    local, own = unwrap(t)
    if own is not None:
        return local if own == layout else None
    return localize(func, local, layout) if layout is not None and isinstance(local, torch.Tensor) else local


# -- scatters into a replicated destination ------------------------------------------------------------------


def _scatter(func, call: tuple, input, source, dim: int, index_of, combine, inplace: bool):
    """The frame every scatter shares: this rank's parts of destination and indices (``index_of(along, kept)``
    builds them), ``combine(dest, src, indices, along, may_pend)`` scatters locally and reduces over the scattered
    dim's axes (a sum into a replicated result may be left pending: ``ops.pending``). Anything it cannot do
    exactly takes the fallback with the original ``call`` (args, kwargs)."""
    src, ls = unwrap(source)
    along, kept = split_shards(ls, negative_dim(dim, src.dim()))
    dest, idx = _part(func, input, layout_of(kept)), index_of(along, kept)
    plain_dest_cut = inplace and kept and not isinstance(input, SpatialTensor)  # its other rows are not ours
    if ls is None or dest is None or idx is None or plain_dest_cut:
        return fallback(func, *call)
    if inplace and input.is_leaf and input.requires_grad and torch.is_grad_enabled():  # torch's error, before messages
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    # a sum into a replicated destination may stay pending (a BEV grid reduced sharded: ops.pending)
    result = combine(dest.clone() if inplace else dest, src, idx, along, not inplace and not kept)
    if not inplace:
        return wrap(result, layout_of(kept))
    return on_shard(torch.Tensor.copy_, input, result)


def _index_add(inplace: bool):
    func = torch.Tensor.index_add_ if inplace else torch.index_add

    def index_add(input, dim, index, source, *, alpha=1):
        meta_check(torch.index_add, input, dim, index, source, alpha=alpha)
        d = negative_dim(dim, source.dim())

        def combine(dest, src, idx, along, may_pend):
            sums = torch.zeros_like(dest).index_add(d, idx, src, alpha=alpha)
            return pending(sums, along, dest) if may_pend else dest + across(sums, along)

        def index_of(along, kept):  # a 1-D index over the source's dim
            return _part(func, index, layout_of(moved_shards(along, -1)))

        return _scatter(
            func, ((input, dim, index, source), {"alpha": alpha}), input, source, dim, index_of, combine, inplace
        )

    return index_add


def _scatter_reduce(inplace: bool, fixed: str | None = None):
    """scatter_add (``fixed="sum"``) and scatter_reduce with sum, mean, amax, amin (prod: the fallback)."""
    func = {
        (False, None): torch.scatter_reduce,
        (True, None): torch.Tensor.scatter_reduce_,
        (False, "sum"): torch.scatter_add,
        (True, "sum"): torch.Tensor.scatter_add_,
    }[(inplace, fixed)]

    def scatter_reduce(input, dim, index, src, reduce=fixed, *, include_self=True):
        kwargs = {} if fixed else {"include_self": include_self}
        call = ((input, dim, index, src) + (() if fixed else (reduce,)), kwargs)
        meta_check(func, *call[0], **kwargs)
        if reduce not in ("sum", "mean", "amax", "amin"):
            return fallback(func, *call)
        d = negative_dim(dim, src.dim())

        def combine(dest, src, idx, along, may_pend):
            zeros = torch.zeros_like(dest)
            if reduce in ("amax", "amin"):
                op = MAX if reduce == "amax" else MIN
                if include_self:  # every rank's extreme with the destination, then the extreme of those
                    return across(dest.scatter_reduce(d, idx, src, reduce, include_self=True), along, op)
                info = torch.finfo if dest.is_floating_point() else torch.iinfo
                start = torch.full_like(dest, info(dest.dtype).min if reduce == "amax" else info(dest.dtype).max)
                extreme = across(start.scatter_reduce(d, idx, src, reduce, include_self=False), along, op)
                return torch.where(
                    across_detached(zeros.scatter_add(d, idx, torch.ones_like(src)), along) > 0, extreme, dest
                )
            sums = zeros.scatter_add(d, idx, src)
            if reduce == "sum" and include_self:
                return pending(sums, along, dest) if may_pend else dest + across(sums, along)
            counts = zeros.scatter_add(d, idx, torch.ones_like(src))
            sums, counts = across(torch.stack([sums, counts]), along).unbind(0)  # one message for both
            if reduce == "sum":
                return torch.where(counts > 0, sums, dest)
            if include_self:
                sums, counts = dest + sums, counts + 1
            mean = sums / counts if dest.is_floating_point() else torch.div(sums, counts, rounding_mode="floor")
            return torch.where(counts > 0, mean, dest)

        def index_of(along, kept):  # shaped like the source
            return _part(func, index, unwrap(src)[1])

        return _scatter(func, call, input, src, dim, index_of, combine, inplace)

    return scatter_reduce


def _index_put(inplace: bool):
    """``index_put(indices, values, accumulate=True)``: values sharded along the dims the index tensors
    broadcast to (one scattered point per token), the index tensors sharded alike or replicated."""
    func = torch.Tensor.index_put_ if inplace else torch.index_put

    def index_put(input, indices, values, accumulate=False):
        call = ((input, indices, values, accumulate), {})
        meta_check(func, input, indices, values, accumulate)
        vals, lv = unwrap(values)
        k = len(torch.broadcast_shapes(*(t.shape for t in indices)))
        along = tuple(s for s in (lv.shards if lv else ()) if vals.dim() + s.dim < k)  # sharded index dims
        plain = all(isinstance(t, torch.Tensor) and not t.dtype == torch.bool for t in indices)
        if not accumulate or not plain or not along or vals.dim() != k + input.dim() - len(indices):
            return fallback(func, *call)
        index_layout = layout_of(replace(s, dim=s.dim + vals.dim() - k) for s in along)
        kept = tuple(s for s in lv.shards if s not in along)
        dest, idx = _part(func, input, layout_of(kept)), [_part(func, t, index_layout) for t in indices]
        if dest is None or any(i is None for i in idx) or (inplace and kept and not isinstance(input, SpatialTensor)):
            return fallback(func, *call)
        sums = torch.zeros_like(dest).index_put(tuple(idx), vals, accumulate=True)
        if not inplace and not kept:
            return pending(sums, along, dest)
        total = across(sums, along)
        if not inplace:
            return wrap(dest + total, layout_of(kept))
        return on_shard(torch.Tensor.add_, input, total)

    return index_put


def bincount(input, weights=None, minlength=0):
    """Counts (or weight sums) of a sharded 1-D input: local bincount (torch's own checks), padded to the
    global length, one all-reduce."""
    x, layout = unwrap(input)
    w = _part(torch.bincount, weights, layout)
    if layout is None or w is None and weights is not None:
        return fallback(torch.bincount, (input, weights, minlength), {})
    local = torch.bincount(x, w, minlength)
    n = int(across_detached(torch.tensor([local.numel()], device=x.device), layout.shards, MAX))  # torch syncs too
    return across(torch.nn.functional.pad(local, (0, n - local.numel())), layout.shards)


def histc(input, bins=100, min=0, max=0):
    """A histogram of a sharded tensor: the global range (when ``min == max == 0``), local counts, one all-reduce."""
    x, layout = unwrap(input)
    if min == max == 0:
        low = across_detached(x.min().reshape(1), layout.shards, MIN)
        high = across_detached(x.max().reshape(1), layout.shards, MAX)
        min, max = float(low), float(high)  # torch reads them to the host too
    return across(torch.histc(x, bins, min, max), layout.shards)


# -- gathers from a sharded source by replicated indices -----------------------------------------------------


def _gather(func, take):
    """index_select, gather, take_along_dim as ``take(source, dim, index)``."""

    def op(input, dim, index, call):
        meta_check(func, *call[0], **call[1])
        x, layout = unwrap(input)
        d = negative_dim(dim, x.dim())
        along, kept = split_shards(layout, d)
        idx = _part(func, index, layout_of(kept))
        if idx is None or layout is None:
            return fallback(func, *call)
        if not along:  # e.g. along channels, per pixel: local
            return wrap(take(x, d, idx), layout)
        shape = list(x.shape)
        shape[d] = along[0].extent
        view = [1] * x.dim()
        view[d] = -1
        owners = layout.owners(d, x.device).view(view).expand(shape)
        where = take(owners, d, idx)  # torch's own range errors; -1 where another rank holds the entry
        picked = take(x, d, where.clamp_min(0))
        return wrap(across(torch.where(where >= 0, picked, 0), along), layout_of(kept))

    return op


_index_select = _gather(torch.index_select, torch.index_select)
_gather_dim = _gather(torch.gather, torch.gather)
_take_along = _gather(torch.take_along_dim, lambda x, d, i: torch.take_along_dim(x, i, d))


def index_select(input, dim, index):
    """Along a sharded dim: ``take_along_dim`` with the index viewed along ``dim`` (it broadcasts)."""
    x, layout = unwrap(input)
    d = negative_dim(dim, x.dim())
    if isinstance(index, SpatialTensor) or not split_shards(layout, d)[0]:
        return _index_select(input, dim, index, ((input, dim, index), {}))  # local, or the fallback
    meta_check(torch.index_select, input, dim, index)
    view = [1] * x.dim()
    view[d] = -1
    layout.owners(d, x.device).view(view).index_select(d, index)  # torch's own range error, before any message
    return take_along_dim(input, index.view(view), dim)


def gather(input, dim, index, *, sparse_grad=False):
    return _gather_dim(input, dim, index, ((input, dim, index), {"sparse_grad": sparse_grad}))


def take_along_dim(input, indices, dim=None):
    if dim is None:  # over the flattened tensor: global flat indices
        return fallback(torch.take_along_dim, (input, indices), {})
    return _take_along(input, dim, indices, ((input, indices, dim), {}))


def _registrations() -> dict:
    handlers = {}
    for f in (torch.index_add, torch.Tensor.index_add):
        handlers[f] = _index_add(False)
    handlers[torch.Tensor.index_add_] = _index_add(True)
    for f in (torch.scatter_add, torch.Tensor.scatter_add):
        handlers[f] = _scatter_reduce(False, "sum")
    handlers[torch.Tensor.scatter_add_] = _scatter_reduce(True, "sum")
    for f in (torch.scatter_reduce, torch.Tensor.scatter_reduce):
        handlers[f] = _scatter_reduce(False)
    handlers[torch.Tensor.scatter_reduce_] = _scatter_reduce(True)
    for f in (torch.index_put, torch.Tensor.index_put):
        handlers[f] = _index_put(False)
    handlers[torch.Tensor.index_put_] = _index_put(True)
    handlers.update({torch.bincount: bincount, torch.Tensor.bincount: bincount})
    handlers.update({torch.histc: histc, torch.Tensor.histc: histc})
    handlers.update({torch.index_select: index_select, torch.Tensor.index_select: index_select})
    handlers.update({torch.gather: gather, torch.Tensor.gather: gather})
    handlers.update({torch.take_along_dim: take_along_dim, torch.Tensor.take_along_dim: take_along_dim})
    return handlers


HANDLERS = _registrations()

__all__ = ["HANDLERS"]
