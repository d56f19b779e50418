"""Views, permutes, concatenation and channel-wise linear maps: local when no sharded factor is cut, an
exact gather (with the fallback's warning) when one is.

Sizes passed by user code are global (``SpatialTensor.shape`` is global), so a view is translated to the
shard by tracking each sharded factor through the reshape. A reshape keeps the row-major order of the global
elements, so a factor is ``(P, f, Q)`` in that order (``P`` elements' worth of outer index, its own ``f``,
``Q`` inner) before and after; it survives when it lies inside one output dim. Merging sharded spatial dims
into tokens (``x.flatten(2)``) and splitting them back (``view(B, C, h, w)``) are then local.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..collectives import MAX, across_detached
from ..fallback import fallback
from ..halo import fetch_window
from ..layout import DimShard, Layout, LayoutError
from ..plans import planned
from ..tensor import SpatialTensor, adopt, on_shard, unwrap
from ._binding import bound
from ._common import bad_or_fallback, localize, require_replicated
from ._meta import raise_torch_error


def _sizes(shape) -> tuple:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        return tuple(shape[0])
    return tuple(shape)


def _resolve(shape: tuple, numel: int) -> list[int]:
    shape = list(shape)
    if -1 in shape:
        known = math.prod([d for d in shape if d != -1])
        shape[shape.index(-1)] = numel // known if known else 0
    return shape


def track(layout: Layout, global_in, global_out) -> Layout | None:
    """Where each sharded factor lands after reshaping ``global_in`` to ``global_out`` (None: one is cut)."""
    return _track(layout, tuple(global_in), tuple(global_out))


@planned
def _track(layout: Layout, global_in: tuple, global_out: tuple) -> Layout | None:
    shards = []
    for s in layout.shards:
        if s.segments:  # token sets one after another: the dim must stay whole
            before = math.prod(global_in[: len(global_in) + s.dim])
            q = next(
                (q for q, n in enumerate(global_out) if n == s.extent and math.prod(global_out[:q]) == before), None
            )
            if q is None:
                return None
            shards.append(replace(s, dim=q - len(global_out)))
            continue
        before = math.prod(global_in[: len(global_in) + s.dim]) * s.outer  # P: elements' outer index range
        a = 1
        for q, n in enumerate(global_out):
            b = a * n
            if before % a == 0 and b % (before * s.size) == 0:  # the factor lies inside output dim q
                shards.append(DimShard(q - len(global_out), s.axis, s.size, before // a, b // (before * s.size)))
                break
            a = b
        else:
            return None
    return Layout(tuple(shards))


def _reshape(func):
    def reshape(input, *shape):
        x, layout = unwrap(input)
        global_in = list(layout.global_shape(x))
        global_out = _resolve(_sizes(shape), math.prod(global_in))
        new = track(layout, global_in, global_out)
        if new is None:
            return fallback(func, (input, *shape), {})
        return adopt(func(x, new.local_shape(global_out)), new)

    return reshape


def _shape_op(func):
    """flatten, unflatten, squeeze, unsqueeze: a local reshape; the global result shape comes from running
    ``func`` on a meta tensor (its arguments, e.g. ``unflatten``'s sizes, are global)."""

    def op(input, *args, **kwargs):
        x, layout = unwrap(input)
        global_in = list(layout.global_shape(x))
        global_out = list(func(torch.empty(global_in, device="meta"), *args, **kwargs).shape)
        new = track(layout, global_in, global_out)
        if new is None:
            return fallback(func, (input, *args), kwargs)
        return adopt(x.reshape(new.local_shape(global_out)), new)

    return op


def _permute_op(func):
    """permute/transpose/movedim/mT: the sharded dims move with the data."""

    def permute(input, *args, **kwargs):
        out = on_shard(func, input, *args, **kwargs)
        call = (args, ())
        if kwargs or (args and type(args[0]) is not int):  # dims as lists: tuples, to key the plan
            call = _freeze((args, tuple(sorted(kwargs.items()))))
        return adopt(out, _moved(input._layout, func, out.dim(), call))

    return permute


@planned(per_layout=True, maxsize=256)
def _moved(layout: Layout, func, ndim: int, call: tuple) -> Layout:
    """``layout`` after ``func`` permutes the dims (asked once per layout and call signature: no probe every step)."""
    args, kwargs = call
    probe = torch.empty(list(range(2, 2 + ndim)), device="meta")  # distinct sizes reveal the permutation
    order = [n - 2 for n in func(probe, *args, **dict(kwargs)).shape]
    return layout.moved({s.dim: order.index(ndim + s.dim) - ndim for s in layout.shards})


def _freeze(value):
    """Dim lists as tuples, so that permute arguments can key a cache."""
    return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value


def _expand(func):
    def expand(input, *sizes):
        x, layout = unwrap(input)
        sizes = list(_sizes(sizes))
        for s in layout.shards:
            if sizes[s.dim] not in (-1, s.extent):
                raise LayoutError(
                    f"expand: dim {s.dim} is sharded with global size {s.extent}, cannot expand to {sizes[s.dim]}"
                )
            sizes[s.dim] = -1
        return adopt(func(x, sizes), layout)

    return expand


def _join(func):
    """cat/concat/stack along an unsharded dim: local. A replicated operand with the sharded operands' global size
    along every sharded dim (an upsampled 1x1 map, a position embedding) enters with this rank's rows
    (``tensor.localize``), so nothing is gathered. Operands sharded differently, or a cat along a sharded dim: the
    exact fallback. ``cat`` does not broadcast: a replicated size 1 there raises torch's own error."""
    stacks = func is torch.stack

    def join(tensors, dim):
        layout = next(t._layout for t in tensors if isinstance(t, SpatialTensor))
        ndim = next(t.dim() for t in tensors if isinstance(t, SpatialTensor)) + stacks  # of the result
        if not stacks and -ndim <= dim < ndim and (sets := token_sets(tensors, dim % ndim - ndim)) is not None:
            return adopt(func([t.to_local() for t in tensors], dim), sets)
        if not (-ndim <= dim < ndim and all(_joins(t, layout) for t in tensors)):
            return bad_or_fallback(func, (tensors, dim), {})
        at = dim % ndim
        if not stacks and any(ndim + d == at for d in layout.dims):
            return fallback(func, (tensors, dim), {})
        try:
            local = func([unwrap(localize(func, t, layout))[0] for t in tensors], dim)
        except RuntimeError:  # sizes that do not match: torch's message names the global ones
            raise_torch_error(func, (tensors, dim), {})
            raise
        return adopt(local, layout.moved({d: d - (stacks and ndim - 1 + d < at) for d in layout.dims}))

    return join


def token_sets(tensors, dim: int) -> Layout | None:
    """The layout of ``torch.cat(tensors, dim)`` along a sharded token dim, each operand a token set (a level of a
    feature pyramid, a camera) sharded over the same axes and alike on every other dim: the result holds their
    segments one after another (``Layout.segments``), each rank its own tokens of each; ``None`` otherwise. A set
    may be a plain sharded dim (a coarse level one row high) beside merged ones, not all of them (a cat of maps
    along their sharded width is no token set)."""
    if len(tensors) < 2 or not all(isinstance(t, SpatialTensor) for t in tensors):
        return None
    if not any(s.merged for t in tensors for s in t._layout.on(dim)):
        return None
    rest = tuple(s for s in tensors[0]._layout.shards if s.dim != dim)
    segments: dict = {}  # axis -> its factor's (outer, size, inner) per segment
    for t in tensors:
        on = t._layout.on(dim)
        if not on or tuple(x for x in t._layout.shards if x.dim != dim) != rest:
            return None
        if segments and {s.axis for s in on} != segments.keys():
            return None
        for s in on:
            segments.setdefault(s.axis, []).extend(s.segments or ((s.outer, s.size, s.inner),))
    extent = sum(math.prod(t) for t in next(iter(segments.values())))
    return Layout(rest + tuple(DimShard(dim, axis, extent, segments=tuple(sets)) for axis, sets in segments.items()))


def _joins(t: torch.Tensor, layout: Layout) -> bool:
    """Sharded like the others, or replicated with their global size along every sharded dim."""
    if isinstance(t, SpatialTensor):
        return t._layout == layout
    return all(t.dim() >= -s.dim and t.shape[s.dim] == s.extent for s in layout.shards)


def _split(func):
    """split/chunk/unbind along an unsharded dim: local (along a sharded dim: the exact fallback)."""
    removes = func in (torch.unbind, torch.Tensor.unbind)

    def split(dim, input=None, tensor=None, **sizes):  # ``torch.split`` names its operand ``tensor``
        input = tensor if input is None else input
        x, layout = unwrap(input)
        if not -x.dim() <= dim < x.dim():
            return bad_or_fallback(func, (input,), {"dim": dim, **sizes})
        at = dim % x.dim()
        if any(x.dim() + d == at for d in layout.dims):
            pieces = None if removes else _split_token_sets(x, layout, at - x.dim(), sizes)
            return fallback(func, (input,), {"dim": dim, **sizes}) if pieces is None else pieces
        new = layout.moved({d: d + (removes and x.dim() + d < at) for d in layout.dims})
        return tuple(adopt(o, new) for o in func(x, dim=dim, **sizes))

    return split


def _split_token_sets(x: torch.Tensor, layout: Layout, dim: int, sizes: dict) -> tuple | None:
    """``split`` of a dim of token segments at their borders (mmcv: ``value.split([h * w ...], dim=1)``): each piece
    keeps its segments' layout, locally, with no communication; ``None`` for any other split."""
    parts = layout.segments(dim)
    (wanted,) = sizes.values() if len(sizes) == 1 else (None,)
    if parts is None or not isinstance(wanted, (list, tuple)):
        return None
    extents = [p.on(dim)[0].extent for p in parts]
    local, groups, k = layout.local_sizes(dim), [], 0
    for size in map(int, wanted):  # consecutive segments that make up each piece
        j, total = k, 0
        while j < len(extents) and total < size:
            total, j = total + extents[j], j + 1
        if total != size or j == k:
            return None
        groups.append((k, j))
        k = j
    if k != len(extents):
        return None
    rest = tuple(s for s in layout.shards if s.dim != dim)
    on = layout.on(dim)
    pieces = x.split([sum(local[a:b]) for a, b in groups], dim)
    return tuple(
        adopt(piece, Layout(rest + (parts[a].shards if b - a == 1 else tuple(_subset(s, a, b) for s in on))))
        for piece, (a, b) in zip(pieces, groups)
    )


def _subset(s: DimShard, a: int, b: int) -> DimShard:
    """Segments ``a`` to ``b`` of a segmented factor."""
    return replace(s, size=sum(o * n * i for o, n, i in s.segments[a:b]), segments=s.segments[a:b])


def _index_map(index, ndim: int) -> dict[int, int] | None:
    """Input dim -> output dim (negative) of the dims indexed with a full slice ``:``; ``None`` if the index is not
    one torch applies dim by dim: ints, slices, ``None``, ``Ellipsis`` and at most one replicated advanced index
    (a boolean mask over one or more dims, or integer indices; tensor, numpy array or list), e.g. per-sample
    choices ``x[keep]`` with ``keep`` of shape ``(B,)``."""
    index = index if isinstance(index, tuple) else (index,)
    advanced = [k for k, i in enumerate(index) if not (i is None or i is Ellipsis or isinstance(i, (int, slice)))]
    if len(advanced) > 1 or any(isinstance(i, (bool, SpatialTensor)) for i in index):
        return None
    width = {}  # position in ``index`` -> (input dims it consumes, output dims it makes)
    for k in advanced:
        mask = torch.as_tensor(index[k])
        if mask.dtype == torch.bool:
            width[k] = (mask.dim(), 1)
        elif not mask.dtype.is_floating_point and not mask.dtype.is_complex:
            width[k] = (1, mask.dim())
        else:
            return None
    consumed = sum(width.get(k, (1,))[0] for k, i in enumerate(index) if i is not None and i is not Ellipsis)
    expanded = []
    for k, i in enumerate(index):
        expanded.extend([slice(None)] * (ndim - consumed) if i is Ellipsis else [width.get(k, i)])
    if not any(i is Ellipsis for i in index):  # ``in`` would compare arrays element-wise
        expanded.extend([slice(None)] * (ndim - consumed))
    mapping, d_in, d_out = {}, 0, 0
    for i in expanded:
        if i is None:
            d_out += 1
        elif isinstance(i, tuple):  # the advanced index's (consumed, made)
            d_in, d_out = d_in + i[0], d_out + i[1]
        elif isinstance(i, int):
            d_in += 1
        else:
            if i == slice(None):
                mapping[d_in] = d_out
            d_in, d_out = d_in + 1, d_out + 1
    return {k: v - d_out for k, v in mapping.items()}  # output dims as negative indices


def _indexed(layout: Layout, index, ndim: int) -> Layout | None:
    """The layout of ``x[index]`` when the index leaves every sharded dim of ``x`` whole; ``None`` otherwise."""
    mapping = _index_map(index, ndim)
    if mapping is None or any(ndim + d not in mapping for d in layout.dims):
        return None
    return layout.moved({d: mapping[ndim + d] for d in layout.dims})


def getitem(input, index):
    """Indexing that leaves every sharded dim whole (``x[:, 0]``, ``x[..., None]``, ``x[keep]`` with a replicated
    per-sample mask) is local."""
    x, layout = unwrap(input)
    target = _indexed(layout, index, x.dim())
    if target is None:
        return fallback(torch.Tensor.__getitem__, (input, index), {})
    return adopt(x[index], target)


def setitem(input, index, value):
    """``x[index] = value`` where the index leaves every sharded dim whole (``x[keep] = x[keep].flip(-1)``): each
    rank writes its rows; a replicated value is cut to them (``localize``)."""
    x, layout = unwrap(input)
    target = _indexed(layout, index, x.dim())
    if target is None or (isinstance(value, SpatialTensor) and value._layout != target):
        return fallback(torch.Tensor.__setitem__, (input, index, value), {})
    value = value.to_local() if isinstance(value, SpatialTensor) else localize(torch.Tensor.__setitem__, value, target)
    on_shard(torch.Tensor.__setitem__, input, index, value)


def flip(input, dims):
    """A flip along a sharded dim: each rank fetches the rows that land on it (its rows mirrored: ``fetch_window``
    from their owners, point to point), then flips locally. Merged (token) dims take the exact fallback."""
    x, layout = unwrap(input)
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if any(not -x.dim() <= d < x.dim() for d in dims):
        return bad_or_fallback(torch.flip, (input, dims), {})
    dims = tuple(d % x.dim() - x.dim() for d in dims)
    for d in dims:
        shards = layout.on(d)
        if any(s.merged for s in shards):
            return fallback(torch.flip, (input, dims), {})
        for s in shards:
            x = fetch_window(x, s, [(s.size - b, s.size - a) for a, b in s.bounds])
    return adopt(x.flip(dims), layout)


def one_hot(input, num_classes=-1):
    """A new trailing class dim; with ``num_classes=-1`` the class count is the *global* max + 1."""
    x, layout = unwrap(input)
    if num_classes == -1:
        top = across_detached(x.max().reshape(1), layout.shards, MAX)
        num_classes = int(top) + 1  # torch's one_hot syncs here too
    return adopt(F.one_hot(x, num_classes), layout.moved({d: d - 1 for d in layout.dims}))


def linear(input, weight, bias=None):
    require_replicated("linear", weight, bias)
    layout = input._layout
    if layout.dims[-1] == -1:
        raise LayoutError("linear: the last dim (features) is sharded; shard only spatial dims")
    return adopt(on_shard(F.linear, input, weight, bias), layout)


def _registrations() -> dict:
    handlers = {}
    for f in (torch.Tensor.view, torch.Tensor.reshape, torch.reshape):
        handlers[f] = _reshape(f)
    for like, f in ((torch.Tensor.view_as, torch.Tensor.view), (torch.Tensor.reshape_as, torch.Tensor.reshape)):
        handlers[like] = lambda x, other, to=handlers[f]: to(x, other.shape)  # other's shape is global
    for f in (
        torch.flatten,
        torch.Tensor.flatten,
        torch.unflatten,
        torch.Tensor.unflatten,
        torch._C.TensorBase.unflatten,  # what dynamo dispatches for x.unflatten (Tensor's Python method calls it)
        torch.squeeze,
        torch.Tensor.squeeze,
        torch.unsqueeze,
        torch.Tensor.unsqueeze,
    ):
        handlers[f] = _shape_op(f)
    for f in (
        torch.permute,
        torch.Tensor.permute,
        torch.transpose,
        torch.Tensor.transpose,
        torch.swapaxes,
        torch.Tensor.swapaxes,
        torch.movedim,
        torch.Tensor.movedim,
        torch.Tensor.mT.__get__,
    ):
        handlers[f] = _permute_op(f)
    expand = _expand(torch.Tensor.expand)
    handlers[torch.Tensor.expand] = expand
    handlers[torch.Tensor.expand_as] = lambda x, other: expand(x, other.shape)  # other's shape is global
    for f in (torch.cat, torch.concat, torch.concatenate, torch.stack):
        handlers.update(bound(_join(f), f))
    for f in (torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk, torch.unbind, torch.Tensor.unbind):
        handlers.update(bound(_split(f), f))
    handlers[F.linear] = linear
    handlers[F.one_hot] = one_hot
    handlers[torch.Tensor.__getitem__] = getitem
    handlers[torch.Tensor.__setitem__] = setitem
    handlers.update(bound(flip, torch.flip))
    handlers[torch.Tensor.flip] = lambda x, *dims, **named: flip(
        x, named.get("dims", dims[0] if len(dims) == 1 else dims)
    )
    return handlers


HANDLERS = _registrations()

__all__ = ["HANDLERS", "track"]
