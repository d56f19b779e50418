"""Fetch a window ``[a, b)`` of a sharded dim, padded per mode, and its adjoint (scatter-add to owners).

Every spatial op reduces to this primitive with its own window arithmetic (``layout.py``). All ranks of
the axis know every rank's window (it follows from the op and the partition rule), so each rank knows what
to send to whom without a handshake. Messages are neighbour point-to-point (one per ordered pair of ranks
that share rows, so a thin shard makes data come from further ranks), batched as ``batch_isend_irecv`` does.
Positions outside ``[0, n)`` read the mode's source row (reflect, replicate, circular: possibly from the
far border rank) or the fill value. A window inside the rank's own rows is a view: no copy, no message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from . import run
from .collectives import communicates
from .layout import DimShard, partition, source_index
from .mesh import group_of
from .plans import planned

# A selection along the dim: a ``range`` for a contiguous run (narrow), else a tuple of indices.
Selection = range | tuple[int, ...]


@dataclass(frozen=True)
class _Plan:
    length: int
    view: range | None  # the window is exactly these local rows: return a view
    local: tuple[Selection, Selection] | None  # (window positions, local rows)
    recvs: tuple[tuple[int, Selection, int], ...]  # (peer index, window positions, count)
    sends: tuple[tuple[int, Selection], ...]  # (peer index, local rows)
    fill: Selection | None  # window positions that read the fill value (padding)
    pieces: tuple[range | int | None, ...] | None = None  # the window in order when runs tile it (``_in_order``)


def _selection(values: list[int]) -> Selection:
    run = range(values[0], values[0] + len(values))
    return run if values == list(run) else tuple(values)


@planned(maxsize=1024)
def _plan(n: int, parts: int, me: int, windows: tuple[tuple[int, int], ...], mode: str) -> _Plan:
    bounds = partition(n, parts)

    def pieces(j: int) -> dict[int, tuple[list[int], list[int]]]:
        """For rank j's window: owner -> (window positions, owner's local rows)."""
        a, b = windows[j]
        out: dict[int, tuple[list[int], list[int]]] = {}
        for pos in range(a, b):
            src = source_index(pos, n, mode)
            if src >= 0:
                owner = next(r for r, (s, e) in enumerate(bounds) if s <= src < e)
                positions, rows = out.setdefault(owner, ([], []))
                positions.append(pos - a)
                rows.append(src - bounds[owner][0])
        return out

    mine = pieces(me)
    a, b = windows[me]
    padding = [pos - a for pos in range(a, b) if source_index(pos, n, mode) < 0]
    fill = _selection(padding) if padding else None
    local = (_selection(mine[me][0]), _selection(mine[me][1])) if me in mine else None
    recvs = tuple((r, _selection(p), len(p)) for r, (p, _) in sorted(mine.items()) if r != me)
    sends = []
    for j in range(parts):
        theirs = pieces(j) if j != me else {}
        if me in theirs:
            sends.append((j, _selection(theirs[me][1])))
    if fill is None and not recvs and not sends and local is not None and all(isinstance(s, range) for s in local):
        return _Plan(b - a, local[1], None, (), (), None)
    return _Plan(b - a, None, local, recvs, tuple(sends), fill, _in_order(b - a, local, recvs, fill))


def _in_order(length: int, local, recvs, fill) -> tuple[range | int | None, ...] | None:
    """The window as consecutive runs, to be joined by one ``cat``: local rows (a ``range``), the k-th received
    buffer (``k``), the padding (``None``: ``fill`` positions); ``None`` when positions are scattered."""
    runs = [(pos, k) for k, (_, pos, _) in enumerate(recvs)]  # (window positions, source)
    if local is not None:
        runs.append(local)
    if fill is not None:
        runs.append((fill, None))
    if not all(isinstance(pos, range) and not isinstance(src, tuple) for pos, src in runs):
        return None
    runs.sort(key=lambda run: run[0].start)
    if [pos.start for pos, _ in runs] != [0, *(pos.stop for pos, _ in runs[:-1])] or runs[-1][0].stop != length:
        return None
    return tuple(src for _, src in runs)


def _p2p(group, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
    """One batch of neighbour messages (``(index on the axis, tensor)``), straight on the axis's process group.

    What ``dist.batch_isend_irecv`` does, without its per-message Python (a ``P2POp`` and ``isend``'s checks
    and group lookups: ~4 us each, four messages per halo and direction): NCCL coalesces the batch into one
    launch (so the order of sends and receives cannot deadlock), other backends run the messages as given. In the
    planner's probe (``Run.zero_undelivered``) the groups are fake and deliver nothing: what arrives reads as zeros,
    not as uninitialised memory, where a NaN would stop a detector's Hungarian matching."""
    if not sends and not recvs:
        return
    if run.current().zero_undelivered:
        for _, t in recvs:
            t.zero_()
    device = (sends or recvs)[0][1].device
    coalesce = _coalesces(group, device)
    if coalesce:
        group._start_coalescing(device)
    works = [group.send([t], j, 0) for j, t in sends] + [group.recv([t], j, 0) for j, t in recvs]
    if coalesce:
        works = [group._end_coalescing(device)]
    for work in works:
        work.wait()


