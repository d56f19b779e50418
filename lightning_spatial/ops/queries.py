"""Queries that read no data answer from the shard and the layout, never by gathering.

Shape queries answer for the global tensor (``.shape``, ``size``, ``numel``, ``len``); everything else that
describes a tensor without reading it (dtype, device, ``dim``, ``is_floating_point``, autograd plumbing,
new replicated tensors from ``x.new_*``) is the shard's own answer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .elementwise import functions


def _global_size(x, dim: int | None = None):
    with torch._C.DisableTorchFunctionSubclass():
        local = x.shape  # the shard's own sizes, without making a plain alias of it
    shape = x._layout.global_shape(local)
    return shape if dim is None else shape[dim]


def _local(func: Callable) -> Callable:
    def query(*args, **kwargs):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    return query


_DESCRIPTORS = [n for n in dir(torch.Tensor) if type(getattr(torch.Tensor, n)).__name__ == "getset_descriptor"]

GLOBAL: dict[Callable, Callable] = {
    torch.Tensor.shape.__get__: lambda x: _global_size(x),
    torch.Tensor.size: _global_size,
    torch.Tensor.numel: lambda x: _global_size(x).numel(),
    torch.Tensor.nelement: lambda x: _global_size(x).numel(),
    torch.numel: lambda x: _global_size(x).numel(),
    torch.Tensor.__len__: lambda x: _global_size(x, 0),
}

LOCAL: frozenset[Callable] = frozenset(
    (
        {getattr(torch.Tensor, n).__get__ for n in _DESCRIPTORS}
        | {getattr(torch.Tensor, n).__set__ for n in _DESCRIPTORS}
        | functions(
            [
                "dim",
                "ndimension",
                "stride",
                "is_contiguous",
                "data_ptr",
                "element_size",
                "storage_offset",
                "untyped_storage",
                "get_device",
                "is_floating_point",
                "is_complex",
                "backward",
                "register_hook",
                "retain_grad",
                "__reduce_ex__",
                "__setstate__",
                "_is_view",
                "is_pinned",
                "new_empty",
                "new_zeros",
                "new_ones",
                "new_full",
                "new_tensor",
            ],
            (torch.Tensor, torch),  # torch.is_floating_point(x) too: Lightning's precision plugins ask it
        )
    )
    - set(GLOBAL)
)

HANDLERS = {**{f: _local(f) for f in LOCAL}, **GLOBAL}

__all__ = ["GLOBAL", "HANDLERS", "LOCAL"]
