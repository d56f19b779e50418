"""Normalisation with statistics over the whole image: per-rank sums all-reduced over the spatial axes.

Two passes (mean, then the sum of squared deviations) keep fp32 accuracy. One autograd Function normalises and
applies the affine parameters and keeps only the input and the statistics for its backward (as torch's fused
kernels do; built from ordinary ops, autograd would keep about three activation-sized tensors per layer). BatchNorm
on CUDA runs on the kernels of torch's SyncBatchNorm instead (each rank's statistics and sums in one pass each, in
fp32 whatever the activations' precision), with one eval-mode BatchNorm to normalise: a few kernels each way where
the two passes launch about 30, which at S = 8 are short enough that their launches set the time. BatchNorm's
running statistics
are updated from the global batch statistics exactly as one device would (unbiased variance with the
global count); eval mode uses the running statistics locally. BatchNorm statistics span the spatial group
only: the data-parallel group joins only when the user asked for SyncBatchNorm (``Trainer(sync_batchnorm=True)``,
which the strategy routes here through its run's ``data_axis``; it assumes equal batch sizes per replica).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import run
from ..collectives import _memory_format, across_detached
from ..plans import planned
from ..tensor import _dynamo_compiling, adopt, on_shard, unwrap
from ._binding import bound
from ._common import eager_backward, localize, spatial_shards


class _Normalize(torch.autograd.Function):
    """``(x - mean) * invstd * weight + bias`` with mean and variance over ``dims`` of the global tensor
    (all-reduced over ``axes``); ``weight``/``bias`` broadcast against ``x``. Returns (out, mean, var)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dims, axes, count: int, eps: float):
        wide = torch.promote_types(x.dtype, torch.float32)  # statistics in fp32 at least (bf16 activations)
        mean = across_detached(x.sum(dims, keepdim=True, dtype=wide), axes) / count
        var = across_detached(((x - mean) ** 2).sum(dims, keepdim=True), axes) / count
        invstd = torch.rsqrt(var + eps)
        out = (x - mean) * invstd
        if weight is not None:
            out = out * weight
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.dims, ctx.axes, ctx.count, ctx.bias_shape = dims, axes, count, None if bias is None else bias.shape
        ctx.mark_non_differentiable(mean, var)
        return out.to(x.dtype), mean, var

    @staticmethod
    @eager_backward  # the statistics' all-reduces carry no graph
    def backward(ctx, grad, _mean, _var):
        x, weight, mean, invstd = ctx.saved_tensors
        xhat = (x - mean) * invstd
        grad = grad.to(xhat.dtype)
        g = grad if weight is None else grad * weight
        sum_g = across_detached(g.sum(ctx.dims, keepdim=True), ctx.axes)
        sum_gx = across_detached((g * xhat).sum(ctx.dims, keepdim=True), ctx.axes)
        grad_x = (g - sum_g / ctx.count - xhat * (sum_gx / ctx.count)) * invstd
        # the affine parameters are replicated: their local sums are this rank's share of the gradient
        grad_w = (grad * xhat).sum_to_size(weight.shape) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = grad.sum_to_size(ctx.bias_shape) if ctx.bias_shape is not None and ctx.needs_input_grad[2] else None
        return grad_x.to(x.dtype), grad_w, grad_b, None, None, None, None


class _BatchNorm(torch.autograd.Function):
    """``_Normalize`` for BatchNorm on CUDA (channels at dim 1, statistics over every other dim), by torch's
    SyncBatchNorm kernels: each rank's mean and variance from ``batch_norm_stats`` (one pass, Welford, fp32),
    combined over ``axes`` by Chan et al.'s pairwise update (the group's mean first, then each rank's sum of squares
    about it); its backward's sums from ``batch_norm_backward_reduce`` and the input's gradient from
    ``batch_norm_backward_elemt``. Returns (out, mean, var) per channel."""

    @staticmethod
    def forward(ctx, x, weight, bias, axes, count: int, eps: float):
        x = x.contiguous(memory_format=_memory_format(x))  # as the kernels take it (a no-op for a conv's output)
        mean, invstd = torch.batch_norm_stats(x, eps)
        n = x.numel() // x.shape[1]  # this rank's elements per channel
        total = across_detached(mean * n, axes) / count
        var = across_detached((invstd.pow(-2) - eps + (mean - total) ** 2) * n, axes) / count
        wide = [None if p is None else p.to(total.dtype) for p in (weight, bias)]  # torch's mixed-precision BatchNorm
        out = F.batch_norm(x, total, var, *wide, False, 0.0, eps)
        ctx.save_for_backward(x, wide[0], total, torch.rsqrt(var + eps))
        ctx.axes, ctx.count = axes, count
        ctx.dtypes = [None if p is None else p.dtype for p in (weight, bias)]
        ctx.mark_non_differentiable(total, var)
        return out, total, var

    @staticmethod
    @eager_backward  # the sums' all-reduces carry no graph
    def backward(ctx, grad, _mean, _var):
        x, weight, mean, invstd = ctx.saved_tensors
        grad = grad.contiguous(memory_format=_memory_format(x))
        wants = [ctx.needs_input_grad[0]] + [w and d is not None for w, d in zip(ctx.needs_input_grad[1:3], ctx.dtypes)]
        sum_g, sum_gx, grad_w, grad_b = torch.batch_norm_backward_reduce(grad, x, mean, invstd, weight, *wants)
        grad_x = None
        if wants[0]:
            sum_g, sum_gx = across_detached(torch.stack([sum_g, sum_gx]), ctx.axes).unbind(0)
            grad_x = torch.batch_norm_backward_elemt(
                grad, x, mean, invstd, weight, sum_g, sum_gx, _counts(ctx.count, x.device)
            )
        # the affine parameters are replicated: their local sums are this rank's share of the gradient
        grad_w, grad_b = (g.to(d) if want else None for g, d, want in zip((grad_w, grad_b), ctx.dtypes, wants[1:]))
        return grad_x, grad_w, grad_b, None, None, None


