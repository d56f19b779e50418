"""``F.interpolate`` over sharded dims: nearest, nearest-exact, (bi/tri)linear, bicubic and area.

Resampling is separable: torch resamples the unsharded dims (the sharded ones pass at their own size,
which is the identity), then each sharded dim is resampled by explicit taps. Each output row reads a few
source rows with weights computed exactly as torch's kernels do (float32 scale, same clamping), so every
rank fetches the window of source rows its output rows read and gathers them. ``area`` is adaptive
average pooling.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..halo import fetch_window, memory_order
from ..layout import DimShard, partition
from ..plans import planned
from ..tensor import unwrap, wrap
from ._binding import bound
from ._common import check_output_size, output_layout, spatial_shards
from .pool import adaptive_pool

_MODES = {"nearest": 1, "nearest-exact": 1, "linear": 1, "bilinear": 2, "trilinear": 3, "bicubic": 2}
_CUBIC_A = -0.75


def _rounded(v: float, wide: torch.dtype) -> float:
    return float(torch.tensor(v, dtype=wide))


def _scale(n: int, out: int, align_corners: bool, scale_factor: float | None, wide: torch.dtype) -> float:
    """torch's area_pixel_compute_scale in its accumulation type ``wide``."""
    if align_corners:
        return _rounded((n - 1) / (out - 1), wide) if out > 1 else 0.0
    if scale_factor is not None and scale_factor > 0:
        return _rounded(1.0 / scale_factor, wide)
    return _rounded(n / out, wide)


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    """What torch's upsampling kernels compute source coordinates in: double for double, else float."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@planned(maxsize=256)
def taps(mode: str, n: int, out: int, align_corners: bool, scale_factor: float | None, wide=torch.float32):
    """(source rows, weights), each ``out x k``: output row o = sum_j weight[o, j] * input[row[o, j]], with
    coordinates computed in ``wide`` (``_accumulation`` of the input's dtype)."""
    o = torch.arange(out, dtype=wide)
    if mode in ("nearest", "nearest-exact"):
        if mode == "nearest" and out == n:
            rows = torch.arange(out)
        elif mode == "nearest" and out == 2 * n:
            rows = torch.arange(out) // 2
        else:
            scale = torch.tensor(_scale(n, out, False, scale_factor, wide), dtype=wide)
            shifted = o if mode == "nearest" else o + 0.5
            rows = torch.floor(shifted * scale).long().clamp(max=n - 1)
        return rows[:, None], torch.ones(out, 1, dtype=wide)
    scale = torch.tensor(_scale(n, out, align_corners, scale_factor, wide), dtype=wide)
    real = scale * o if align_corners else scale * (o + 0.5) - 0.5
    if mode == "bicubic":
        first = torch.floor(real)
        t = real - first
        a = _CUBIC_A
        near = lambda x: ((a + 2) * x - (a + 3)) * x * x + 1  # noqa: E731 - torch's cubic_convolution1
        far = lambda x: ((a * x - 5 * a) * x + 8 * a) * x - 4 * a  # noqa: E731 - cubic_convolution2
        weights = torch.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], -1)
        rows = (first.long()[:, None] + torch.arange(-1, 3)).clamp(0, n - 1)
        return rows, weights
    real = real.clamp(min=0)
    first = torch.floor(real).long().clamp(max=n - 1)
    lam = (real - first).clamp(0, 1)
    second = first + (first < n - 1).long()
    return torch.stack([first, second], -1), torch.stack([1 - lam, lam], -1)


@planned(maxsize=256)
def _windows(mode, n, out, align_corners, scale_factor, wide, parts) -> tuple[tuple[int, int], ...]:
    """Every rank's window of source rows: the rows its output rows' taps read."""
    rows, _ = taps(mode, n, out, align_corners, scale_factor, wide)
    return tuple((int(rows[lo:hi].min()), int(rows[lo:hi].max()) + 1) for lo, hi in partition(out, parts))


@planned(maxsize=256)
def _local_taps(mode, n, out, align_corners, scale_factor, wide, parts, index, dtype, device):
    """This rank's taps on the device, built once: per tap, the source rows its output rows read (relative to its
    window) and their weights; no weights for nearest modes (one tap of weight 1)."""
    rows, weights = taps(mode, n, out, align_corners, scale_factor, wide)
    lo, hi = partition(out, parts)[index]
    first = _windows(mode, n, out, align_corners, scale_factor, wide, parts)[index][0]
    rows = tuple(r.contiguous() for r in (rows[lo:hi] - first).T.to(device))
    if mode in ("nearest", "nearest-exact"):
        return rows, None
    return rows, tuple(w.contiguous() for w in weights[lo:hi].T.to(device=device, dtype=dtype))


