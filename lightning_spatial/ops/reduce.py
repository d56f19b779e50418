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
import torch.nn.functional as F

from ..collectives import MAX, MIN, across, across_detached
from ..fallback import fallback
from ..layout import Layout
from ..tensor import SpatialTensor, adopt, unwrap
from ._binding import bound
from ._common import localize
from .elementwise import elementwise
from .select import select


def normalize_dims(dim, ndim: int) -> tuple[int, ...]:
    """Reduction dims as sorted negative ints; ``None`` or ``()`` means all dims. Bad dims raise torch's errors."""
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return tuple(range(-ndim, 0))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    for d in dims:
        if not -ndim <= d < ndim:
            raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {d})")
    out = [d - ndim if d >= 0 else d for d in dims]
    for d in set(out):
        if out.count(d) > 1:
            raise RuntimeError(f"dim {d + ndim} appears multiple times in the list of dims")
    return tuple(sorted(out))


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
    return adopt(out, reduced_layout(layout, dims, keepdim))


def _count(layout: Layout, x: torch.Tensor, dims) -> int:
    shape = layout.global_shape(x)
    return math.prod([shape[d] for d in dims])


def refuse_integer_mean(kind: str, x: torch.Tensor, dtype) -> None:
    """torch's own error for the mean of integers without a floating ``dtype``."""
    if kind == "mean" and dtype is None and not (x.is_floating_point() or x.is_complex()):
        torch.mean(torch.empty(0, dtype=x.dtype, device="meta"))


def _reduction(kind: str):
    """sum, mean, amax, amin."""

    def reduce(input, dim=None, keepdim=False, dtype=None):
        x, layout, dims, shards = _operands(input, dim)
        refuse_integer_mean(kind, x, dtype)
        options = {"dtype": dtype} if dtype is not None else {}
        if not shards:  # only unsharded dims: torch's own op on the shard
            return adopt(getattr(torch, kind)(x, dims, keepdim, **options), reduced_layout(layout, dims, keepdim))
        if kind in ("sum", "mean"):
            total = across(x.sum(dims, keepdim=True, **options), shards)
            result = total if kind == "sum" else total / _count(layout, x, dims)
        else:
            local = x.amax(dims, keepdim=True) if kind == "amax" else x.amin(dims, keepdim=True)
            result = across(local, shards, MAX if kind == "amax" else MIN)
        return _finish(result, dims, keepdim, layout)

    reduce.__name__ = kind
    return reduce


def _moments(kind: str):
    """var and std with torch's ``correction`` (or legacy ``unbiased``), two-pass for accuracy."""

    def moment(input, dim=None, unbiased=True, keepdim=False, correction=None):
        x, layout, dims, shards = _operands(input, dim)
        correction = (1 if unbiased else 0) if correction is None else correction
        if not shards:
            local = getattr(torch, kind)(x, dims, correction=correction, keepdim=keepdim)
            return adopt(local, reduced_layout(layout, dims, keepdim))
        count = _count(layout, x, dims)
        mean = across(x.sum(dims, keepdim=True), shards) / count
        squares = across(((x - mean) ** 2).sum(dims, keepdim=True), shards)
        var = squares / max(count - correction, 0)
        return _finish(var.sqrt() if kind == "std" else var, dims, keepdim, layout)

    moment.__name__ = kind
    return moment


def vector_norm(input, ord=2, dim=None, keepdim=False, dtype=None):
    x, layout, dims, shards = _operands(input, dim, dtype)
    if not shards:
        return adopt(torch.linalg.vector_norm(x, ord, dims, keepdim), reduced_layout(layout, dims, keepdim))
    if ord == math.inf:
        result = across(x.abs().amax(dims, keepdim=True), shards, MAX)
    elif ord == -math.inf:
        result = across(x.abs().amin(dims, keepdim=True), shards, MIN)
    elif ord == 0:  # the count of non-zeros; torch's own local op keeps its (zero) gradient in the graph
        result = across(torch.linalg.vector_norm(x, 0, dims, keepdim=True), shards)
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
        return adopt(torch.logsumexp(x, dims, keepdim), reduced_layout(layout, dims, keepdim))
    m = _detached_max(x, dims, shards)
    total = across(torch.exp(x - m).sum(dims, keepdim=True), shards)
    return _finish(total.log() + m, dims, keepdim, layout)