@planned
def _counts(count: int, device: torch.device) -> torch.Tensor:
    """The global count per channel as ``batch_norm_backward_elemt`` takes it (the ranks' counts, summed by it), made
    once per device: no host-to-device copy in the step."""
    return torch.tensor([count], dtype=torch.int32, device=device)


def _normalize(x: torch.Tensor, dims: tuple[int, ...], shards, count: int, eps: float, weight=None, bias=None):
    """Normalise ``x`` over ``dims`` of the global tensor and apply ``weight``/``bias`` (broadcast against ``x``);
    also returns the mean and the biased variance (for running statistics)."""
    return _Normalize.apply(x, weight, bias, dims, tuple(shards), count, eps)


def _channel(param, ndim: int):
    """A per-channel parameter shaped to broadcast against ``(N, C, ...)``."""
    return None if param is None else param.view([1, -1] + [1] * (ndim - 2))


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    x, layout = unwrap(input)
    shards = list(spatial_shards("batch_norm", layout, x.dim() - 2).values())
    if not training and running_mean is not None:
        return adopt(F.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps), layout)
    dims = tuple(d - x.dim() for d in range(x.dim()) if d != 1)
    count = math.prod([layout.global_shape(x)[d] for d in dims])
    data_axis = run.current().data_axis
    if data_axis is not None:
        shards, count = [*shards, data_axis], count * data_axis.size
    if count <= 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {tuple(layout.global_shape(x))}"
        )
    if x.is_cuda:
        out, mean, var = _BatchNorm.apply(x, weight, bias, tuple(shards), count, eps)
    else:
        out, mean, var = _normalize(x, dims, shards, count, eps, _channel(weight, x.dim()), _channel(bias, x.dim()))
    if training and running_mean is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.flatten(), alpha=momentum)
            running_var.mul_(1 - momentum).add_(var.flatten() * (count / (count - 1)), alpha=momentum)
    return adopt(out, layout)


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    x, layout = unwrap(input)
    shards = list(spatial_shards("group_norm", layout, x.dim() - 2).values())
    n, c = x.shape[:2]
    grouped = x.reshape(n, num_groups, c // num_groups, *x.shape[2:])  # sharded dims keep their negative index
    dims = tuple(range(-(grouped.dim() - 2), 0))
    count = (c // num_groups) * math.prod(layout.global_shape(x)[2:])
    per_group = [1, num_groups, c // num_groups] + [1] * (x.dim() - 2)  # channel parameters against grouped x
    weight, bias = (None if p is None else p.view(per_group) for p in (weight, bias))
    out, _, _ = _normalize(grouped, dims, shards, count, eps, weight, bias)
    return adopt(out.reshape(x.shape), layout)


def instance_norm(
    input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True, momentum=0.1, eps=1e-5
):
    x, layout = unwrap(input)
    shards = list(spatial_shards("instance_norm", layout, x.dim() - 2).values())
    if not use_input_stats:
        return adopt(F.instance_norm(x, running_mean, running_var, weight, bias, False, momentum, eps), layout)
    dims = tuple(range(-(x.dim() - 2), 0))
    count = math.prod(layout.global_shape(x)[2:])
    out, mean, var = _normalize(x, dims, shards, count, eps, _channel(weight, x.dim()), _channel(bias, x.dim()))
    if running_mean is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.flatten(2).mean((0, 2)), alpha=momentum)
            unbiased = var.flatten(2).mean((0, 2)) * (count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
    return adopt(out, layout)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    layout = input._layout
    k = len(normalized_shape) if not isinstance(normalized_shape, int) else 1
    if layout.dims[-1] < -k:  # over channels only (ConvNeXt's LayerNorm2d): local, as F.layer_norm calls torch's kernel
        return adopt(on_shard(torch.layer_norm, input, normalized_shape, weight, bias, eps, _cudnn_enabled()), layout)
    dims = tuple(range(-k, 0))
    shards = [s for s in layout.shards if s.dim in dims]
    x = input.to_local()
    count = math.prod(layout.global_shape(x)[-k:])
    weight, bias = (localize(F.layer_norm, p, layout) for p in (weight, bias))  # they cover the global dims
    out, _, _ = _normalize(x, dims, shards, count, eps, weight, bias)
    return adopt(out, layout)


def _cudnn_enabled() -> bool:
    """``torch.backends.cudnn.enabled``, read in eager code from its C getter (the module property costs 0.3 us)."""
    return torch.backends.cudnn.enabled if _dynamo_compiling() else torch._C._get_cudnn_enabled()


HANDLERS = (
    bound(batch_norm, F.batch_norm)
    | bound(group_norm, F.group_norm)
    | bound(instance_norm, F.instance_norm)
    | bound(layer_norm, F.layer_norm)
)

__all__ = ["HANDLERS"]
