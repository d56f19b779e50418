"""Queries that read no data answer from the shard and the layout, never by gathering.

Sizes answer for the global tensor (``.shape``, ``size``, ``numel``, ``len``, ``nbytes``, ``stride``: the strides
of the global tensor laid out in the shard's dim order, so ``as_strided(x.size(), x.stride())`` means what it
means on one device). Everything else that describes a tensor without reading it (dtype, device, ``dim``,
``is_floating_point``, ``result_type``, autograd plumbing, new replicated tensors from ``x.new_*``) is the shard's
own answer. Properties that are tensors keep the layout (``.data``, ``.grad``, ``.real``, ``.imag``), and the
dim reversals ``.T``, ``.H``, ``.mH`` permute the global dims like ``permute`` does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from ..fallback import name_of
from ..layout import LayoutError
from ..tensor import unwrap, wrap
from .elementwise import functions


def _local_shape(x) -> torch.Size:
    with torch._C.DisableTorchFunctionSubclass():
        return x.shape  # the shard's own sizes, without making a plain alias of it


def _global_size(x, dim: int | None = None):
    shape = x._layout.global_shape(_local_shape(x))
    return shape if dim is None else shape[dim]


def _global_stride(x, dim: int | None = None):
    """Dense strides of the global shape in the shard's dim order (contiguous stays contiguous, channels_last
    stays channels_last)."""
    with torch._C.DisableTorchFunctionSubclass():
        local = x.stride()
    shape = _global_size(x)
    strides, step = [0] * len(shape), 1
    for d in sorted(range(len(shape)), key=lambda d: local[d]):  # innermost first (stable for ties)
        strides[d], step = step, step * shape[d]
    return tuple(strides) if dim is None else strides[dim]


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
    torch.Tensor.nbytes.__get__: lambda x: _global_size(x).numel() * x.element_size(),
    torch.Tensor.stride: _global_stride,
    torch.is_same_size: lambda x, other: x.shape == other.shape,
    torch.Tensor.is_same_size: lambda x, other: x.shape == other.shape,
}


# -- properties that are tensors: they keep the layout ----------------------------------------------------


def _keeps_layout(prop) -> tuple[Callable, Callable]:
    """Getter and setter of a tensor-valued property (``.data``, ``.grad``, ``.real``): the shard's, with the
    layout; a value assigned to it is cut to this rank's part like any replicated operand."""

    def get(x):
        with torch._C.DisableTorchFunctionSubclass():
            value = prop.__get__(x)
        return wrap(value, x._layout) if value is not None else None

    def assign(x, value):
        local, layout = unwrap(value)
        if layout is not None and layout != x._layout:
            raise LayoutError(
                f"{name_of(prop.__set__)}: the value is sharded as [{layout.describe()}], the tensor as "
                f"[{x._layout.describe()}]; reshard one so both match"
            )
        if layout is None and isinstance(value, torch.Tensor):
            if value.shape != x.shape:
                raise LayoutError(
                    f"{name_of(prop.__set__)}: a replicated value of shape {tuple(value.shape)} for a sharded tensor "
                    f"of global shape {tuple(x.shape)}; it must have the global shape"
                )
            local = x._layout.take_local(value)
        with torch._C.DisableTorchFunctionSubclass():
            prop.__set__(x, local)

    return get, assign


def _reversal(prop, permute: Callable) -> Callable:
    """``.T``, ``.H``, ``.mH``: torch's checks and warnings on the global shape, then the dims permuted."""

    def get(x):
        with torch._C.DisableTorchFunctionSubclass():
            prop.__get__(torch.empty(_global_size(x), dtype=x.dtype, device="meta"))
        return permute(x)

    return get


def _reversed_dims(x):
    return x.permute(*range(x.dim() - 1, -1, -1))


def _deepcopy(x, memo):
    with torch._C.DisableTorchFunctionSubclass():
        local = copy.deepcopy(x.to_local(), memo)
    return wrap(local, x._layout)


PROPERTIES: dict[Callable, Callable] = {
    torch.Tensor.T.__get__: _reversal(torch.Tensor.T, _reversed_dims),
    torch.Tensor.H.__get__: _reversal(torch.Tensor.H, lambda x: _reversed_dims(x).conj()),
    torch.Tensor.mH.__get__: _reversal(torch.Tensor.mH, lambda x: x.transpose(-2, -1).conj()),
    torch.Tensor.__deepcopy__: _deepcopy,
}
for _name in ("data", "grad", "real", "imag"):
    _prop = getattr(torch.Tensor, _name)
    PROPERTIES[_prop.__get__], PROPERTIES[_prop.__set__] = _keeps_layout(_prop)


LOCAL: frozenset[Callable] = frozenset(
    (
        {getattr(torch.Tensor, n).__get__ for n in _DESCRIPTORS}
        | {getattr(torch.Tensor, n).__set__ for n in _DESCRIPTORS}
        | functions(
            [
                "dim",
                "ndimension",
                "is_contiguous",
                "data_ptr",
                "element_size",
                "storage_offset",
                "untyped_storage",
                "storage",
                "_typed_storage",
                "get_device",
                "is_floating_point",
                "is_complex",
                "is_signed",
                "is_inference",
                "is_shared",
                "is_pinned",
                "is_conj",
                "is_neg",
                "dim_order",
                "result_type",
                "__dlpack_device__",
                "register_hook",
                "register_post_accumulate_grad_hook",
                "retain_grad",
                "__setstate__",
                "_is_view",
                "new_empty",
                "new_empty_strided",
                "new_zeros",
                "new_ones",
                "new_full",
                "new_tensor",
            ],
            (torch.Tensor, torch),  # torch.is_floating_point(x) too: Lightning's precision plugins ask it
        )
    )
    - set(GLOBAL)
    - set(PROPERTIES)
)

HANDLERS = {**{f: _local(f) for f in LOCAL}, **GLOBAL, **PROPERTIES}

__all__ = ["GLOBAL", "HANDLERS", "LOCAL", "PROPERTIES"]