def _softmax(log: bool):
    name = "log_softmax" if log else "softmax"

    def softmax(input, dim=None, dtype=None, _stacklevel=3):
        if dim is None:  # F.softmax's legacy implicit dim, with torch's warning
            dim = F._get_softmax_dim(name, input.dim(), _stacklevel + 2)
        x, layout, dims, shards = _operands(input, dim, dtype)
        if not shards:
            return adopt((torch.log_softmax if log else torch.softmax)(x, dim), layout)
        m = _detached_max(x, dims, shards)
        shifted = x - m
        total = across(torch.exp(shifted).sum(dims, keepdim=True), shards)
        out = shifted - total.log() if log else torch.exp(shifted) / total
        return adopt(out, layout)

    softmax.__name__ = name
    return softmax


_LAST = torch.iinfo(torch.int64).max


def _first_extreme(values: torch.Tensor, where: torch.Tensor, shards, kind: str):
    """Across ranks: the extreme of each rank's candidate ``values`` and the smallest global index ``where``
    that holds it (torch picks the first occurrence)."""
    best = across_detached(values, shards, MAX if kind == "max" else MIN)
    return best, across_detached(torch.where(values == best, where, _LAST), shards, MIN)


def _extreme_along(x: torch.Tensor, layout, dim: int, kind: str):
    """max/min along one dim: values (gradient to the chosen element only, as torch's) and global indices."""
    dims = normalize_dims(dim, x.dim())
    s = layout.get(dims[0])
    local_values, local_index = getattr(torch, kind)(x, dims[0], keepdim=True)
    if s is None:  # an unsharded dim: torch's op on the shard
        return local_values, local_index, dims
    _, index = _first_extreme(local_values.detach(), local_index + s.start, [s], kind)
    mine = (index >= s.start) & (index < s.stop)
    picked = x.gather(dims[0], (index - s.start).clamp(0, x.shape[dims[0]] - 1))
    return across(torch.where(mine, picked, torch.zeros_like(picked)), [s]), index, dims


def _merged(layout, dims) -> bool:
    return any(s.merged for s in layout.shards if s.dim in dims)  # token dims: indices need the factors


def _extreme_of_tokens(input, dim: int, keepdim: bool, kind: str):
    """max/min along a merged token dim: the top-1 candidate selection of ``ops.select``."""
    values, index = select(input, 1, dim, kind == "max")
    return (values, index) if keepdim else (values.squeeze(dim), index.squeeze(dim))


def _extreme(kind: str):
    """``torch.max``/``min``: of everything (as ``amax``), along a dim (values and global indices), or of two
    tensors (element-wise)."""
    everything, pair = _reduction(f"a{kind}"), elementwise(getattr(torch, kind))

    def extreme(input, dim=None, keepdim=False, other=None):
        if other is not None:
            return pair(input, other)
        if dim is None:
            return everything(input)
        x, layout = unwrap(input)
        if _merged(layout, normalize_dims(dim, x.dim())):
            return getattr(torch.return_types, kind)(_extreme_of_tokens(input, dim, keepdim, kind))
        values, index, dims = _extreme_along(x, layout, dim, kind)
        return getattr(torch.return_types, kind)(tuple(_finish(t, dims, keepdim, layout) for t in (values, index)))

    extreme.__name__ = kind
    return extreme


def _arg_extreme(kind: str):
    """``argmax``/``argmin``: global indices along a dim, or into the flattened global tensor."""

    def arg(input, dim=None, keepdim=False):
        x, layout = unwrap(input)
        dims = normalize_dims(dim, x.dim())
        if _merged(layout, dims):
            if dim is not None:
                return _extreme_of_tokens(input, dim, keepdim, kind)[1]
            return fallback(getattr(torch, f"arg{kind}"), (input, dim, keepdim), {})  # a flat index over tokens
        if dim is not None:
            return _finish(_extreme_along(x, layout, dim, kind)[1], dims, keepdim, layout)
        flat = getattr(torch, f"arg{kind}")(x)
        coords = [
            c + (layout.get(d - x.dim()).start if layout.get(d - x.dim()) else 0)
            for d, c in enumerate(torch.unravel_index(flat, x.shape))
        ]
        shape = layout.global_shape(x)
        where = sum(c * math.prod(shape[d + 1 :]) for d, c in enumerate(coords))
        _, index = _first_extreme(x.flatten()[flat].reshape(1), where.reshape(1), layout.shards, kind)
        return index.reshape([1] * x.dim() if keepdim else [])

    arg.__name__ = f"arg{kind}"
    return arg


