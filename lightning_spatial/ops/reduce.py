"""Reductions and softmax over sharded dims: reduce locally, all-reduce over the reduced dims' axes.

The result is replicated along the reduced sharded dims and keeps the other dims' sharding. Gradients
follow the split convention: the all-reduce's adjoint is an all-reduce. Reductions over unsharded dims
only run locally. Means and variances divide by the *global* count; max/min split the gradient between
ties across ranks as torch's ``amax`` does.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist

from ..collectives import across, across_detached
from ..layout import Layout
from ..tensor import unwrap, wrap

SUM, MAX, MIN = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN


def normalize_dims(dim, ndim: int) -> tuple[int, ...]:
    """Reduction dims as sorted negative ints; ``None`` or ``()`` means all dims."""
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return tuple(range(-ndim, 0))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted({d - ndim if d >= 0 else d for d in dims}))


def reduced_layout(layout: Layout, dims: tuple[int, ...], keepdim: bool) -> Layout | None:
    """Layout after reducing ``dims``: reduced sharded dims become replicated, others may shift."""
    kept = []
    for s in layout.shards:
        if s.dim in dims:
            continue
        shift = 0 if keepdim else sum(1 for d in dims if d > s.dim)
        kept.append(replace(s, dim=s.dim + shift))
    return Layout(tuple(kept)) if kept else None


def _operands(input, dim, dtype=None):
    """(local shard, layout, reduced dims, shards among them) for a reduction over ``dim``."""
    x, layout = unwrap(input)
    if dtype is not None:
        x = x.to(dtype)
    dims = normalize_dims(dim, x.dim())
    return x, layout, dims, [s for s in layout.shards if s.dim in dims]


def _detached_max(x: torch.Tensor, dims, shards) -> torch.Tensor:
    m = across_detached(x.detach().amax(dims, keepdim=True), shards, MAX)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _finish(out: torch.Tensor, dims, keepdim: bool, layout: Layout) -> torch.Tensor:
    if not keepdim:
        out = out.squeeze(dims) if dims else out
    return wrap(out, reduced_layout(layout, dims, keepdim))


def _count(layout: Layout, x: torch.Tensor, dims) -> int:
    shape = layout.global_shape(x)
    return math.prod(shape[d] for d in dims)


def _reduction(kind: str):
    """sum, mean, amax, amin: ``(input, dim=None, keepdim=False, *, dtype=None)``."""

    def reduce(input, dim=None, keepdim=False, *, dtype=None, out=None):
        if out is not None:
            raise ValueError(f"{kind}: out= is not supported on sharded tensors")
        x, layout, dims, shards = _operands(input, dim)
        if not shards:  # only unsharded dims: torch's own op on the shard
            return wrap(
                getattr(torch, kind)(x, dims, keepdim, **({"dtype": dtype} if dtype else {})),
                reduced_layout(layout, dims, keepdim),
            )
        if kind in ("sum", "mean"):
            local = x.sum(dims, keepdim=True, dtype=dtype)
            total = across(local, shards)
            result = total if kind == "sum" else total / _count(layout, x, dims)
        else:
            local = x.amax(dims, keepdim=True) if kind == "amax" else x.amin(dims, keepdim=True)
            result = across(local, shards, MAX if kind == "amax" else MIN)
        return _finish(result, dims, keepdim, layout)

    reduce.__name__ = kind
    return reduce


def _moments(kind: str):
    """var and std with torch's ``correction`` (or legacy ``unbiased``), two-pass for accuracy."""

    def moment(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
        if isinstance(unbiased, (int, tuple, list)) and not isinstance(unbiased, bool):
            dim, unbiased = unbiased, None  # torch.var(x, dims) with dims positional after dim=None form
        x, layout, dims, shards = _operands(input, dim)
        correction = correction if correction is not None else (0 if unbiased is False else 1)
        if not shards:
            local = getattr(torch, kind)(x, dims, correction=correction, keepdim=keepdim)
            return wrap(local, reduced_layout(layout, dims, keepdim))
        count = _count(layout, x, dims)
        mean = across(x.sum(dims, keepdim=True), shards) / count
        squares = across(((x - mean) ** 2).sum(dims, keepdim=True), shards)
        var = squares / max(count - correction, 0)
        return _finish(var.sqrt() if kind == "std" else var, dims, keepdim, layout)

    moment.__name__ = kind
    return moment


def vector_norm(input, ord=2, dim=None, keepdim=False, *, dtype=None):
    x, layout, dims, shards = _operands(input, dim, dtype)
    if not shards:
        return wrap(torch.linalg.vector_norm(x, ord, dims, keepdim), reduced_layout(layout, dims, keepdim))
    if ord == math.inf:
        result = across(x.abs().amax(dims, keepdim=True), shards, MAX)
    elif ord == -math.inf:
        result = across(x.abs().amin(dims, keepdim=True), shards, MIN)
    elif ord == 0:
        result = across((x != 0).to(x.dtype).sum(dims, keepdim=True), shards)
    elif ord == 2:
        result = across((x * x).sum(dims, keepdim=True), shards).sqrt()
    else:
        result = across(x.abs().pow(ord).sum(dims, keepdim=True), shards).pow(1.0 / ord)
    return _finish(result, dims, keepdim, layout)


def norm(input, p="fro", dim=None, keepdim=False, dtype=None):
    if p == "fro" or p is None:
        p = 2
    if isinstance(p, str):
        raise ValueError(f"norm: p={p!r} (a matrix norm) is not supported on sharded tensors; use p=2 over the dims")
    return vector_norm(input, p, dim, keepdim, dtype=dtype)


def logsumexp(input, dim, keepdim=False):
    x, layout, dims, shards = _operands(input, dim)
    if not shards:
        return wrap(torch.logsumexp(x, dims, keepdim), reduced_layout(layout, dims, keepdim))
    m = _detached_max(x, dims, shards)
    total = across(torch.exp(x - m).sum(dims, keepdim=True), shards)
    return _finish(total.log() + m, dims, keepdim, layout)


def _softmax(log: bool):
    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        x, layout, dims, shards = _operands(input, dim, dtype)
        if not shards:
            return wrap((torch.log_softmax if log else torch.softmax)(x, dim), layout)
        m = _detached_max(x, dims, shards)
        shifted = x - m
        total = across(torch.exp(shifted).sum(dims, keepdim=True), shards)
        out = shifted - total.log() if log else torch.exp(shifted) / total
        return wrap(out, layout)

    softmax.__name__ = "log_softmax" if log else "softmax"
    return softmax


def _registrations() -> dict:
    handlers = {}
    for kind in ("sum", "mean", "amax", "amin"):
        for f in (getattr(torch, kind), getattr(torch.Tensor, kind)):
            handlers[f] = _reduction(kind)
    for kind in ("var", "std"):
        for f in (getattr(torch, kind), getattr(torch.Tensor, kind)):
            handlers[f] = _moments(kind)
    handlers.update({torch.norm: norm, torch.Tensor.norm: norm, torch.linalg.vector_norm: vector_norm})
    handlers.update({torch.logsumexp: logsumexp, torch.Tensor.logsumexp: logsumexp})
    for log, fs in (
        (False, (torch.softmax, torch.Tensor.softmax, torch.nn.functional.softmax)),
        (True, (torch.log_softmax, torch.Tensor.log_softmax, torch.nn.functional.log_softmax)),
    ):
        for f in fs:
            handlers[f] = _softmax(log)
    return handlers


HANDLERS = _registrations()

__all__ = ["HANDLERS", "normalize_dims", "reduced_layout"]
