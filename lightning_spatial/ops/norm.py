"""Normalisation with statistics over the whole image: per-rank sums all-reduced over the spatial axes.

Two passes (mean, then the sum of squared deviations) keep fp32 accuracy. BatchNorm's running statistics
are updated from the global batch statistics exactly as one device would (unbiased variance with the
global count); eval mode uses the running statistics locally. BatchNorm statistics span the spatial group
only: the data-parallel group joins only when the user asked for SyncBatchNorm (``Trainer(sync_batchnorm=True)``,
which the strategy routes here by entering ``batch_norm_over(data_axis)``; it assumes equal batch sizes per
replica).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from ..collectives import across
from ..layout import Axis
from ..tensor import localize, unwrap, wrap
from ._binding import bound
from ._common import spatial_shards

_data_axis: ContextVar[Axis | None] = ContextVar("batch_norm_data_axis", default=None)


@contextmanager
def batch_norm_over(axis: Axis | None) -> Iterator[None]:
    """While entered, training-mode batch_norm also reduces its statistics over ``axis`` (SyncBatchNorm's
    data axis); ``None`` keeps them within the spatial group."""
    token = _data_axis.set(axis)
    try:
        yield
    finally:
        _data_axis.reset(token)


def _normalize(x: torch.Tensor, dims: tuple[int, ...], shards, count: int, eps: float):
    """(x - mean) / sqrt(var + eps) over ``dims`` of the global tensor; also returns mean and (biased) var."""
    mean = across(x.sum(dims, keepdim=True), shards) / count
    var = across(((x - mean) ** 2).sum(dims, keepdim=True), shards) / count
    return (x - mean) * torch.rsqrt(var + eps), mean, var


def _affine(out: torch.Tensor, weight, bias) -> torch.Tensor:
    """Per-channel scale and shift (channel dim 1)."""
    shape = [1, -1] + [1] * (out.dim() - 2)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    return out


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    x, layout = unwrap(input)
    shards = list(spatial_shards("batch_norm", x, layout, x.dim() - 2).values())
    if not training and running_mean is not None:
        return wrap(F.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps), layout)
    dims = tuple(d - x.dim() for d in range(x.dim()) if d != 1)
    count = math.prod(layout.global_shape(x)[d] for d in dims)
    data_axis = _data_axis.get()
    if data_axis is not None:
        shards, count = [*shards, data_axis], count * data_axis.size
    if count <= 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {tuple(layout.global_shape(x))}"
        )
    out, mean, var = _normalize(x, dims, shards, count, eps)
    out = _affine(out, weight, bias)
    if training and running_mean is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.flatten(), alpha=momentum)
            running_var.mul_(1 - momentum).add_(var.flatten() * (count / (count - 1)), alpha=momentum)
    return wrap(out, layout)


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    x, layout = unwrap(input)
    shards = list(spatial_shards("group_norm", x, layout, x.dim() - 2).values())
    n, c = x.shape[:2]
    grouped = x.reshape(n, num_groups, c // num_groups, *x.shape[2:])  # sharded dims keep their negative index
    dims = tuple(range(-(grouped.dim() - 2), 0))
    count = (c // num_groups) * math.prod(layout.global_shape(x)[2:])
    out, _, _ = _normalize(grouped, dims, shards, count, eps)
    return wrap(_affine(out.reshape(x.shape), weight, bias), layout)


def instance_norm(
    input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True, momentum=0.1, eps=1e-5
):
    x, layout = unwrap(input)
    shards = list(spatial_shards("instance_norm", x, layout, x.dim() - 2).values())
    if not use_input_stats:
        return wrap(F.instance_norm(x, running_mean, running_var, weight, bias, False, momentum, eps), layout)
    dims = tuple(range(-(x.dim() - 2), 0))
    count = math.prod(layout.global_shape(x)[2:])
    out, mean, var = _normalize(x, dims, shards, count, eps)
    out = _affine(out, weight, bias)
    if running_mean is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.flatten(2).mean((0, 2)), alpha=momentum)
            unbiased = var.flatten(2).mean((0, 2)) * (count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
    return wrap(out, layout)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    x, layout = unwrap(input)
    k = len(normalized_shape) if not isinstance(normalized_shape, int) else 1
    dims = tuple(range(-k, 0))
    shards = [s for s in layout.shards if s.dim in dims]
    if not shards:  # over channels only (ConvNeXt's LayerNorm2d): local
        return wrap(F.layer_norm(x, x.shape[-k:], weight, bias, eps), layout)
    count = math.prod(layout.global_shape(x)[-k:])
    out, _, _ = _normalize(x, dims, shards, count, eps)
    if weight is not None:  # affine parameters cover the global dims: take our part
        out = out * localize(F.layer_norm, weight, layout)
    if bias is not None:
        out = out + localize(F.layer_norm, bias, layout)
    return wrap(out, layout)


HANDLERS = (
    bound(batch_norm, F.batch_norm)
    | bound(group_norm, F.group_norm)
    | bound(instance_norm, F.instance_norm)
    | bound(layer_norm, F.layer_norm)
)

__all__ = ["HANDLERS", "batch_norm_over"]
