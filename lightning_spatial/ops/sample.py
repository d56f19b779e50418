"""``F.grid_sample`` of a sharded input at replicated grid points, without gathering the input.

Every output value is a weighted sum of input taps (1 for nearest, 2 per spatial dim for (tri)linear, 4 per
dim for bicubic) at rows torch derives from the grid. Each rank computes all points' taps and weights with
torch's own arithmetic (``aten/src/ATen/native/GridSampler.h``, in the input dtype), reads the taps that lie
in its own shard, and the group sums the partial outputs. A tap belongs to exactly one rank, so no halo is
needed. The sum's adjoint (an all-reduce) hands every rank the whole output gradient: the input gradient is
exact locally and the grid gradient is a split over the group (``collectives``).

The output is replicated, or sharded over its cells with ``bev_shard`` (``ops.pending``). A grid sharded along
its point dims (BEV queries, over the input's ranks) gives an output sharded like the grid, by whichever moves
less: the points are all-gathered (2 numbers a point), every rank samples all points in its own shard, and a
reduce-scatter hands each point's sums (a channel vector a point) to the rank that holds the point; or, when the
input is smaller than the samples and the grid is sharded over all of the input's axes, the input is all-gathered
and every rank samples only its own points (BEVFormer's cross-attention: 1/S of the sampling on each rank). A grid
sharded otherwise (its batch, or over other ranks) takes the exact gather fallback, with its warning.

The taps' rows and weights cover every point of the grid on every rank (several times the grid's size, whatever S
is): they are computed again in the backward from the grid (a checkpoint) instead of being kept, so a rank keeps only
its input shard and the grid between forward and backward.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import replace
from functools import reduce

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..fallback import fallback
from ..layout import Layout
from ..tensor import gather, unwrap, wrap
from ._common import eager_backward, spatial_shards
from .pending import pending, pending_samples, reduced_into

_MODES = ("bilinear", "nearest", "bicubic")  # torch's enum order (torch.grid_sampler's interpolation_mode)
_PADDINGS = ("zeros", "border", "reflection")
_CUBIC_A = -0.75
_AUTOCAST = (torch.float16, torch.bfloat16, torch.float32)
_DTYPE_NAMES = {torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float", torch.float64: "Double"}


def grid_sample(input, grid, mode="bilinear", padding_mode="zeros", align_corners=None):
    """``F.grid_sample`` with F.grid_sample's own argument checks (its body never runs for a SpatialTensor)."""
    if mode not in _MODES:
        raise ValueError(
            f"nn.functional.grid_sample(): expected mode to be 'bilinear', 'nearest' or 'bicubic', but got: '{mode}'"
        )
    if padding_mode not in _PADDINGS:
        raise ValueError(
            "nn.functional.grid_sample(): expected padding_mode to be 'zeros', 'border', or 'reflection', "
            f"but got: '{padding_mode}'"
        )
    if align_corners is None:
        warnings.warn(
            "Default grid_sample and affine_grid behavior has changed to align_corners=False since 1.3.0. Please "
            "specify align_corners=True if the old behavior is desired. See the documentation of grid_sample for "
            "details.",
            stacklevel=3,
        )
        align_corners = False
    return _sample(input, grid, mode, padding_mode, align_corners, None)


def _enum_handler(dims: int | None):
    """``torch.grid_sampler`` (``dims`` None: 4-D or 5-D), ``grid_sampler_2d`` (4) and ``_3d`` (5): enum args."""

    def handler(input, grid, interpolation_mode, padding_mode, align_corners):
        if interpolation_mode not in range(3) or padding_mode not in range(3):
            raise ValueError(  # torch itself returns garbage for these
                f"grid_sampler(): interpolation_mode and padding_mode must be 0, 1 or 2, got {interpolation_mode} "
                f"and {padding_mode}"
            )
        return _sample(input, grid, _MODES[interpolation_mode], _PADDINGS[padding_mode], align_corners, dims)

    return handler


