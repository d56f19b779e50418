"""The sharded activation: a ``torch.Tensor`` whose data is this rank's shard, plus its layout.

``SpatialTensor`` stores only the local shard, but answers shape queries (``x.shape``, ``x.size()``,
``x.numel()``) with the *global* shape, so unchanged model code that computes sizes from shapes (views,
``F.interpolate(size=skip.shape[-2:])``, timm's ``pad_same``, position embeddings from ``torch.arange(W)``)
means what it means on one device. ``x.to_local()`` is the shard; ``x.shard_layout`` says which dims are
sharded, over which process group, with which global sizes (``layout.Layout``).

Every torch function called on it goes through ``__torch_function__``: the handler the registry holds for it
(``registry``; ``ops.install()`` registers spatial ops, element-wise ops, metadata queries), or else the exact
fallback: gather, run, reshard (``fallback``). Under ``torch.compile`` dynamo traces the handlers themselves
(docs/design.md, "torch.compile through shards").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.compiler as _compiler
from torch._guards import _TLS as _TRACING
from torch.multiprocessing.reductions import reduce_tensor

from . import fallback as _fallback
from .collectives import all_gather
from .layout import DimShard, Layout, LayoutError
from .mesh import Axis
from .registry import _HANDLERS, traced_handler

_dynamo_compiling = torch.compiler.is_dynamo_compiling
_Plain = torch._C.DisableTorchFunctionSubclass


class SpatialTensor(torch.Tensor):
    """This rank's shard of an activation; see the module docstring."""

    _layout: Layout

    @property
    def shard_layout(self) -> Layout:
        return self._layout

    def to_local(self) -> torch.Tensor:
        """The shard as a plain tensor, still attached to the autograd graph."""
        if _dynamo_compiling():  # an op of the graph (``as_subclass`` is not traceable)
            return torch.ops.aten.alias.default(self)
        with _Plain():
            return self.as_subclass(torch.Tensor)

    def settled(self) -> torch.Tensor:
        """This tensor as a shard or a replicated tensor: itself; a sum still pending is reduced (``ops.pending``)."""
        return self

    def __repr__(self, *, tensor_contents=None) -> str:  # local: printing must not communicate
        return f"SpatialTensor(layout=[{self._layout.describe()}], local={self.to_local()!r})"

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a SpatialTensor holds one rank's shard; a file of it (torch.save, pickle) could not be loaded without "
            "its process group. Save lightning_spatial.gather(x) (call it on every rank of the group), or "
            "x.to_local() for this rank's shard alone"
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Which code calls, decided here alone:
        # - dynamo tracing user code (``is_dynamo_compiling``): trace the handler, so the graph holds what it does;
        # - dynamo's own reads of a shard while it builds a graph (fakes, guards; torch 2.14 says so with its
        #   compiling flag, torch 2.11 only by its tracing context), and the ``torch.ops`` a compiled graph runs
        #   (traced from our handlers, on the shards): the plain op on the stored shard;
        # - eager code, the path of every op of an uncompiled step: the registered handler, else the fallback.
        if _dynamo_compiling():
            return _traced(func, args, kwargs or {})
        if not (_compiler._is_compiling_flag or getattr(_TRACING, "tracing_context", None) is not None):
            handler = _HANDLERS.get(func)
            if handler is not None:
                return handler(*args, **kwargs) if kwargs else handler(*args)
            if not isinstance(func, _GRAPH_OPS):
                return _fallback.fallback(func, args, kwargs or {})
        with _Plain():
            return func(*args, **(kwargs or {}))


def _traced(func, args, kwargs):
    """``__torch_function__`` as dynamo traces it: the handler is found outside the trace (``registry.slot``), its
    code is traced."""
    if isinstance(func, _GRAPH_OPS):
        with _Plain():
            return func(*args, **kwargs)
    handler = traced_handler(func)
    if handler is not None:
        return handler(*args, **kwargs)
    return _fallback.fallback(func, args, kwargs)


_GRAPH_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)


def _rebuild(rebuild: Callable, args: tuple, layout: Layout) -> SpatialTensor:
    return wrap(rebuild(*args), layout)


def _reduce_for_worker(x: SpatialTensor):
    """DataLoader workers send batches of shards through shared memory, as torch sends any tensor; an ``Axis``
    finds its process group again by its ranks in the receiving process."""
    return _rebuild, (*reduce_tensor(x.to_local()), x._layout)


ForkingPickler.register(SpatialTensor, _reduce_for_worker)