def _coalesces(group: dist.ProcessGroup, device: torch.device) -> bool:
    return getattr(group._get_backend(device), "supports_coalescing", False)


def _shape(x: torch.Tensor, dim: int, length: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = length
    return shape


def empty_as(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` laid out in memory like ``x`` (e.g. channels_last stays
    channels_last: cuDNN's depthwise kernels need it, the native NCHW ones are several times slower)."""
    return torch.empty_strided(shape, _strides_like(x.stride(), tuple(shape)), dtype=x.dtype, device=x.device)


@planned
def memory_order(strides: tuple[int, ...]) -> tuple[int, ...]:
    """Dims from outermost to innermost in memory; ties (a size-1 dim) keep their index order."""
    return tuple(sorted(range(len(strides)), key=lambda d: strides[d], reverse=True))


@planned
def _strides_like(strides: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    order = memory_order(strides)
    out, step = [0] * len(shape), 1
    for d in reversed(order):
        out[d], step = step, step * shape[d]
    return tuple(out)


@planned
def _non_overlapping(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether no two elements of a tensor of this shape and strides share memory (not expanded)."""
    extent = 1  # the span of the inner dims, in elements
    for size, stride in sorted(((z, t) for z, t in zip(shape, strides) if z > 1), key=lambda d: d[1]):
        if stride < extent:
            return False
        extent = stride * (size - 1) + extent
    return True


def _count_sent(sends: list[tuple[int, torch.Tensor]]) -> None:
    """Add the bytes of ``sends`` to every entered ``run.counting_halo_bytes`` block (of any run)."""
    counters = [c for r in run._RUNS for c in r.halo_counters]
    if counters:
        sent = sum(t.numel() * t.element_size() for _, t in sends)
        for counter in counters:
            counter.sent += sent


def _laid_out_like(like: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` with ``like``'s memory layout: itself if it has it, else a copy. Messages travel contiguous (what
    every backend takes, and what sender and receiver agree on whatever their shards' strides); a channels_last
    window is joined from channels_last pieces: with NCHW halos among them, the ``cat`` ran up to 12x slower
    (H200, bf16, ConvNeXt-XL's first stage at S = 8: 843 us, against 70 us with the halos' copies;
    tools/bench_window.py)."""
    if t.stride() == _strides_like(like.stride(), tuple(t.shape)):
        return t
    return empty_as(like, list(t.shape)).copy_(t)


def _cat(parts: list[torch.Tensor], dim: int, out: torch.Tensor) -> None:
    """``torch.cat(parts, dim, out=out)`` on views whose dims are in memory order (``out`` dense, every part laid
    out like it): the copy runs as over contiguous tensors."""
    order = memory_order(out.stride())
    if order == tuple(range(len(order))):  # already in memory order (NCHW): no views to make
        torch.cat(parts, dim, out=out)
    else:
        torch.cat([p.permute(order) for p in parts], order.index(dim % out.dim()), out=out.permute(order))


def _received(x: torch.Tensor, plan: _Plan, dim: int, group) -> list[torch.Tensor]:
    """Send the rows of ``x`` that other ranks' windows read; the rows this rank's window reads from others, in
    ``plan.recvs``'s order."""
    sends = [(j, _select(x, dim, rows).contiguous()) for j, rows in plan.sends]
    recvs = [(j, x.new_empty(_shape(x, dim, count))) for j, _, count in plan.recvs]
    _count_sent(sends)
    _p2p(group, sends, recvs)
    return [buf for _, buf in recvs]


def _window(x: torch.Tensor, plan: _Plan, dim: int, group, fill: float) -> torch.Tensor:
    received = _received(x, plan, dim, group)
    out = empty_as(x, _shape(x, dim, plan.length))
    if plan.pieces is not None:  # one copy kernel for the whole window, its parts laid out like it
        padding = empty_as(out, _shape(x, dim, _count(plan.fill))).fill_(fill) if plan.fill is not None else None
        _cat(_in_runs(x, dim, plan.pieces, [_laid_out_like(out, buf) for buf in received], padding), dim, out)
        return out
    if plan.fill is not None:
        _fill(out, dim, plan.fill, fill)
    if plan.local is not None:
        _put(out, dim, plan.local[0], _select(x, dim, plan.local[1]))
    for (_, pos, _), buf in zip(plan.recvs, received):
        _put(out, dim, pos, buf)
    return out


def _in_runs(x, dim, pieces, received: list[torch.Tensor], padding) -> list[torch.Tensor]:
    """The window's runs in order (``_Plan.pieces``): rows of ``x``, received rows, the padding block."""
    return [_select(x, dim, p) if isinstance(p, range) else padding if p is None else received[p] for p in pieces]


def _window_grad(grad: torch.Tensor, plan: _Plan, dim: int, group, local_shape, own_grad: bool) -> torch.Tensor:
    """The adjoint of ``_window``: each window row's gradient is added to the row it was read from."""
    sends = [(j, _select(grad, dim, pos).contiguous()) for j, pos, _ in plan.recvs]
    recvs = [(j, grad.new_empty(_shape(grad, dim, _count(rows)))) for j, rows in plan.sends]
    _count_sent(sends)
    _p2p(group, sends, recvs)
    n = local_shape[dim]
    if plan.local is not None and plan.local[1] == range(0, n) and isinstance(plan.local[0], range):
        # the window holds all our rows in order (a conv halo): our rows of its gradient, a view where that
        # gradient is ours to write (``own_grad``, and no element aliases another), else one copy; the halos'
        # gradients are then added to its border rows, which the sends above did not read
        grad_x = _select(grad, dim, plan.local[0])
        if not (own_grad and _non_overlapping(tuple(grad.shape), grad.stride())):
            grad_x = grad_x.clone(memory_format=torch.preserve_format)
    else:
        grad_x = empty_as(grad, list(local_shape)).zero_()
        if plan.local is not None:
            _add(grad_x, dim, plan.local[1], _select(grad, dim, plan.local[0]))
    for (_, rows), (_, buf) in zip(plan.sends, recvs):
        _add(grad_x, dim, rows, buf)
    return grad_x


def _nested_window(x: torch.Tensor, steps, fill: float) -> torch.Tensor:
    """Windows along several dims written into one tensor: each dim's received rows and padding go straight to
    their places, and ``x`` is copied once (where one window after the other copies the widened tensor once per
    dim). Each step sends from what the steps before it wrote (2-D tiles receive their corners from the
    neighbour's widened rows, as one window after the other does). ``steps``: (dim, plan, group) in order; every
    plan after the first holds all the rank's rows in order (``_nests``)."""
    shape = list(x.shape)
    for dim, plan, _ in steps:
        shape[dim] = plan.length
    out = empty_as(x, shape)
    source = x
    for i, (dim, plan, group) in enumerate(steps):
        region = out  # this step's window: the later dims still at the rank's own rows
        for later, p, _ in steps[i + 1 :]:
            region = _select(region, later, p.local[0])
        received = _received(source, plan, dim, group)
        if i == 0 and plan.local is not None:  # later steps find the rank's rows already in place
            _put(region, dim, plan.local[0], _select(x, dim, plan.local[1]))
        for (_, pos, _), buf in zip(plan.recvs, received):
            _put(region, dim, pos, buf)
        if plan.fill is not None:
            _fill(region, dim, plan.fill, fill)
        source = region
    return out


def _nests(plan: _Plan, rows: int) -> bool:
    """Whether a window holds all of the rank's ``rows`` rows in order, as one run (a conv's or a pool's halo)."""
    return plan.local is not None and plan.local[1] == range(0, rows) and isinstance(plan.local[0], range)


class _FetchWindows(torch.autograd.Function):
    """``_nested_window``; its backward is each window's, the last dim first."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, steps, fill: float, own_grad: bool):
        shapes, shape = [], list(x.shape)
        for dim, plan, _ in steps:
            shapes.append(torch.Size(shape))
            shape[dim] = plan.length
        ctx.steps, ctx.shapes, ctx.own_grad = steps, shapes, own_grad
        return _nested_window(x, steps, fill)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        for (dim, plan, group), shape in zip(reversed(ctx.steps), reversed(ctx.shapes)):
            grad = _window_grad(grad, plan, dim, group, shape, ctx.own_grad)
        return grad, None, None, None


class _FetchWindow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: _Plan, dim: int, shard: DimShard, fill: float, own_grad: bool):
        ctx.plan, ctx.dim, ctx.group, ctx.local_shape, ctx.own_grad = plan, dim, shard.axis.group, x.shape, own_grad
        return _window(x, plan, dim, ctx.group, fill)

    @staticmethod
    @once_differentiable  # the messages carry no graph: a second derivative would miss the neighbours' terms
    def backward(ctx, grad: torch.Tensor):
        grad_x = _window_grad(grad, ctx.plan, ctx.dim, ctx.group, ctx.local_shape, ctx.own_grad)
        return grad_x, None, None, None, None, None


# The window under torch.compile: its copies are traced as tensor ops (the compiler fuses them, and its autograd
# derives their adjoint), only the messages are an opaque op, ``exchange``, whose adjoint is the reverse exchange.
# A shard's axis is named by its global ranks (its process group is looked up in this process).


@torch.library.custom_op("lightning_spatial::exchange", mutates_args=())
def _exchange(
    like: torch.Tensor,
    message: torch.Tensor,
    dim: int,
    send_to: list[int],
    sent: list[int],
    recv_from: list[int],
    counts: list[int],
    ranks: list[int],
) -> list[torch.Tensor]:
    """To the rank at index ``send_to[k]`` of the axis, ``sent[k]`` rows of ``like``'s shape (along ``dim``): the
    messages one after the other in ``message`` (``_flat``); ``counts[k]`` rows, contiguous, from
    ``recv_from[k]``; and last a receipt, ``like`` with no rows: joined into the window, it makes the exchange part
    of the graph where nothing arrives, so that its backward (the reverse exchange) runs on every rank."""
    sizes = [torch.Size(_shape(like, dim, c)).numel() for c in sent]
    outgoing = list(zip(send_to, message.contiguous().split(sizes)))
    incoming = [(j, like.new_empty(_shape(like, dim, c))) for j, c in zip(recv_from, counts)]
    _count_sent(outgoing)
    _p2p(group_of(ranks), outgoing, incoming)
    return [t for _, t in incoming] + [like.new_empty(_shape(like, dim, 0))]


@_exchange.register_fake
def _(like, message, dim, send_to, sent, recv_from, counts, ranks):
    return [like.new_empty(_shape(like, dim, c)) for c in [*counts, 0]]


def _flat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Messages as one flat tensor, each row-major: the order every rank reads alike, whatever strides compiled
    code gives them (inductor may lay out a traced ``contiguous()`` as it likes), written by the kernels that
    produce them (no copy of its own in the exchange)."""
    return torch.cat([p.reshape(-1) for p in parts]) if parts else like.new_empty(0)


def _exchange_setup(ctx, inputs, output):
    _, _, dim, send_to, sent, recv_from, counts, ranks = inputs
    ctx.args = dim, recv_from, counts, send_to, sent, ranks
    ctx.empty = [isinstance(a, list) and not a for a in inputs]  # autograd matches empty lists' structure


def _exchange_backward(ctx, grads):
    *arrived, receipt = grads  # the receipt's gradient, no rows, gives the dtype, device and other sizes
    out = [[] if empty else None for empty in ctx.empty]
    out[1] = _flat(_exchange(receipt, _flat(arrived, receipt), *ctx.args)[:-1], receipt)
    return tuple(out)


_exchange.register_autograd(_exchange_backward, setup_context=_exchange_setup)
communicates("lightning_spatial::exchange")


def _traced_window(x: torch.Tensor, plan: _Plan, dim: int, ranks: list[int], fill: float) -> torch.Tensor:
    """``_window`` as tensor ops around one ``exchange``: one ``cat`` of the window's runs (local rows, received
    rows, padding) in order, or where positions are scattered (reflect padding), one ``index_select`` from them."""
    message = _flat([_select(x, dim, rows) for _, rows in plan.sends], x)
    send_to, sent = [j for j, _ in plan.sends], [_count(rows) for _, rows in plan.sends]
    *recvs, receipt = _exchange(
        x, message, dim, send_to, sent, [j for j, *_ in plan.recvs], [c for *_, c in plan.recvs], ranks
    )
    padding = x.new_full(_shape(x, dim, _count(plan.fill)), fill) if plan.fill is not None else None
    if plan.pieces is not None:
        return torch.cat([*_in_runs(x, dim, plan.pieces, recvs, padding), receipt], dim)
    runs = [(plan.local[0], _select(x, dim, plan.local[1]))] if plan.local is not None else []
    runs += [(pos, buf) for (_, pos, _), buf in zip(plan.recvs, recvs)]
    if padding is not None:
        runs.append((plan.fill, padding))
    order, offset = [0] * plan.length, 0
    for positions, source in runs:
        for i, pos in enumerate(positions):
            order[pos] = offset + i
        offset += source.shape[dim]
    return torch.cat([t for _, t in runs] + [receipt], dim).index_select(dim, _index(tuple(order), x.device))


@planned
def _index(sel: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Index tensors built once per plan and device: no host-to-device copy (a sync) in the step. A compiled
    graph holds its own as a constant."""
    return torch.tensor(sel, dtype=torch.long, device=device)


def _count(sel) -> int:
    return sel.stop - sel.start if isinstance(sel, range) else len(sel)


def _select(x: torch.Tensor, dim: int, sel) -> torch.Tensor:
    if isinstance(sel, range):
        return x.narrow(dim, sel.start, sel.stop - sel.start)
    return x.index_select(dim, _index(sel, x.device))


def _put(out: torch.Tensor, dim: int, sel, value: torch.Tensor) -> None:
    if isinstance(sel, range):
        out.narrow(dim, sel.start, sel.stop - sel.start).copy_(value)
    else:
        out.index_copy_(dim, _index(sel, out.device), value)


def _fill(out: torch.Tensor, dim: int, sel, value: float) -> None:
    if isinstance(sel, range):
        out.narrow(dim, sel.start, sel.stop - sel.start).fill_(value)
    else:
        out.index_fill_(dim, _index(sel, out.device), value)


def _add(out: torch.Tensor, dim: int, sel, value: torch.Tensor) -> None:
    if isinstance(sel, range):
        out.narrow(dim, sel.start, sel.stop - sel.start).add_(value)
    else:
        out.index_add_(dim, _index(sel, out.device), value)


def fetch_window(
    x: torch.Tensor,
    shard: DimShard,
    windows: Sequence[tuple[int, int]],
    mode: str = "zeros",
    fill: float = 0.0,
    own_grad: bool = False,
) -> torch.Tensor:
    """Rows ``windows[me]`` of the global dim ``shard.dim`` of local shard ``x``, padded per ``mode``.

    ``windows`` holds every rank's window along ``shard.axis`` (the same list on every rank). Positions
    outside ``[0, n)`` read the row ``mode`` maps them to, or ``fill`` for zeros/constant padding.
    Differentiable: the window's gradient is scatter-added back to the rows' owners. ``own_grad``: the window's
    only consumer hands backward a gradient nothing else reads (a convolution's input gradient), so ``x``'s
    gradient may be a view of it, written in place, instead of a copy.
    """
    return _fetch(x, shard, _plan_of(shard, windows, mode), fill, own_grad)


def _plan_of(shard: DimShard, windows: Sequence[tuple[int, int]], mode: str) -> _Plan:
    return _plan(shard.size, shard.axis.size, shard.axis.index, tuple(map(tuple, windows)), mode)


def _fetch(x: torch.Tensor, shard: DimShard, plan: _Plan, fill: float, own_grad: bool) -> torch.Tensor:
    """``fetch_window`` with its plan made."""
    if plan.view is not None:
        return _select(x, shard.dim, plan.view)
    if torch.compiler.is_dynamo_compiling():
        return _traced_window(x, plan, shard.dim, list(shard.axis.ranks), fill)
    if not (x.requires_grad and torch.is_grad_enabled()):  # no graph to record: skip the autograd Function's cost
        return _window(x, plan, shard.dim, shard.axis.group, fill)
    return _FetchWindow.apply(x, plan, shard.dim, shard, fill, own_grad)


def fetch_windows(
    x: torch.Tensor,
    dims: Sequence[tuple[DimShard, Sequence[tuple[int, int]]]],
    mode: str = "zeros",
    fill: float = 0.0,
    own_grad: bool = False,
) -> torch.Tensor:
    """``fetch_window`` along several sharded dims, one after the other (2-D tiles receive their corners from the
    already widened tensor): ``dims`` holds each dim's shard and every rank's window. A halo on every side of a
    2-D tile is written into one tensor (``x`` copied once, not once per dim)."""
    plans = [(s, _plan_of(s, w, mode)) for s, w in dims]
    nested = (
        len(plans) > 1
        and not torch.compiler.is_dynamo_compiling()
        and all(p.view is None for _, p in plans)
        and all(_nests(p, x.shape[s.dim]) for s, p in plans[1:])
    )
    if not nested:
        for s, plan in plans:
            x = _fetch(x, s, plan, fill, own_grad)
        return x
    steps = tuple((s.dim, p, s.axis.group) for s, p in plans)
    if not (x.requires_grad and torch.is_grad_enabled()):
        return _nested_window(x, steps, fill)
    return _FetchWindows.apply(x, steps, fill, own_grad)


__all__ = ["empty_as", "fetch_window", "fetch_windows", "memory_order"]