def _sample(input, grid, mode: str, padding: str, align: bool, dims: int | None) -> torch.Tensor:
    input, grid = _autocast(input, grid)
    _check(input, grid, mode, dims)
    x, layout = unwrap(input)
    local_grid, points = unwrap(grid)
    kwargs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    if layout is None or (points is not None and not _by_points(points, layout, grid.dim())):
        return fallback(F.grid_sample, (input, grid), kwargs)
    if _input_is_smaller(x, layout, local_grid, points):
        full = gather(input)
        if points is None:  # the whole output on every rank: with bev_shard, each samples its cells (ops.pending)
            return pending_samples(_at_points(full, kwargs), local_grid.movedim(-1, 1), full.shape[1], layout.shards,
                                   full)  # fmt: skip
        return wrap(F.grid_sample(full, local_grid, **kwargs), _like_points(points))
    whole = gather(grid)  # a sharded grid: every rank samples every point in its own part of the input
    out = checkpoint(_sampled, x, whole, layout, mode, padding, align, use_reentrant=False)
    if points is None:
        return pending(out, layout.shards)  # replicated, or sharded like the grid's cells (ops.pending)
    return reduced_into(out, [s.axis for s in layout.shards], _like_points(points).shards)


def _at_points(full: torch.Tensor, kwargs: dict):
    """Samples of ``full`` at points laid out as the samples, ``(N, k, ..., W)`` with the ``k`` coordinates in dim
    1 -> ``(N, C, ..., W)``: any block of the grid's points (``ops.pending.pending_samples``)."""

    def sample(points: torch.Tensor) -> torch.Tensor:
        n, k, *rest = points.shape
        grid = points.movedim(1, -1).reshape(n, *[1] * (full.dim() - 4), -1, rest[-1], k)
        with torch.autocast(full.device.type, enabled=False):  # cast before (``_autocast``): the same dtype later
            return F.grid_sample(full, grid, **kwargs).reshape(n, full.shape[1], *rest)

    return sample


def _sampled(x, whole, layout: Layout, mode: str, padding: str, align: bool) -> torch.Tensor:
    """This rank's partial sums at every point of the grid ``whole``."""
    index, weight = _shard_taps(x, layout, whole, mode, padding, align)
    return _TapSum.apply(x, index, weight).view(*x.shape[:2], *whole.shape[1:-1])


def _by_points(points: Layout, layout: Layout, ndim: int) -> bool:
    """A grid sharded along its point dims (not the batch, not the coordinates) over axes the input is sharded
    over, each a plain dim or a token dim with one sharded factor (flattened BEV queries; the points of every query
    of a map stacked as rows)."""
    return (
        all(-ndim < s.dim < -1 and not s.segments for s in points.shards)
        and all(len(points.on(d)) == 1 for d in points.dims)
        and {s.axis.ranks for s in points.shards} <= {s.axis.ranks for s in layout.shards}
    )


def _input_is_smaller(x: torch.Tensor, layout: Layout, grid: torch.Tensor, points: Layout | None) -> bool:
    """Whether to gather the input rather than sample it in place: when it is smaller than the samples (BEVFormer's
    cross-attention samples 8 points per BEV query in maps a fraction of that size; Simple-BEV's lifting, 8 heights
    per BEV cell) torch's own kernel samples the gathered input, and no sum of partial samples follows. A grid
    sharded by points needs each point to have one owner (the grid sharded over all of the input's axes): each rank
    samples its own points. The input gradient's parts are summed (all-gather's adjoint)."""
    if points is not None and {s.axis.ranks for s in points.shards} != {s.axis.ranks for s in layout.shards}:
        return False
    points_shape = grid.shape if points is None else points.global_shape(grid)
    return math.prod(layout.global_shape(x)) < math.prod(x.shape[:2]) * math.prod(points_shape[1:-1])


def _like_points(points: Layout) -> Layout:
    """The samples' layout: the grid's, one dim later (the output has channels where the grid has coordinates)."""
    return Layout(tuple(replace(s, dim=s.dim + 1) for s in points.shards))


