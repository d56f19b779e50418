"""Convolutions over sharded spatial dims: fetch each rank's input window (halo), convolve locally.

Any kernel, stride, padding (ints, tuples, 'same', 'valid'), dilation and groups. Non-zero padding modes
reach us as ``F.pad`` (that is how ``nn.Conv2d`` applies them), handled in ``ops/pad.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..layout import Layout, conv_out_size, conv_window, transposed_window
from ..plans import planned
from ..tensor import _dynamo_compiling, adopt, unwrap
from ._binding import bound
from ._common import (
    Windows,
    local_padding,
    ntuple,
    output_layout,
    output_rows,
    output_sizes,
    require_replicated,
    spatial_shards,
)
from ._recipes import saved_as_recipe

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """Under autocast, cast before the halo exchange as the conv would after it: halos travel and windows
    are copied in bf16/fp16 instead of fp32 (the conv then sees its compute dtype and casts nothing)."""
    if not _dynamo_compiling() and not torch._C._is_any_autocast_enabled():
        return x  # no autocast at all (fp32): 0.6 us less than asking about the tensor's device
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        return x.to(dtype) if x.dtype != dtype and x.dtype in (torch.float32, torch.float64) else x
    return x


def _conv_padding(padding, kernel, stride, dilation, nd, op) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if padding == "valid":
        return (0,) * nd, (0,) * nd
    if padding == "same":
        if any(s != 1 for s in stride):
            raise ValueError(f"{op}: padding='same' is not supported for strided convolutions (torch's rule)")
        total = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return tuple(t // 2 for t in total), tuple(t - t // 2 for t in total)
    if isinstance(padding, str):
        raise ValueError(f"{op}: invalid padding string {padding!r}, expected 'same' or 'valid'")
    return padding, padding


@dataclass(frozen=True)
class _ConvPlan:
    windows: Windows
    pad: tuple[int, ...] | None  # F.pad of an asymmetric 'same' padding on an unsharded dim
    padding: tuple[int, ...]  # the local convolution's padding
    layout: Layout | None  # the output's
    local: bool  # every rank's window is its own rows, unpadded (1x1 and patchify convs): nothing to fetch
    stride: tuple[int, ...]
    dilation: tuple[int, ...]


@planned(maxsize=1024)
def _conv_plan(op, nd, layout: Layout, weight_shape, stride, padding, dilation) -> _ConvPlan:
    """Windows and local padding of one convolution call, built once per layout and arguments as given
    (``stride=1`` and ``stride=(1, 1)`` apart)."""
    kernel = tuple(weight_shape[2:])
    stride, dilation = ntuple(stride, nd, "stride"), ntuple(dilation, nd, "dilation")
    padding = padding if isinstance(padding, str) else ntuple(padding, nd, "padding")
    shards = spatial_shards(op, layout, nd)
    lo, hi = _conv_padding(padding, kernel, stride, dilation, nd, op)
    out_sizes = output_sizes(
        op, shards, lambda i, s: conv_out_size(s.size, kernel[i], stride[i], lo[i], hi[i], dilation[i])
    )
    windows = Windows.plan(
        shards, out_sizes, lambda i, a, b: conv_window(a, b, kernel[i], stride[i], lo[i], dilation[i])
    )
    local_lo, local_hi = local_padding(lo, shards), local_padding(hi, shards)
    pad = None
    if local_lo != local_hi:  # asymmetric 'same' padding on an unsharded dim
        pad = tuple(p for i in reversed(range(nd)) for p in (local_lo[i], local_hi[i]))
        local_lo = [0] * nd
    local = pad is None and all(w == s.bounds for _, s, w in windows.dims)
    return _ConvPlan(windows, pad, tuple(local_lo), output_layout(layout, shards, out_sizes), local, stride, dilation)


def _convolution(nd: int):
    op = f"conv{nd}d"

    def conv(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        x, layout = unwrap(input)
        require_replicated(op, weight, bias)
        plan = _conv_plan(op, nd, layout, weight.shape, stride, padding, dilation)
        stride, dilation = plan.stride, plan.dilation
        x = autocast_input(x)
        if plan.local:
            return adopt(_CONV[nd](x, weight, bias, stride, plan.padding, dilation, groups), plan.layout)

        def window() -> torch.Tensor:
            w = plan.windows.fetch(x, own_grad=True)  # the conv's input gradient is fresh, read by no one else
            return w if plan.pad is None else F.pad(w, plan.pad)

        w = window()
        with saved_as_recipe(w, x, window):
            return adopt(_CONV[nd](w, weight, bias, stride, plan.padding, dilation, groups), plan.layout)

    conv.__name__ = op
    return conv


def _transposed(nd: int):
    op = f"conv_transpose{nd}d"

    def conv_transpose(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
        x, layout = unwrap(input)
        require_replicated(op, weight, bias)
        kernel = tuple(weight.shape[2:])
        stride, dilation = ntuple(stride, nd, "stride"), ntuple(dilation, nd, "dilation")
        padding, output_padding = ntuple(padding, nd, "padding"), ntuple(output_padding, nd, "output_padding")
        shards = spatial_shards(op, layout, nd)
        for i in shards:
            if output_padding[i] >= max(stride[i], dilation[i]):
                raise ValueError(f"{op}: output_padding {output_padding[i]} must be smaller than stride or dilation")

        def out_size(i, s):
            return (s.size - 1) * stride[i] - 2 * padding[i] + dilation[i] * (kernel[i] - 1) + output_padding[i] + 1

        out_sizes = output_sizes(op, shards, out_size)
        windows = Windows.plan(
            shards, out_sizes, lambda i, a, b: transposed_window(a, b, kernel[i], stride[i], padding[i], dilation[i])
        )
        x = windows.fetch(autocast_input(x))
        pads = local_padding(padding, shards), local_padding(output_padding, shards)
        out = _CONV_T[nd](x, weight, None, stride, *pads, groups, dilation)
        for i, s in shards.items():  # cut this rank's output rows out of the window's result
            lo, hi = output_rows(s, out_sizes[i])
            first = windows.start(i) * stride[i] - padding[i]
            out = out.narrow(i - nd, lo - first, hi - lo)
        if bias is not None:
            out = out + bias.view(-1, *([1] * nd))
        return adopt(out, output_layout(layout, shards, out_sizes))

    conv_transpose.__name__ = op
    return conv_transpose


def _registrations() -> dict:
    handlers = {}
    for nd in (1, 2, 3):
        handlers |= bound(_convolution(nd), _CONV[nd]) | bound(_transposed(nd), _CONV_T[nd])
    return handlers


HANDLERS = _registrations()

__all__ = ["HANDLERS"]
