"""Boolean masks over sharded dims: ``x[mask]``, ``x[mask] = v``, ``masked_select``, ``masked_scatter``, ``nonzero``.

On one device ``x[mask]`` is a ``(K, *rest)`` tensor of the selected rows in row-major order of the mask. Here each
rank keeps the rows of its own pixels or tokens, in local order: a ``Selection``, which also holds each local row's
index in the single-device result (``positions``), the row count ``K`` and the mesh axes the rows are spread over.
The positions come from the global running count of the mask, which ``torch.cumsum`` along its flattened sharded
dims computes from the ranks' totals (``ops.scan``: a count per mask row, never the mask); ``K`` is one all-reduce and
one host synchronisation (torch's ``nonzero`` synchronises too). Over token sets one after another (the levels of a
feature pyramid concatenated, ``Layout.segments``) the count runs level after level, as on one device.
``x[mask, :]``, ``x[mask, labels[mask]]`` (and ``= v``) index the other dims of the selected rows; replicated integer
indices into a token dim (``x[idx, :]``) give a Selection of the rows each rank holds, with no message. ``x[mask]``
and ``y[mask]`` with the same mask tensor share their positions (computed once per mask and its version), so their
rows line up without a message.

What a Selection does on its rows alone: shape queries answer the global ``(K, *rest)``; element-wise ops with
Selections of the same rows, scalars and replicated tensors that broadcast over the rows or have ``K`` of them (cut
to this rank's positions); ``sum``/``mean`` over the rows (a local sum, one all-reduce), over other dims (local);
the losses of ``ops.loss``; indexing and ``unbind`` that keep the rows dim; ``torch.max(a, b)``/``min``; a boolean
mask over the rows (``sel[keep]``, ``sel[keep] = v``: the selecting mask with the rows left out turned off gives
their positions). ``lightning_spatial.gather`` gives the
single-device tensor: each rank writes its rows at their positions into zeros, one all-reduce joins them. Any other
op (or Selections of other rows) takes the exact fallback: its Selections materialised that way, the op run, the
result replicated, announced as every fallback is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..collectives import across, across_detached
from ..fallback import announce, fallback, is_inplace
from ..layout import Layout
from ..mesh import Axis
from ..run import current
from ..tensor import SpatialTensor, _Plain, adopt, on_shard, wrap
from . import loss, shape
from ._binding import bound
from .elementwise import LAYOUT_PRESERVING, POINTWISE
from .elementwise import where as _where_elementwise
from .queries import LOCAL
from .queries import _local as local_query
from .reduce import agree, normalize_dims, refuse_integer_mean


@dataclass(frozen=True, eq=False)
class Rows:
    """Which rows of a selection this rank holds: ``positions`` (int64, each local row's index in the single-device
    result), ``count`` (K, all ranks' rows) and the ``axes`` they are spread over; ``flags`` and ``layout``, the
    mask that selected them (this rank's part, booleans) and how it is sharded, so that a mask over the rows
    (``sel[sel > 0]``) selects from the same elements (``None`` for rows taken by integer indices). Compared by
    identity: rows of one mask are one object."""

    positions: torch.Tensor
    count: int
    axes: tuple[Axis, ...]
    flags: torch.Tensor | None = None
    layout: Layout | None = None


class Selection(SpatialTensor):
    """This rank's rows of a boolean-mask selection (module docstring). A subclass of ``SpatialTensor`` so that its
    ``__torch_function__`` runs first wherever the two meet."""

    _rows: Rows

    @property
    def positions(self) -> torch.Tensor:
        return self._rows.positions

    @property
    def count(self) -> int:
        return self._rows.count

    @property
    def axes(self) -> tuple[Axis, ...]:
        return self._rows.axes

    def settled(self) -> torch.Tensor:
        return whole(self)

    def __repr__(self, *, tensor_contents=None) -> str:  # local: printing must not communicate
        with _Plain():
            return f"Selection({self._rows.count} rows, local={self.as_subclass(torch.Tensor)!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _OPS.get(func)
        if handler is None:
            return materialized(func, args, kwargs)
        return handler(*args, **kwargs)


_NO_LAYOUT = Layout(())


def selection(local: torch.Tensor, rows: Rows) -> Selection:
    """``local`` (rows first) as this rank's part of a selection of ``rows``."""
    with _Plain():
        out = local.as_subclass(Selection)
    out._rows, out._layout = rows, _NO_LAYOUT
    return out


def whole(sel: Selection) -> torch.Tensor:
    """The single-device tensor on every rank (differentiable): each rank writes its rows at their positions into
    zeros, one all-reduce sums the disjoint parts (booleans travel as bytes)."""
    local, rows = sel.to_local(), sel._rows
    wire = local.to(torch.uint8) if local.dtype == torch.bool else local
    full = wire.new_zeros((rows.count, *wire.shape[1:])).index_copy(0, rows.positions, wire)
    full = across(full, rows.axes)
    return full.bool() if local.dtype == torch.bool else full


def materialized(func, args: tuple, kwargs: dict):
    """The exact fallback for an op on Selections: each materialised (``whole``), ``func`` run, the result
    replicated; an in-place op on a Selection writes its rows back. Announced (an error in "error" mode)."""
    announce(func, [t for t in tree_flatten((args, kwargs))[0] if type(t) is Selection])
    full_args, full_kwargs = tree_map(lambda t: whole(t) if type(t) is Selection else t, (args, kwargs))
    out = func(*full_args, **full_kwargs)
    if is_inplace(func) and args and type(args[0]) is Selection:
        with _Plain():
            args[0].copy_(full_args[0].index_select(0, args[0]._rows.positions))
        return args[0]
    return out


def same_rows(a: Rows, b: Rows) -> bool:
    """Whether two selections hold the same rows on every rank (all ranks agree: one boolean all-reduce unless they
    are one object or differ in their count)."""
    if a is b:
        return True
    if a.count != b.count or a.axes != b.axes:
        return False
    here = a.positions.shape == b.positions.shape and torch.equal(a.positions, b.positions)
    return agree(here, a.axes, a.positions.device)


def common_rows(tensors) -> Rows | None:
    """The rows of the Selections among ``tensors`` if they are the same rows; ``None`` otherwise."""
    sels = [t for t in tensors if type(t) is Selection]
    rows = sels[0]._rows
    return rows if all(same_rows(rows, t._rows) for t in sels[1:]) else None


_NOT_LOCAL = object()


def _local(t, rows: Rows, ndim: int, leading: bool = False):
    """An operand next to Selections of ``ndim`` dims, as this rank uses it: a Selection (of these rows) or
    anything that broadcasts over the rows as it is, a replicated tensor with ``K`` rows (dim 0 of ``ndim``, or
    ``leading``: dim 0 whatever its dims, a loss's class-index target) cut to this rank's positions;
    ``_NOT_LOCAL`` otherwise (a shard, another row count, more dims)."""
    if type(t) is Selection or not isinstance(t, torch.Tensor):
        return t
    if isinstance(t, SpatialTensor):
        return _NOT_LOCAL
    if leading or t.dim() == ndim:
        if t.shape[0] == rows.count:
            return t.index_select(0, rows.positions.to(t.device))
        return t if t.shape[0] == 1 and not leading else _NOT_LOCAL
    return t if t.dim() < ndim else _NOT_LOCAL


def _missing(operands) -> bool:
    return any(t is _NOT_LOCAL for t in operands)


# -- where rows come from ----------------------------------------------------------------------------------------


def _derived(index: torch.Tensor) -> dict:
    """What the current run derived from a mask or index tensor (its rows: counting them communicates), by kind:
    ``x[mask]`` and ``y[mask]`` share them. Each entry holds the tensor's version it was derived at."""
    return current().index_rows.setdefault(index, {})


def rows_of(mask: torch.Tensor, layout: Layout) -> Rows:
    """The rows a mask (nonzero elements) selects on this rank, sharded as ``layout`` or replicated (cut by it)."""
    derived = _derived(mask)
    cached = derived.get("rows")  # (the mask's version, the layout, Rows)
    if cached is not None and cached[0] == mask._version and cached[1] == layout:
        return cached[2]
    mine = local_flags(mask, layout)
    if isinstance(mask, SpatialTensor):
        order, count = _running_count(mine, layout)
    else:
        flags = mask if mask.dtype == torch.bool else mask != 0
        order = layout.take_local(flags.flatten().cumsum(0).view(flags.shape)).reshape(-1)
        count = flags.sum()
    rows = _rows(order, count, mine, layout)
    derived["rows"] = (mask._version, layout, rows)
    return rows


def _rows(order: torch.Tensor, count, flags: torch.Tensor, layout: Layout) -> Rows:
    axes = tuple(s.axis for s in layout.shards)  # in the layout's order: the same on every rank
    return Rows(order[flags.reshape(-1)] - 1, int(count), axes, flags, layout)


def _running_count(flags: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """The global running count of a sharded mask in single-device (row-major) order at this rank's elements
    (``flags``, flattened), and the total. Token sets one after another (``Layout.segments``, the only sharded dim
    then: ``_mask_of``): per leading index, set after set (``torch.cumsum`` along the token dim, ``ops.scan``), the
    earlier leading indices' totals added (one all-reduce of a count per leading index)."""
    (dim, *more) = layout.dims
    if layout.segments(dim) is None:
        order = torch.cumsum(wrap(flags, layout).flatten(), 0).to_local()  # local entries (ops.scan)
        return order, across_detached(flags.sum().reshape(1), layout.shards)
    assert not more, "a mask over token sets is sharded along its token dim only (_mask_of)"
    pos = flags.dim() + dim
    grid = flags.reshape(math.prod(flags.shape[:pos]), flags.shape[pos], -1).to(torch.int64)  # lead, tokens, trail
    per_token = grid.sum(-1)
    along = torch.cumsum(wrap(per_token, layout.moved({dim: -1})), -1).to_local()  # inclusive, set after set
    totals = across_detached(per_token.sum(-1), layout.shards)  # per leading index
    order = (totals.cumsum(0) - totals)[:, None, None] + (along - per_token)[..., None] + grid.cumsum(-1)
    return order.reshape(-1), totals.sum()


def sub_rows(rows: Rows, mask: torch.Tensor) -> Rows:
    """The rows a boolean mask over a selection's rows picks (``sel[sel > 0]``): the selecting mask with the rows
    left out turned off, its running count as ``rows_of`` counts. ``mask``: a Selection of ``rows`` or a replicated
    tensor of their ``K`` flags."""
    derived = _derived(mask)
    cached = derived.get("sub_rows")  # (the mask's version, the selection's rows, the rows it picks)
    if cached is not None and cached[0] == mask._version and cached[1] is rows:
        return cached[2]
    flags = rows.flags.clone()
    flags[rows.flags] = _row_flags(rows, mask)
    out = _rows(*_running_count(flags, rows.layout), flags, rows.layout)
    derived["sub_rows"] = (mask._version, rows, out)
    return out


def local_flags(mask: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's part of a mask as booleans (a replicated one cut by ``layout``)."""
    local = mask.to_local() if isinstance(mask, SpatialTensor) else layout.take_local(mask)
    return local if local.dtype == torch.bool else local != 0


def _mask_of(input, index) -> tuple[torch.Tensor, Layout, int, tuple] | None:
    """(mask, its layout, input dims after it, the index after it) when ``index`` is a boolean mask over the leading
    dims of ``input`` that holds every sharded dim of a sharded ``input``, or is sharded itself next to a replicated
    ``input``, followed by slices, ``...``, integers or integer indices of the selected rows (``x[mask]``,
    ``x[mask, :]``, ``x[mask, 1:]``, ``x[mask, labels[mask]]``: ``_tail``); ``None`` otherwise (other indices, a
    mask over unsharded dims: ``ops.shape``). A mask over token sets one after another (``Layout.segments``) holds
    no other sharded dim."""
    tail = ()
    if isinstance(index, tuple) and index:
        index, tail = index[0], index[1:]
    if isinstance(index, np.ndarray) and index.dtype == np.bool_:
        index = torch.from_numpy(index)
    if not isinstance(index, torch.Tensor) or index.dtype != torch.bool or type(index) is Selection:
        return None
    if type(input) is Selection or index.dim() > input.dim() or input.shape[: index.dim()] != index.shape:
        return None
    if sum(i is Ellipsis for i in tail) > 1 or sum(i is not Ellipsis for i in tail) > input.dim() - index.dim():
        return None
    if not all(isinstance(i, (slice, int, torch.Tensor)) and not isinstance(i, bool) or i is Ellipsis for i in tail):
        return None
    rest = input.dim() - index.dim()
    if not isinstance(input, SpatialTensor):  # a replicated input, a sharded mask: cut the input like the mask
        layout = index._layout
    elif any(s.dim + rest >= 0 for s in input._layout.shards):  # a sharded dim outside the mask
        return None
    else:
        layout = input._layout.moved({d: d + rest for d in input._layout.dims})
        if isinstance(index, SpatialTensor) and index._layout != layout:
            return None
    if any(s.segments for s in layout.shards) and len(layout.dims) > 1:  # token sets beside another sharded dim
        return None
    return index, layout, rest, tail


def _whole(i) -> bool:
    """``...`` or ``:``."""
    return i is Ellipsis or (isinstance(i, slice) and i == slice(None))


def _tail(tail: tuple, rows: Rows) -> tuple | None:
    """The index after a mask as this rank applies it: slices, ``...`` and integers as they are, integer indices
    of the selected rows (a Selection of them, a replicated tensor of ``K`` cut to this rank's positions, or one
    that broadcasts); ``None`` (the fallback) for anything else."""
    out = []
    for i in tail:
        if isinstance(i, torch.Tensor):
            if i.dtype.is_floating_point or i.dtype.is_complex or i.dtype == torch.bool or i.dim() > 1:
                return None
            if type(i) is Selection:
                i = i.to_local() if same_rows(rows, i._rows) else None
            elif isinstance(i, SpatialTensor):
                i = None
            elif i.dim() == 1 and i.shape[0] == rows.count:
                i = i.index_select(0, rows.positions.to(i.device))
            elif i.dim() == 1 and i.shape[0] != 1:
                i = None
            if i is None:
                return None
        out.append(i)
    return tuple(out)


def _selected_dims(input, rest: int, tail: tuple) -> int:
    """The dims of ``input[mask, *tail]``: the rows, then the dims the tail keeps."""
    return 1 + rest - sum(isinstance(i, (int, torch.Tensor)) for i in tail)


def _select(input, mask: torch.Tensor, layout: Layout, rest: int, tail: tuple = ()) -> Selection:
    """``input[mask, *tail]``: this rank's rows (a replicated input cut like the mask first)."""
    rows = rows_of(mask, layout)
    items = _tail(tail, rows)
    if items is None:
        return _fallback(torch.Tensor.__getitem__, (input, (mask, *tail)))
    local = (
        input.to_local()
        if isinstance(input, SpatialTensor)
        else layout.moved({d: d - rest for d in layout.dims}).take_local(input)
    )
    return selection(local[(local_flags(mask, layout), *items)], rows)


def _indices_of(input, index) -> tuple[torch.Tensor, tuple] | None:
    """(indices, the index after them) for ``x[idx]``, ``x[idx, :]``: replicated 1-D integer indices into the
    leading dim of ``input``, its only sharded dim (RetinaNet's ``bbox_regression[torch.where(fg)[0], :]`` over a
    token dim), slices or ``...`` after them; ``None`` otherwise."""
    tail = ()
    if isinstance(index, tuple) and index:
        index, tail = index[0], index[1:]
    if not isinstance(index, torch.Tensor) or isinstance(index, SpatialTensor) or index.dim() != 1:
        return None
    if index.dtype == torch.bool or index.dtype.is_floating_point or index.dtype.is_complex:
        return None
    if not isinstance(input, SpatialTensor) or type(input) is Selection or input._layout.dims != (-input.dim(),):
        return None
    if not all(isinstance(i, slice) or i is Ellipsis for i in tail) or len(tail) >= input.dim() + (Ellipsis in tail):
        return None
    return index, tail


def _take(input, index: torch.Tensor, tail: tuple):
    """``x[idx, *tail]``: every rank takes the indexed rows it holds, a Selection of ``len(idx)`` rows (positions:
    where in ``idx`` they are); no communication. Indices out of range: the fallback (torch's error)."""
    layout = input._layout
    derived = _derived(index)
    cached = derived.get("taken")  # (the indices' version, the layout, Rows, this rank's local rows)
    if cached is None or cached[0] != index._version or cached[1] != layout:
        extent = layout.on(-input.dim())[0].extent
        if index.numel() and not (-extent <= int(index.min()) and int(index.max()) < extent):
            return fallback(torch.Tensor.__getitem__, (input, (index, *tail)), {})
        owners = layout.owners(-input.dim(), index.device)[index % extent]
        mine = owners >= 0
        rows = Rows(mine.nonzero().flatten(), index.numel(), tuple(s.axis for s in layout.shards))
        cached = (index._version, layout, rows, owners[mine])
        derived["taken"] = cached
    return selection(input.to_local()[(cached[3], *tail)], cached[2])


# -- handlers ----------------------------------------------------------------------------------------------------


def getitem(input, index):
    """``x[mask]`` over sharded dims, ``x[coordinates]`` with Selections of coordinates, a Selection indexed along
    its other dims; everything else as ``ops.shape`` indexes."""
    if type(input) is Selection:
        return _index_rows(input, index)
    picked = _mask_of(input, index)
    if picked is not None:
        return _select(input, *picked)
    taken = _indices_of(input, index)
    if taken is not None:
        return _take(input, *taken)
    if isinstance(index, tuple) and any(type(i) is Selection for i in index):
        out = _by_coordinates(input, index)
        return materialized(torch.Tensor.__getitem__, (input, index), {}) if out is None else out
    if type(index) is Selection:
        return materialized(torch.Tensor.__getitem__, (input, index), {})
    return shape.getitem(input, index)


def _row_mask(sel: Selection, index) -> torch.Tensor | None:
    """A boolean mask over a selection's rows (``sel[keep]``, ``sel[keep, ...]``, ``sel[keep, :]``): a Selection
    of its rows or a replicated tensor of its ``K`` flags; ``None`` for any other index."""
    tail = ()
    if isinstance(index, tuple) and index:
        index, tail = index[0], index[1:]
    if not isinstance(index, torch.Tensor) or index.dtype != torch.bool or index.dim() != 1:
        return None
    if not all(_whole(i) for i in tail) or sum(i is not Ellipsis for i in tail) >= sel.dim():
        return None
    if sel._rows.flags is None:  # rows taken by integer indices: no mask to narrow
        return None
    if type(index) is Selection:
        return index if same_rows(sel._rows, index._rows) else None
    return None if isinstance(index, SpatialTensor) or index.shape[0] != sel._rows.count else index


def _row_flags(rows: Rows, keep: torch.Tensor) -> torch.Tensor:
    """This rank's part of a mask over a selection's rows."""
    return keep.to_local() if type(keep) is Selection else keep.index_select(0, rows.positions.to(keep.device))


def _index_rows(sel: Selection, index):
    """``sel[:, 0]``, ``sel[..., :2]``: an index that keeps the rows dim first is local; ``sel[keep]`` with a
    boolean mask over the rows: the rows it picks (``sub_rows``)."""
    keep = _row_mask(sel, index)
    if keep is not None:
        picked = sub_rows(sel._rows, keep)
        return selection(sel.to_local()[_row_flags(sel._rows, keep)], picked)
    mapping = shape._index_map(index, sel.dim())
    with _Plain():
        out = sel[index] if mapping is not None and 0 in mapping else None
    if out is None or mapping[0] != -out.dim():
        return materialized(torch.Tensor.__getitem__, (sel, index), {})
    return selection(out, sel._rows)


def _by_coordinates(input, index) -> Selection | None:
    """``x[coords]``, a tuple of Selections of integer coordinates of the same rows over the leading dims of ``x``
    (``nonzero(mask, as_tuple=True)``, ``torch.where(mask)``, ``idx.unbind(1)``): local where every rank holds the
    elements of its rows (one boolean all-reduce says so); ``None`` (the fallback) otherwise."""
    if type(input) is Selection or not all(type(i) is Selection and i.dim() == 1 for i in index):
        return None
    if len(index) > input.dim() or any(i.dtype.is_floating_point or i.dtype == torch.bool for i in index):
        return None
    rows = common_rows(index)
    if rows is None:
        return None
    coords = [i.to_local() for i in index]
    if not isinstance(input, SpatialTensor):  # replicated: the global coordinates index it as they are
        return selection(input[tuple(coords)], rows)
    layout, n = input._layout, input.dim()
    if any(s.dim + n >= len(index) for s in layout.shards):
        return None
    if {s.axis for s in layout.shards} != set(rows.axes):
        return None
    held = True
    for j, c in enumerate(coords):
        if layout.on(j - n):
            extent = layout.on(j - n)[0].extent
            inside = (c >= 0) & (c < extent)
            c = layout.owners(j - n, c.device)[c.clamp(0, extent - 1)].masked_fill(~inside, -1)
            held = held and bool((c >= 0).all())
            coords[j] = c
    if not agree(held, rows.axes, input.device):
        return None
    return selection(input.to_local()[tuple(coords)], rows)


def setitem(input, index, value):
    """``x[mask] = v``, ``x[mask, labels[mask]] = v`` over sharded dims, and ``sel[keep] = v`` over a selection's
    rows, locally: ``v`` a scalar or a replicated tensor that broadcasts over the rows, a replicated tensor of ``K``
    rows (cut to this rank's positions), or a Selection of the same rows."""
    call = (input, index, value)
    if type(input) is Selection:
        keep = _row_mask(input, index)
        if keep is None:
            return materialized(torch.Tensor.__setitem__, call, {})
        local = _written(value, lambda: sub_rows(input._rows, keep), input.dim())
        if local is _NOT_LOCAL:
            return materialized(torch.Tensor.__setitem__, call, {})
        on_shard(torch.Tensor.__setitem__, input, _row_flags(input._rows, keep), local)
        return
    picked = _mask_of(input, index) if isinstance(input, SpatialTensor) else None
    if picked is None:
        if _has_selection(call):
            return materialized(torch.Tensor.__setitem__, call, {})
        return shape.setitem(input, index, value)
    mask, layout, rest, tail = picked
    items = _tail(tail, rows_of(mask, layout)) if any(isinstance(i, torch.Tensor) for i in tail) else tail
    local = _written(value, lambda: rows_of(mask, layout), _selected_dims(input, rest, tail))
    if items is None or local is _NOT_LOCAL:
        return _fallback(torch.Tensor.__setitem__, call)
    on_shard(torch.Tensor.__setitem__, input, (local_flags(mask, layout), *items), local)


def _written(value, rows, ndim: int):
    """A value written to ``ndim``-dim selected rows (``rows()`` says which, asked only when the value has a rows
    dim), as this rank writes it: a scalar, a replicated tensor that broadcasts or has their ``K`` rows (cut to this
    rank's positions), a Selection of those rows; ``_NOT_LOCAL`` otherwise."""
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, SpatialTensor) and type(value) is not Selection:
        return _NOT_LOCAL
    if type(value) is not Selection and value.dim() != ndim:
        return _local(value, None, ndim)
    mine = rows()
    if type(value) is Selection and (value.dim() != ndim or not same_rows(mine, value._rows)):
        return _NOT_LOCAL
    return _local(value, mine, ndim)


def masked_select(input, mask):
    """``masked_select`` with a mask of the input's shape: ``input[mask]``; broadcasting masks: the fallback."""
    picked = _mask_of(input, mask) if input.shape == mask.shape else None
    if picked is None:
        return _fallback(torch.masked_select, (input, mask))
    return _select(input, *picked)


def _masked_scatter(func):
    """``x.masked_scatter(mask, source)`` with a mask of ``x``'s shape: the source's first K elements go to the
    selected elements in order, so this rank takes those of its positions (a replicated source) or a Selection
    of the same rows."""
    inplace = is_inplace(func)

    def masked_scatter(input, mask, source):
        picked = _mask_of(input, mask) if isinstance(input, SpatialTensor) and input.shape == mask.shape else None
        if picked is None:
            return _fallback(func, (input, mask, source))
        rows = rows_of(mask, picked[1])
        if type(source) is Selection:
            values = source.to_local() if source.dim() == 1 and same_rows(rows, source._rows) else None
        elif isinstance(source, SpatialTensor) or source.numel() < rows.count:
            values = None
        else:
            values = source.flatten().index_select(0, rows.positions.to(source.device))
        if values is None:
            return _fallback(func, (input, mask, source))
        out = on_shard(func, input, local_flags(mask, picked[1]), values)
        return out if inplace else adopt(out, input._layout)

    return masked_scatter


def _has_selection(args) -> bool:
    return any(type(t) is Selection for t in tree_flatten(args)[0])


def _fallback(func, args: tuple, kwargs: dict | None = None):
    """The fallback that suits the operands: materialising Selections, or gathering shards."""
    kwargs = kwargs or {}
    return (materialized if _has_selection((args, kwargs)) else fallback)(func, args, kwargs)


def nonzero(input, *, as_tuple=False, out=None):
    """Global coordinates of a sharded tensor's nonzero elements: local ``nonzero`` plus each sharded dim's
    offsets (``Layout.positions``), as a Selection of the rows ``input[input != 0]`` has (same order)."""
    layout = input._layout
    if type(input) is Selection or out is not None or (any(s.segments for s in layout.shards) and len(layout.dims) > 1):
        return _fallback(torch.nonzero, (input,), {"as_tuple": as_tuple} if out is None else {"out": out})
    rows = rows_of(input, layout)
    coords = list(local_flags(input, layout).nonzero().unbind(1))
    for d in layout.dims:
        coords[d] = layout.positions(d, input.device)[coords[d]]
    if as_tuple:
        return tuple(selection(c, rows) for c in coords)
    return selection(torch.stack(coords, 1), rows)


def argwhere(input):
    return nonzero(input)


def _where(three):
    """``torch.where(condition)`` is ``nonzero(condition, as_tuple=True)``; with three operands, ``three``."""

    def where(*args, **kwargs):
        if len(args) + len(kwargs) == 1:
            (condition,) = (*args, *kwargs.values())
            if type(condition) is Selection:
                return materialized(torch.where, args, kwargs)
            return nonzero(condition, as_tuple=True)
        return three(*args, **kwargs)

    return where


# -- ops on a Selection's rows -----------------------------------------------------------------------------------


def _global_shape(sel) -> torch.Size:
    with _Plain():
        local = sel.shape
    return torch.Size((sel._rows.count, *local[1:]))


def _size(sel, dim=None):
    shape = _global_shape(sel)
    return shape if dim is None else shape[dim]


_SIZES = {
    torch.Tensor.shape.__get__: _global_shape,
    torch.Tensor.size: _size,
    torch.Tensor.numel: lambda x: _global_shape(x).numel(),
    torch.Tensor.nelement: lambda x: _global_shape(x).numel(),
    torch.numel: lambda x: _global_shape(x).numel(),
    torch.Tensor.__len__: lambda x: x._rows.count,
    torch.Tensor.nbytes.__get__: lambda x: _global_shape(x).numel() * x.element_size(),
}


def _elementwise(func):
    """``func`` on the rows of Selections of the same rows, replicated operands that broadcast over them or are cut
    to this rank's positions; an in-place op on a replicated tensor must write all of it: the fallback."""
    inplace = is_inplace(func)

    def run(*args, **kwargs):
        sels = [t for t in tree_flatten((args, kwargs))[0] if type(t) is Selection]
        ndim = sels[0].dim()
        rows = common_rows(sels) if all(s.dim() == ndim for s in sels) else None
        local = None if rows is None else tree_map(lambda t: _local(t, rows, ndim), (args, kwargs))
        if local is None or _missing(tree_flatten(local)[0]) or (inplace and type(args[0]) is not Selection):
            return materialized(func, args, kwargs)
        with _Plain():
            out = func(*local[0], **local[1])
        for t in sels:  # an operand returned as it is (in place, or x.float() of a float x)
            if out is t:
                return t
        return tree_map(lambda o: selection(o, rows) if isinstance(o, torch.Tensor) else o, out)

    return run


def _pairwise(func):
    """``torch.max(a, b)``, ``torch.min(a, b)``: element-wise (``_elementwise``); a reduction over a selection:
    the fallback."""
    pair = _elementwise(func)

    def run(*args, **kwargs):
        if (len(args) > 1 and isinstance(args[1], torch.Tensor)) or isinstance(kwargs.get("other"), torch.Tensor):
            return pair(*args, **kwargs)
        return materialized(func, args, kwargs)

    return run


def _reduction(kind: str):
    """``sum``/``mean``: over the rows a local sum and one all-reduce (a mean divides by the global count); over
    other dims local."""

    def reduce(input, dim=None, keepdim=False, dtype=None):
        x, rows = input.to_local(), input._rows
        refuse_integer_mean(kind, x, dtype)
        dims = normalize_dims(dim, x.dim())
        options = {"dtype": dtype} if dtype is not None else {}
        if dims[0] != -x.dim():  # the rows stay
            return selection(getattr(torch, kind)(x, dims, keepdim, **options), rows)
        total = across(x.sum(dims, keepdim=keepdim, **options), rows.axes)
        return total if kind == "sum" else total / (rows.count * math.prod(x.shape[d] for d in dims[1:]))

    reduce.__name__ = kind
    return reduce


def _on_rows(fn, operands) -> loss.Placed:
    """A loss's operands as rows of one selection (``ops.loss``): Selections of the same rows, replicated targets
    and weights cut to this rank's positions or broadcast; otherwise the Selections materialised (the fallback)."""
    sels = [t for t in operands if type(t) is Selection]
    rows, ndim = common_rows(sels), operands[0].dim()
    if rows is not None:
        local = [_local(t, rows, ndim, i == 1 and fn in loss.CLASS_TARGETS) for i, t in enumerate(operands)]
        if not _missing(local):
            return loss.Placed(
                [t.to_local() if type(t) is Selection else t for t in local],
                rows.axes,
                lambda t: rows.count * math.prod(t.shape[1:]),
                lambda t: selection(t, rows),
            )
    announce(fn, sels)
    return loss.on_layout(fn, [whole(t) if type(t) is Selection else t for t in operands])


def _unbind(input, dim=0):
    if dim % input.dim() == 0:
        return materialized(torch.unbind, (input, dim), {})
    with _Plain():
        return tuple(selection(t, input._rows) for t in torch.unbind(input, dim))


HANDLERS = {
    torch.Tensor.__getitem__: getitem,
    torch.Tensor.__setitem__: setitem,
    **bound(masked_select, torch.masked_select, torch.Tensor.masked_select),
    **{f: bound(_masked_scatter(f), f)[f] for f in (torch.masked_scatter, torch.Tensor.masked_scatter)},
    **bound(_masked_scatter(torch.Tensor.masked_scatter_), torch.Tensor.masked_scatter_),
    torch.nonzero: nonzero,
    torch.Tensor.nonzero: nonzero,
    torch.argwhere: argwhere,
    torch.Tensor.argwhere: argwhere,
    torch.where: _where(_where_elementwise),
}

# What a Selection's ``__torch_function__`` runs; any other function takes ``materialized``.
_OPS = {
    **{f: local_query(f) for f in LOCAL},
    **_SIZES,
    **{f: _elementwise(f) for f in POINTWISE | LAYOUT_PRESERVING | {torch.Tensor.to, torch.Tensor.where}},
    **HANDLERS,
    torch.where: _where(_elementwise(torch.where)),
    **bound(_reduction("sum"), torch.sum, torch.Tensor.sum),
    **bound(_reduction("mean"), torch.mean, torch.Tensor.mean),
    **loss.losses(_on_rows),
    **bound(_unbind, torch.unbind, torch.Tensor.unbind),
    **{f: _pairwise(f) for f in (torch.max, torch.min, torch.Tensor.max, torch.Tensor.min)},
}

__all__ = ["HANDLERS", "Rows", "Selection", "materialized", "nonzero", "rows_of", "selection", "whole"]
