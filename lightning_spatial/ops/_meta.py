"""Torch's own argument errors, before any message: the call run on meta tensors of the operands' global shapes.

Every rank raises torch's error for a call torch rejects (shapes, dtypes, mask sizes) before it communicates, at
no memory cost (a ``SpatialTensor``'s ``shape`` is global).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_map

from ..plans import planned


def raise_torch_error(func: Callable, args: tuple, kwargs: dict) -> None:
    """Run the call on meta tensors of the same global shapes: torch raises its own error for a bad call."""

    def meta(t):
        return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t

    args, kwargs = tree_map(meta, (args, kwargs))  # global shapes: ``t.shape`` of a SpatialTensor is global
    try:
        func(*args, **kwargs)
    except NotImplementedError:  # no meta kernel: nothing learnt
        pass


def meta_check(func: Callable, *args, **kwargs) -> None:
    """Run ``func`` on meta tensors of the operands' global shapes: torch's own argument errors (shapes,
    dtypes, mask sizes) on every rank before any message, at no memory cost. A signature that passed once
    is not checked again (the meta call costs about a millisecond for attention)."""
    _meta_checked(func, _signature(args), _signature(kwargs))


@planned
def _meta_checked(func: Callable, args: tuple, kwargs: tuple) -> None:
    func(*tree_map(_meta, args, is_leaf=_is_spec), **dict(tree_map(_meta, kwargs, is_leaf=_is_spec)))


class _Spec(tuple):
    """A tensor's global shape and dtype in a signature."""


def _is_spec(value) -> bool:
    return isinstance(value, _Spec)


def _meta(value):
    return torch.empty(value[0], dtype=value[1], device="meta") if isinstance(value, _Spec) else value


def _signature(value):
    """What a meta call's outcome depends on: tensors' global shapes and dtypes, and the other arguments."""
    if isinstance(value, torch.Tensor):
        return _Spec((tuple(value.shape), value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in value.items())
    return value


__all__ = ["meta_check", "raise_torch_error"]
