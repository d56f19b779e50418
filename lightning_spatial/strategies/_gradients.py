"""How a spatial strategy reduces weight gradients: the split-gradient convention (docs/design.md), for the Trainer
and for Fabric alike; and where DDP's buffer broadcast is needed.

``share`` seeds the replicated loss with ``1/S`` on each of the ``S`` ranks of a spatial group, so a sharded
tensor's gradient (``x.grad`` of a sharded input) is exactly its part of the true gradient, and a weight's gradient
on one rank is its share, the shares of a group summing to the true gradient. DDP sums them over the world and the
comm hook divides by the data-parallel size only: the data-parallel mean of true gradients, bucketed and overlapped,
on CPU and GPU. A user comm hook (fp16/bf16 compression, PowerSGD) averages over the world; its result is scaled by
``S``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..graphs import noting_bucket_views
from ..mesh import SpatialDims

UserHook = tuple[object | None, Callable | None, Callable | None]  # (ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper)


def share(loss: torch.Tensor, dims: SpatialDims) -> torch.Tensor:
    """This rank's ``1/S`` of the replicated loss, to call backward on."""
    return loss / dims.spatial_size


def ddp_options(dims: SpatialDims, given: dict) -> dict:
    """The keyword arguments for ``DistributedDataParallel``: the user's (``given``), with ``broadcast_buffers``
    unless they set it: rank 0's buffers sent to every rank before each forward only where ranks compute different
    ones, across data-parallel replicas. The ranks of one spatial group compute the same buffers (BatchNorm's running
    statistics come from the group's statistics; every reduction spans the whole image), so a run of one group skips
    that broadcast every step."""
    return {"broadcast_buffers": dims.data > 1, **given}


def before_ddp(module: torch.nn.Module, run: ExitStack) -> None:
    """What ``module`` needs before DDP wraps it: gradients laid out like their parameters, and dynamo's DDP graph
    splitting off until ``run`` closes. A compiled module's graph is not split at DDP's buckets: AOT autograd fails
    on the split pieces when they hold our messages (ordered effects; torch 2.14, docs/design.md). Gradients are
    then reduced after the compiled backward rather than during it."""
    run.enter_context(torch._dynamo.config.patch(optimize_ddp=False))
    gradients_laid_out_like_parameters(module)


def register_comm_hook(ddp: DistributedDataParallel, dims: SpatialDims, user: UserHook, replays: bool) -> None:
    """Shares summed over the world, divided by the data-parallel size; or the user's hook scaled to that. With
    ``replays`` (CUDA graphs) the hook notes DDP's bucket views, where a replayed backward writes its gradients."""
    state, hook, wrapper = user
    if hook is None:
        state, hook = dims.data, _sum_then_divide
    else:
        hook = _scaled(wrapper(hook) if wrapper is not None else hook, dims.spatial_size)
    ddp.register_comm_hook(state, noting_bucket_views(hook) if replays else hook)


def gradients_laid_out_like_parameters(module: torch.nn.Module) -> None:
    """Before wrapping ``module`` in DDP: gradients that differ from their parameter's strides only on size-1 dims
    get the parameter's (see ``_laid_out_like``), so DDP neither warns nor copies them."""
    for param in module.parameters():
        if param.requires_grad and param.dim() > 1 and 1 in param.shape:
            param.register_hook(_laid_out_like(param))


def _laid_out_like(param: torch.Tensor):
    """A gradient hook giving ``param``'s strides to a gradient with the same memory layout but other strides on
    size-1 dims (a depthwise (C, 1, k, k) weight's gradient from a channels_last convolution): DDP compares
    strides exactly and would copy it into its bucket with a warning. Other layouts are left to DDP."""
    stride = param.stride()

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if grad.stride() == stride or any(a != b for a, b, n in zip(grad.stride(), stride, grad.shape) if n > 1):
            return grad
        return grad.as_strided(grad.shape, stride, grad.storage_offset())

    return hook


def _sum_then_divide(data_size, bucket):
    """DDP's all-reduce, divided by the data-parallel size instead of the world size: gradient shares summed
    over each spatial group, averaged over the data replicas. (DDP checks a hook's annotations against the
    real classes, which ``from __future__ import annotations`` turns into strings: none here.) A spatial group alone
    (one replica) divides by nothing: a pass over every gradient less (ConvNeXt-XL's 1.4 GB in fp32; docs/changelog.md,
    2026-12-06)."""
    buffer = bucket.buffer() if data_size == 1 else bucket.buffer().div_(data_size)
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda _: buffer)  # reduced in place


def _scaled(hook: Callable, spatial_size: int) -> Callable:
    """A world-averaging comm hook made a mean over data replicas of sums over spatial groups."""

    def scaled_hook(state, bucket):
        return hook(state, bucket).then(lambda fut: fut.value().mul_(spatial_size))

    return scaled_hook


__all__ = ["UserHook", "before_ddp", "gradients_laid_out_like_parameters", "register_comm_hook", "share"]