def wrap(local: torch.Tensor, layout: Layout | None) -> torch.Tensor:
    """Attach ``layout`` to a local shard (autograd-transparent); ``None`` means replicated (plain)."""
    if layout is None:
        return local
    if type(local) is torch.Tensor:  # no subclass to dispatch: skip the guard's context manager
        out = local.as_subclass(SpatialTensor)
    else:
        with _Plain():
            out = local.as_subclass(SpatialTensor)
    out._layout = layout
    return out


def adopt(out: torch.Tensor, layout: Layout | None) -> torch.Tensor:
    """``wrap`` for a tensor the caller has just computed and nothing else holds: it becomes the SpatialTensor
    itself instead of getting an alias (``as_subclass`` makes a new tensor: ~0.7 us per op on the host). Never
    pass a tensor that user code may hold (an operand returned unchanged, a parameter): use ``wrap``."""
    if layout is None:
        return out
    if type(out) is not torch.Tensor or _dynamo_compiling():
        return wrap(out, layout)
    out.__class__ = SpatialTensor
    out._layout = layout
    return out


def on_shard(func: Callable, *args: Any, **kwargs: Any) -> Any:
    """``func`` with every SpatialTensor argument read as its shard, without making plain aliases of them
    (``to_local``); the results are plain tensors, but an operand returned (in place) is returned as it is.

    Under dynamo the shards are read through plain aliases: dynamo types what an in-place op returns under
    disabled torch function as a plain tensor and puts it in place of every reference to the operand, which
    would lose the shard's layout in the code being traced."""
    if not _dynamo_compiling():
        with _Plain():
            return func(*args, **kwargs)
    local = [a.to_local() if isinstance(a, SpatialTensor) else a for a in args]
    named = {k: v.to_local() if isinstance(v, SpatialTensor) else v for k, v in kwargs.items()}
    out = func(*local, **named)
    for given, alias in (*zip(args, local), *((kwargs[k], named[k]) for k in kwargs)):
        if out is alias and alias is not given:
            return given
    return out


def unwrap(x: Any) -> tuple[Any, Layout | None]:
    if isinstance(x, SpatialTensor):
        return x.to_local(), x._layout
    return x, None


def shard(tensor: torch.Tensor, dims: Mapping[int, Axis]) -> SpatialTensor:
    """This rank's slice of a full (replicated) tensor, sharding each dim in ``dims`` over its axis."""
    shards = []
    for dim, axis in dims.items():
        neg = dim - tensor.dim() if dim >= 0 else dim
        if not -tensor.dim() <= neg < 0:
            raise LayoutError(f"cannot shard dim {dim} of a {tensor.dim()}-d tensor")
        if tensor.shape[neg] < axis.size:
            raise LayoutError(
                f"dim {dim} has size {tensor.shape[neg]}, smaller than its {axis.size} ranks: every rank needs "
                f"at least one row; use fewer ranks along this dim or a larger input"
            )
        shards.append(DimShard(neg, axis, tensor.shape[neg]))
    layout = Layout(tuple(shards))
    return wrap(layout.take_local(tensor), layout)


def settled(x: Any) -> Any:
    """``x`` as a shard or a replicated tensor (``SpatialTensor.settled``: a sum still pending is reduced, a
    Selection made whole); anything else as it is."""
    return x.settled() if isinstance(x, SpatialTensor) else x


def gather(x: torch.Tensor) -> torch.Tensor:
    """The full tensor on every rank (differentiable; plain tensors are returned as they are)."""
    local, layout = unwrap(settled(x))
    if layout is None:
        return local
    for dim in layout.dims:
        parts = layout.segments(dim)
        if parts is None:
            local = _gather_dim(local, dim, layout.factors(dim))
        else:  # token segments one after another: each gathered on its own
            pieces = local.split(layout.local_sizes(dim), dim)
            local = torch.cat([_gather_dim(q, dim, p.factors(dim)) for q, p in zip(pieces, parts)], dim)
    return local


def _gather_dim(local: torch.Tensor, dim: int, factors) -> torch.Tensor:
    pos = local.dim() + dim
    if len(factors) > 1:  # a merged dim: gather each sharded factor, then merge again in global order
        local = local.unflatten(pos, [s.stop - s.start if s else n for n, s in factors])
    for k, (n, s) in enumerate(factors):
        if s is not None:
            local = all_gather(local, pos + k, s.axis, n)
    if len(factors) > 1:
        local = local.flatten(pos, pos + len(factors) - 1)
    return local


__all__ = ["SpatialTensor", "adopt", "gather", "on_shard", "settled", "shard", "unwrap", "wrap"]
