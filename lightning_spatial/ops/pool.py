"""Pooling over sharded spatial dims.

Sliding pools (max, avg) are convolutions for the window arithmetic: fetch the window with -inf (max) or
zero (avg) padding and pool locally. Average pooling divides an exact window sum by torch's divisor,
computed per dim (so ceil_mode, count_include_pad and divisor_override match torch at the borders).
Adaptive pools run torch's op on the unsharded dims, then pool each sharded dim separately (max and mean
over a box are separable): output rows still sharded fetch their bins' window; an output smaller than
the ranks (global pooling) is reduced from per-rank partials by all-reduce and ends replicated.
Max-pool indices are global flat indices into the input plane, as on one device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..collectives import MAX, MIN, across_detached, all_reduce
from ..halo import fetch_window
from ..layout import DimShard, Layout, adaptive_bins, conv_window, partition, pool_out_size
from ..plans import planned
from ..tensor import adopt, unwrap
from ._binding import bound
from ._common import Windows, local_padding, ntuple, output_layout, output_rows, output_sizes, spatial_shards
from ._recipes import saved_as_recipe

_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_ADAPTIVE_MAX = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}
_ADAPTIVE_AVG = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}


def _check_pad(op: str, kernel, padding) -> None:
    for k, p in zip(kernel, padding):
        if p > k // 2:
            raise ValueError(f"{op}: pad should be at most half of kernel size, but got pad={p} and kernel_size={k}")


def _flat_index(plane: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    flat = plane[0]
    for c, n in zip(plane[1:], sizes[1:]):
        flat = flat * n + c
    return flat


def _globalize(indices: torch.Tensor, local_sizes, offsets, global_sizes) -> torch.Tensor:
    """Flat indices into a local plane (window starting at ``offsets``) -> flat indices into the global plane."""
    coords, rest = [], indices
    for n in reversed(local_sizes):
        coords.append(rest % n)
        rest = rest // n
    coords = [c + o for c, o in zip(reversed(coords), offsets)]
    return _flat_index(coords, list(global_sizes))


@dataclass(frozen=True)
class _PoolPlan:
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    shards: Mapping[int, DimShard]
    out_sizes: dict[int, int]  # global output size of each sharded spatial dim
    windows: Windows
    local_padding: tuple[int, ...]  # the local pool's: none along sharded dims
    layout: Layout | None  # the output's


@planned(maxsize=1024)
def _pool_plan(op: str, nd: int, layout: Layout, kernel_size, stride, padding, dilation, ceil_mode) -> _PoolPlan:
    """A sliding pool's windows and output layout, by its arguments as given."""
    kernel = ntuple(kernel_size, nd, "kernel_size")
    stride = ntuple(stride if stride not in (None, [], ()) else kernel_size, nd, "stride")
    padding, dilation = ntuple(padding, nd, "padding"), ntuple(dilation, nd, "dilation")
    shards = spatial_shards(op, layout, nd)
    checked = range(nd) if op.startswith("avg") else shards  # max pools: torch checks the other dims itself
    _check_pad(op, [kernel[i] for i in checked], [padding[i] for i in checked])
    out_sizes = output_sizes(
        op, shards, lambda i, s: pool_out_size(s.size, kernel[i], stride[i], padding[i], dilation[i], ceil_mode)
    )
    windows = Windows.plan(
        shards, out_sizes, lambda i, a, b: conv_window(a, b, kernel[i], stride[i], padding[i], dilation[i])
    )
    local = tuple(local_padding(padding, shards))
    return _PoolPlan(
        kernel, stride, padding, dilation, shards, out_sizes, windows, local, output_layout(layout, shards, out_sizes)
    )