def _shard_taps(x, layout, grid, mode: str, padding: str, align: bool):
    """Every grid point's taps in this rank's shard as (N, taps, points) flat local indices and weights."""
    nd = x.dim() - 2
    shards = spatial_shards("grid_sample", layout, nd)
    points = grid.reshape(grid.shape[0], -1, nd)  # (N, Q, nd); coordinate 0 is along the last dim
    per_dim = []
    for i, n in enumerate(layout.global_shape(x)[2:]):
        lo, hi = (shards[i].start, shards[i].stop) if i in shards else (0, n)
        per_dim.append(_taps(points[..., nd - 1 - i], n, lo, hi, mode, padding, align))
    strides = [math.prod(x.shape[3 + i :]) for i in range(nd)]
    index, weight = [], []
    for combo in itertools.product(*per_dim):
        index.append(sum(row * stride for (row, _), stride in zip(combo, strides)))
        weight.append(math.prod([w for _, w in reversed(combo)]))  # the last dim's weight first, as torch multiplies
    return torch.stack(index, 1), torch.stack(weight, 1)


def _taps(coord, n: int, lo: int, hi: int, mode: str, padding: str, align: bool):
    """One dim's taps as [(row - lo, weight)], the weight zeroed (and the row 0) where the tap is not in [lo, hi)."""
    if mode == "bicubic":  # torch pads each tap's row, not the coordinate
        real = _unnormalize(coord, n, align)
        first = real.detach().floor()
        rows = [_pad(first + k, n, padding, align).long() for k in (-1, 0, 1, 2)]
        weights = _cubic(real - first)
    else:
        real = _pad(_unnormalize(coord, n, align), n, padding, align)
        if mode == "nearest":  # round half to even (nearbyint); torch gives the grid a zero gradient, not none
            rows, weights = [real.detach().round().long()], [0 * real + 1]
        else:
            first = real.detach().floor()
            rows, weights = [first.long(), first.long() + 1], [first + 1 - real, real - first]
    taps = []
    for row, w in zip(rows, weights):
        mine = (row >= lo) & (row < hi)  # also drops rows outside [0, n): zero padding
        taps.append(((row - lo) * mine, w * mine))
    return taps


def _unnormalize(coord, n: int, align: bool):
    """[-1, 1] -> pixel coordinate: corner pixel centres (align) or outer edges, as grid_sampler_unnormalize."""
    return (coord + 1) / 2 * (n - 1) if align else ((coord + 1) * n - 1) / 2


def _pad(real, n: int, padding: str, align: bool):
    """torch's compute_coordinates. Its gradient, like torch's ``_set_grad`` twin, is zero on and beyond a border
    (a reflected point on a bound is clamped there)."""
    if padding == "zeros":
        return real
    if padding == "reflection":
        real = _reflect(real, 0, 2 * (n - 1)) if align else _reflect(real, -1, 2 * n - 1)
    # not real.clamp: its gradient on the bounds differs across torch releases (0 in 2.14; on 2.11 four of our
    # grid_sample tests failed on the grid's gradient); the kernel's is 0
    return torch.where((real > 0) & (real < n - 1), real, real.detach().clamp(0, n - 1))


def _reflect(real, twice_low: int, twice_high: int):
    """Reflect into [low, high] until inside (bounds doubled to stay integers), as reflect_coordinates."""
    if twice_low == twice_high:
        return torch.zeros_like(real)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    real = (real - low).abs()
    extra = torch.fmod(real, span)
    even = torch.floor(real / span) % 2 == 0
    return torch.where(even, extra + low, span - extra + low)


def _cubic(t):
    """torch's cubic convolution coefficients (A = -0.75) for the taps at floor - 1 .. floor + 2."""
    a = _CUBIC_A

    def near(v):
        return ((a + 2) * v - (a + 3)) * v * v + 1

    def far(v):
        return ((a * v - 5 * a) * v + 8 * a) * v - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(1 - t + 1)]