def _logical(kind: str):
    """all, any: the local answer, then one all-reduce (MIN for all, MAX for any) over the reduced axes."""

    def logical(input, dim=None, keepdim=False):
        x, layout, dims, shards = _operands(input, dim)
        local = getattr(torch, kind)(x, dims, keepdim=keepdim or bool(shards))
        if not shards:
            return adopt(local, reduced_layout(layout, dims, keepdim))
        result = across_detached(local.to(torch.uint8), shards, MIN if kind == "all" else MAX).to(local.dtype)
        return _finish(result, dims, keepdim, layout)

    logical.__name__ = kind
    return logical


def agree(local: bool, axes, device) -> bool:
    """True iff every rank of ``axes`` (or of the shards' axes) found ``local`` true: one boolean all-reduce."""
    flag = torch.tensor([local], dtype=torch.uint8, device=device)
    return bool(across_detached(flag, axes, MIN))


def _pair(func, input, other):
    """Both operands as this rank's parts next to the common layout; ``None`` if they need the fallback."""
    layouts = {t._layout for t in (input, other) if isinstance(t, SpatialTensor)}
    if len(layouts) != 1:
        return None
    layout = layouts.pop()
    return layout, localize(func, input, layout), localize(func, other, layout)


def equal(input, other):
    """The global answer (every rank the same): equal shapes (global, so no message) and equal parts."""
    if input.shape != other.shape:
        return False
    pair = _pair(torch.equal, input, other)
    if pair is None:
        return fallback(torch.equal, (input, other), {})
    layout, a, b = pair
    return agree(torch.equal(unwrap(a)[0], unwrap(b)[0]), layout.shards, a.device)


def allclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    pair = _pair(torch.allclose, input, other)
    if pair is None:
        return fallback(torch.allclose, (input, other, rtol, atol, equal_nan), {})
    layout, a, b = pair
    local = torch.allclose(unwrap(a)[0], unwrap(b)[0], rtol, atol, equal_nan)
    return agree(local, layout.shards, a.device)


def _registrations() -> dict:
    handlers = {}
    for kind in ("sum", "mean", "amax", "amin"):
        handlers |= bound(_reduction(kind), getattr(torch, kind), getattr(torch.Tensor, kind))
    for kind in ("var", "std"):
        handlers |= bound(_moments(kind), getattr(torch, kind), getattr(torch.Tensor, kind))
    for kind in ("all", "any"):
        handlers |= bound(_logical(kind), getattr(torch, kind), getattr(torch.Tensor, kind))
    for kind in ("max", "min"):
        handlers |= bound(_extreme(kind), getattr(torch, kind), getattr(torch.Tensor, kind))
        handlers |= bound(_arg_extreme(kind), getattr(torch, f"arg{kind}"), getattr(torch.Tensor, f"arg{kind}"))
    handlers |= bound(norm, torch.norm, torch.Tensor.norm)
    handlers |= bound(vector_norm, torch.linalg.vector_norm)
    handlers |= bound(logsumexp, torch.logsumexp, torch.Tensor.logsumexp)
    handlers |= bound(_softmax(False), torch.softmax, torch.Tensor.softmax, F.softmax)
    handlers |= bound(_softmax(True), torch.log_softmax, torch.Tensor.log_softmax, F.log_softmax)
    handlers |= bound(equal, torch.equal, torch.Tensor.equal)
    handlers |= bound(allclose, torch.allclose, torch.Tensor.allclose)
    return handlers


HANDLERS = _registrations()

__all__ = ["HANDLERS", "agree", "normalize_dims", "reduced_layout", "refuse_integer_mean"]
