"""Dropout and random tensors on sharded activations: decisions as one device would draw them.

Element-wise dropout draws the mask for the *global* tensor and keeps this rank's slice: every rank of a
spatial group consumes the same random stream (the strategy seeds them alike), so the mask is the one a
single device would draw (bit-exact on CPU) and never a periodic repetition of one local mask. Feature
dropout (per sample and channel) draws its small (N, C, 1, ...) mask identically on every rank. DropPath
(timm) needs nothing: its per-sample mask is a new replicated tensor broadcast onto the shard. ``rand_like``,
``randn_like``, ``randint_like`` and the in-place samplers (``x.normal_()``...) draw for the global tensor too.
A global draw costs one activation's worth of memory on every rank while it runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..fallback import fallback
from ..halo import empty_as
from ..tensor import unwrap, wrap
from ._binding import bound


def _check_p(p: float) -> None:
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


def dropout(input, p=0.5, training=True, inplace=False):
    _check_p(p)
    if not training or p == 0:
        return input
    x, layout = unwrap(input)
    if p == 1:  # as torch: zeros, no random draw
        return wrap(x.mul_(0) if inplace else x * 0, layout)
    noise = torch.empty(layout.global_shape(x), dtype=x.dtype, device=x.device).bernoulli_(1 - p).div_(1 - p)
    noise = layout.take_local(noise)
    return wrap(x.mul_(noise) if inplace else x * noise, layout)


def _feature_dropout(nd: int):
    def feature_dropout(input, p=0.5, training=True, inplace=False):
        _check_p(p)
        if not training or p == 0:
            return input
        x, layout = unwrap(input)
        if x.dim() != nd + 2:
            raise ValueError(f"dropout{nd}d on a sharded tensor expects a batched {nd + 2}-d input, got {x.dim()}-d")
        if p == 1:
            return wrap(x.mul_(0) if inplace else x * 0, layout)
        noise = x.new_empty(x.shape[:2] + (1,) * nd).bernoulli_(1 - p).div_(1 - p)
        return wrap(x.mul_(noise) if inplace else x * noise, layout)

    return feature_dropout


def _draw(func: Callable, x: torch.Tensor, layout, *args, **kwargs) -> torch.Tensor:
    """This rank's part of ``func`` drawn for the global tensor (memory of one global tensor while it runs)."""
    full = func(empty_as(x, list(layout.global_shape(x))), *args, **kwargs)
    return layout.take_local(full).clone(memory_format=torch.preserve_format)


def _random_like(func: Callable) -> Callable:
    """``torch.rand_like(x)`` & co: the draw one device would make, sharded like ``x``."""

    def like(input, *args, requires_grad=False, **kwargs):
        x, layout = unwrap(input)
        return wrap(_draw(func, x, layout, *args, **kwargs), layout).requires_grad_(requires_grad)  # a leaf

    return like


def _sample_(func: Callable) -> Callable:
    """``x.normal_()`` & co with scalar parameters: this rank's part of the global draw, written in place.
    Tensor parameters (``x.bernoulli_(p)``) take the exact fallback."""

    def sample(input, *args, **kwargs):
        if any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            return fallback(func, (input, *args), kwargs)
        x, layout = unwrap(input)
        with torch.no_grad():
            x.copy_(_draw(func, x, layout, *args, **kwargs))
        return input

    return sample


_LIKE = (torch.rand_like, torch.randn_like, torch.randint_like)
_SAMPLERS = ("normal_", "uniform_", "bernoulli_", "exponential_", "random_", "cauchy_", "log_normal_", "geometric_")

HANDLERS = (
    bound(dropout, F.dropout)
    | bound(_feature_dropout(1), F.dropout1d)
    | bound(_feature_dropout(2), F.dropout2d)
    | bound(_feature_dropout(3), F.dropout3d)
    | {f: _random_like(f) for f in _LIKE}
    | {getattr(torch.Tensor, n): _sample_(getattr(torch.Tensor, n)) for n in _SAMPLERS}
)

__all__ = ["HANDLERS"]