class _TapSum(torch.autograd.Function):
    """``out[n, c, q] = sum_t weight[n, t, q] * x[n, c, index[n, t, q]]`` over x's flattened spatial dims.

    One tap at a time, in forward and backward: autograd through ``gather`` would keep an (N, C, Q) tensor
    per tap for the weights' gradient.
    """

    @staticmethod
    def forward(ctx, x, index, weight):
        flat = x.flatten(2)  # a view for contiguous and channels-last shards
        out = flat.new_zeros(*flat.shape[:2], index.shape[-1])
        for t in range(index.shape[1]):
            out.addcmul_(_read(flat, index[:, t]), weight[:, None, t])
        ctx.save_for_backward(x, index, weight)
        return out

    @staticmethod
    @eager_backward  # the all-reduce around it carries no graph either
    def backward(ctx, grad):
        x, index, weight = ctx.saved_tensors
        flat = x.flatten(2)
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_flat = flat.new_zeros(flat.shape)
            for t in range(index.shape[1]):
                grad_flat.scatter_add_(2, index[:, None, t].expand_as(grad), grad * weight[:, None, t])
            grad_x = grad_flat.view(x.shape)
        if ctx.needs_input_grad[2]:
            grad_weight = torch.stack([(_read(flat, index[:, t]) * grad).sum(1) for t in range(index.shape[1])], 1)
        return grad_x, None, grad_weight


def _read(flat, index):
    return flat.gather(2, index[:, None].expand(-1, flat.shape[1], -1))


def _autocast(input, grid):
    """torch's autocast runs grid_sampler in float32 on CPU and in the wider operand dtype on GPUs."""
    device = input.device.type
    if not torch.is_autocast_enabled(device):
        return input, grid
    eligible = [t.dtype for t in (input, grid) if t.dtype in _AUTOCAST]
    dtype = torch.float32 if device == "cpu" or not eligible else reduce(torch.promote_types, eligible)
    return [t.to(dtype) if t.dtype in _AUTOCAST else t for t in (input, grid)]


def _check(input, grid, mode: str, dims: int | None) -> None:
    """torch's grid_sampler checks and messages (global sizes), before any communication."""
    shape, grid_shape = list(input.shape), list(grid.shape)
    if input.device != grid.device:
        raise RuntimeError(
            f"grid_sampler(): expected input and grid to be on same device, but input is on {input.device} and "
            f"grid is on {grid.device}"
        )
    if shape[0] != grid_shape[0]:
        raise RuntimeError(
            "grid_sampler(): expected grid and input to have same batch size, but got input with sizes "
            f"{shape} and grid with sizes {grid_shape}"
        )
    if grid_shape[-1] != len(shape) - 2:
        raise RuntimeError(
            f"grid_sampler(): expected grid to have size {len(shape) - 2} in last dimension, but got grid with "
            f"sizes {grid_shape}"
        )
    for i in range(2, len(shape)):
        if shape[i] <= 0:
            raise RuntimeError(
                "grid_sampler(): expected input to have non-empty spatial dimensions, but input has sizes "
                f"{shape} with dimension {i} being empty"
            )
    dims = dims or (4 if len(shape) == 4 else 5)
    if len(shape) != dims or len(grid_shape) != dims:
        raise RuntimeError(
            f"grid_sampler(): expected {dims}D input and grid with same number of dimensions, but got input with "
            f"sizes {shape} and grid with sizes {grid_shape}"
        )
    if dims == 5 and mode == "bicubic":
        raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")
    if input.dtype != grid.dtype:
        name = {d: _DTYPE_NAMES.get(d, str(d)) for d in (input.dtype, grid.dtype)}
        raise RuntimeError(f"expected scalar type {name[input.dtype]} but found {name[grid.dtype]}")


HANDLERS = {
    F.grid_sample: grid_sample,
    torch.grid_sampler: _enum_handler(None),
    torch.grid_sampler_2d: _enum_handler(4),
    torch.grid_sampler_3d: _enum_handler(5),
}