def _resample_dim(y: torch.Tensor, s: DimShard, out: int, mode: str, align_corners: bool, scale_factor):
    """Dim ``s.dim`` resampled: each tap's source rows picked by ``index_select`` (whose backward adds each row's
    gradient to its source row) and weighted, summed tap by tap as torch's kernels do. Picked in ``y``'s memory
    order, so the result keeps its layout (channels_last stays channels_last)."""
    key = (mode, s.size, out, align_corners, scale_factor, _accumulation(y.dtype), s.axis.size)
    y = fetch_window(y, s, _windows(*key))
    rows, weights = _local_taps(*key, s.axis.index, y.dtype, y.device)
    order = memory_order(y.stride())
    dense, dim = y.permute(order), order.index(y.dim() + s.dim)
    picked = [dense.index_select(dim, r) for r in rows]
    if weights is None:
        result = picked[0]
    else:
        along = (-1,) + (1,) * (y.dim() - dim - 1)  # a weight per row of ``dim``
        result = picked[0] * weights[0].view(along)
        for p, w in zip(picked[1:], weights[1:]):
            result = result.addcmul_(p, w.view(along))
    return result.permute(sorted(range(y.dim()), key=order.__getitem__))


def interpolate(
    input,
    size=None,
    scale_factor=None,
    mode="nearest",
    align_corners=None,
    recompute_scale_factor=None,
    antialias=False,
):
    x, layout = unwrap(input)
    nd = x.dim() - 2
    if antialias:
        raise ValueError("interpolate: antialias=True is not supported on sharded tensors; gather first")
    if mode == "area":  # torch's area mode is adaptive average pooling
        return adaptive_pool(nd, "avg")(input, _out_sizes(layout.global_shape(x)[2:], size, scale_factor))
    if mode not in _MODES:
        raise ValueError(f"interpolate: mode {mode!r} is not supported on sharded tensors")
    shards = spatial_shards(f"interpolate({mode})", layout, nd)
    global_in = layout.global_shape(x)[2:]
    out_sizes = _out_sizes(global_in, size, scale_factor)
    for i, s in shards.items():
        check_output_size(f"interpolate({mode})", s, out_sizes[i])
    factors = _factors(scale_factor, nd) if (scale_factor is not None and not recompute_scale_factor) else [None] * nd
    # torch on the unsharded dims; sharded dims keep their local size (identity)
    local_size = [x.shape[2 + i] if i in shards else out_sizes[i] for i in range(nd)]
    if any(i not in shards for i in range(nd)):
        local_factors = None
        if factors[0] is not None or any(f is not None for f in factors):
            local_factors = [1.0 if i in shards else factors[i] for i in range(nd)]
        x = F.interpolate(
            x,
            size=None if local_factors else local_size,
            scale_factor=local_factors,
            mode=mode,
            align_corners=align_corners,
            recompute_scale_factor=False if local_factors else None,
        )
        if list(x.shape[2:]) != local_size:  # scale_factor rounding must agree with the global sizes
            raise ValueError(f"interpolate: local result {tuple(x.shape[2:])} != expected {tuple(local_size)}")
    kind = "bicubic" if mode == "bicubic" else ("linear" if "linear" in mode else mode)
    for i, s in shards.items():
        x = _resample_dim(x, s, out_sizes[i], kind, bool(align_corners), factors[i])
    return wrap(x, output_layout(layout, shards, out_sizes))


def _factors(scale_factor, nd: int) -> list[float]:
    return [float(scale_factor)] * nd if isinstance(scale_factor, (int, float)) else [float(f) for f in scale_factor]


def _out_sizes(global_in, size, scale_factor) -> list[int]:
    nd = len(global_in)
    if size is not None:
        return [int(size)] * nd if isinstance(size, int) else [int(v) for v in size]
    return [math.floor(n * f) for n, f in zip(global_in, _factors(scale_factor, nd))]


HANDLERS = bound(interpolate, F.interpolate)

__all__ = ["HANDLERS", "taps"]