def _max_pool(nd: int):
    op = f"max_pool{nd}d"

    def max_pool(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
        x, layout = unwrap(input)
        plan = _pool_plan(op, nd, layout, kernel_size, stride, padding, dilation, ceil_mode)
        xw = plan.windows.fetch(x, fill=-math.inf)
        with saved_as_recipe(xw, x, lambda: plan.windows.fetch(x, fill=-math.inf)):
            out, indices = _MAX[nd](
                xw, plan.kernel, plan.stride, plan.local_padding, plan.dilation, ceil_mode, return_indices=True
            )
        if not return_indices:
            return adopt(out, plan.layout)
        offsets = [plan.windows.start(i) if i in plan.shards else 0 for i in range(nd)]
        global_sizes = layout.global_shape(x)[-nd:]
        indices = _globalize(indices, xw.shape[-nd:], offsets, global_sizes)
        return adopt(out, plan.layout), adopt(indices, plan.layout)

    max_pool.__name__ = op
    return max_pool


@planned(maxsize=1024)
def _divisor(n: int, lo: int, hi: int, kernel: int, stride: int, padding: int, include_pad: bool, dtype, device):
    """torch's average-pool divisor for output rows ``[lo, hi)`` of one dim (built once per device)."""
    counts = []
    for o in range(lo, hi):
        start = o * stride - padding
        end = min(start + kernel, n + padding)
        counts.append(end - start if include_pad else min(end, n) - max(start, 0))
    return torch.tensor(counts, dtype=dtype, device=device)


def _avg_pool(nd: int):
    op = f"avg_pool{nd}d"

    def avg_pool(
        input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None
    ):
        x, layout = unwrap(input)
        plan = _pool_plan(op, nd, layout, kernel_size, stride, padding, 1, ceil_mode)
        kernel, stride, padding = plan.kernel, plan.stride, plan.padding
        global_sizes = layout.global_shape(x)[-nd:]
        xw = plan.windows.fetch(x)
        if nd == 1:  # avg_pool1d has no divisor_override: pool a (1, L) plane instead
            total = F.avg_pool2d(
                xw.unsqueeze(-2), (1, *kernel), (1, *stride), (0, *plan.local_padding), ceil_mode, True, 1
            ).squeeze(-2)
        else:
            pool = F.avg_pool2d if nd == 2 else F.avg_pool3d
            total = pool(xw, kernel, stride, plan.local_padding, ceil_mode, True, 1)
        if divisor_override:
            out = total / divisor_override
        else:
            divisor = None
            for i in range(nd):
                shard = plan.shards.get(i)
                lo, hi = output_rows(shard, plan.out_sizes[i]) if shard else (0, total.shape[i - nd])
                d = _divisor(
                    global_sizes[i],
                    lo,
                    hi,
                    kernel[i],
                    stride[i],
                    padding[i],
                    count_include_pad,
                    total.dtype,
                    total.device,
                )
                d = d.view(-1, *([1] * (nd - 1 - i)))
                divisor = d if divisor is None else divisor * d
            out = total / divisor
        return adopt(out, plan.layout)

    avg_pool.__name__ = op
    return avg_pool


def _output_sizes(output_size, global_sizes, nd: int) -> list[int]:
    sizes = [output_size] * nd if isinstance(output_size, int) or output_size is None else list(output_size)
    if len(sizes) == 1:
        sizes = sizes * nd
    return [n if m is None else int(m) for m, n in zip(sizes, global_sizes)]


@planned(maxsize=1024)
def _bins_here(n: int, m: int, parts: int, index: int) -> tuple[tuple[tuple[int, int], ...], tuple | None, bool]:
    """(bins this rank computes, clipped to the rows it holds; every rank's window or None; partial?).

    With at least one output row per rank the output stays sharded: each rank fetches the window of its
    bins. Otherwise each rank reduces its own rows into every bin and the partials are all-reduced."""
    bins = adaptive_bins(n, m)
    if m < parts:
        start, stop = partition(n, parts)[index]
        return tuple((max(a, start), min(b, stop)) for a, b in bins), None, True
    windows = tuple((bins[lo][0], bins[hi - 1][1]) for lo, hi in partition(m, parts))
    lo, hi = partition(m, parts)[index]
    return bins[lo:hi], windows, False


def _rows_for_bins(y: torch.Tensor, s: DimShard, m: int, *extra: torch.Tensor | None):
    """The rows this rank pools along ``s.dim`` (its window, or its own rows), with the bins and the
    global index of the first row; ``extra`` tensors (max-pool indices) travel with ``y``."""
    bins, windows, partial = _bins_here(s.size, m, s.axis.size, s.axis.index)
    if partial:
        return y, extra, bins, s.start, True
    extra = tuple(fetch_window(t, s, windows) if t is not None else None for t in extra)
    return fetch_window(y, s, windows), extra, bins, windows[s.axis.index][0], False


@planned(maxsize=1024)
def _bin_weights(n: int, m: int, parts: int, index: int, length: int, dtype, device) -> torch.Tensor:
    """Averaging matrix (bins x rows held) for one dim, built once per device."""
    bins, windows, partial = _bins_here(n, m, parts, index)
    first = partition(n, parts)[index][0] if partial else windows[index][0]
    full = adaptive_bins(n, m) if partial else bins
    weights = torch.zeros(len(bins), length, dtype=dtype)
    for r, ((a, b), (fa, fb)) in enumerate(zip(bins, full)):
        if b > a:
            weights[r, a - first : b - first] = 1.0 / (fb - fa)
    return weights.to(device)


def _adaptive_avg_dim(y: torch.Tensor, s: DimShard, m: int) -> torch.Tensor:
    y, _, _, _, partial = _rows_for_bins(y, s, m)
    weights = _bin_weights(s.size, m, s.axis.size, s.axis.index, y.shape[s.dim], y.dtype, y.device)
    out = (y.movedim(s.dim, -1) @ weights.T).movedim(-1, s.dim)
    return all_reduce(out, s.axis) if partial else out


def _adaptive_max_dim(y: torch.Tensor, flat: torch.Tensor | None, s: DimShard, m: int):
    y, (flat,), bins, first, partial = _rows_for_bins(y, s, m, flat)
    values, where = [], []
    for a, b in bins:
        if b > a:
            v, arg = y.narrow(s.dim, a - first, b - a).max(dim=s.dim, keepdim=True)
            values.append(v)
            if flat is not None:
                where.append(flat.narrow(s.dim, a - first, b - a).gather(s.dim, arg))
        else:  # partial: this bin has no rows here
            shape = list(y.shape)
            shape[s.dim] = 1
            values.append(y.new_full(shape, -math.inf))
            if flat is not None:
                where.append(flat.new_zeros(shape))
    y, flat = torch.cat(values, s.dim), (torch.cat(where, s.dim) if flat is not None else None)
    if partial:
        reduced = all_reduce(y, s.axis, MAX)
        if flat is not None:  # the first maximal element in the plane's order, as torch picks
            flat = torch.where(y == reduced.detach(), flat, torch.iinfo(flat.dtype).max)
            flat = across_detached(flat, [s], MIN)
        y = reduced
    return y, flat


def adaptive_pool(nd: int, kind: str):
    op = f"adaptive_{kind}_pool{nd}d"

    def adaptive(input, output_size, return_indices=False):
        x, layout = unwrap(input)
        shards = spatial_shards(op, layout, nd)
        global_sizes = layout.global_shape(x)[-nd:]
        sizes = _output_sizes(output_size, global_sizes, nd)
        local_target = [x.shape[i - nd] if i in shards else sizes[i] for i in range(nd)]
        if kind == "avg":
            y, flat = _ADAPTIVE_AVG[nd](x, local_target), None
        else:
            y, flat = _ADAPTIVE_MAX[nd](x, local_target, return_indices=True)
            offsets = [shards[i].start if i in shards else 0 for i in range(nd)]
            flat = _globalize(flat, x.shape[-nd:], offsets, global_sizes) if return_indices else None
        for i, s in shards.items():
            if kind == "avg":
                y = _adaptive_avg_dim(y, s, sizes[i])
            else:
                y, flat = _adaptive_max_dim(y, flat, s, sizes[i])
        out_layout = layout.with_sizes(
            {s.dim: sizes[i] if sizes[i] >= s.axis.size else None for i, s in shards.items()}
        )
        if return_indices:
            return adopt(y, out_layout), adopt(flat, out_layout)
        return adopt(y, out_layout)

    adaptive.__name__ = op
    return adaptive


def _with_indices(handler):
    """torch's ``*_with_indices`` entry points: the same handler, indices always returned."""

    def with_indices(**arguments):
        return handler(**{**arguments, "return_indices": True})

    return with_indices


def _registrations() -> dict:
    handlers = {}
    for nd in (1, 2, 3):
        max_pool, adaptive_max = _max_pool(nd), adaptive_pool(nd, "max")
        # F.max_pool2d is a boolean dispatcher that is itself a torch function, as are both its targets
        handlers |= bound(max_pool, getattr(F, f"max_pool{nd}d"), getattr(F, f"_max_pool{nd}d"))
        handlers |= bound(max_pool, getattr(torch, f"max_pool{nd}d"))
        handlers |= bound(_with_indices(max_pool), getattr(F, f"max_pool{nd}d_with_indices"))
        handlers |= bound(_avg_pool(nd), getattr(F, f"avg_pool{nd}d"))
        handlers |= bound(adaptive_pool(nd, "avg"), _ADAPTIVE_AVG[nd])
        handlers |= bound(adaptive_max, getattr(F, f"adaptive_max_pool{nd}d"), getattr(F, f"_adaptive_max_pool{nd}d"))
        handlers |= bound(_with_indices(adaptive_max), getattr(F, f"adaptive_max_pool{nd}d_with_indices"))
    return handlers


HANDLERS = _registrations()

__all__ = ["HANDLERS", "adaptive_pool"]
