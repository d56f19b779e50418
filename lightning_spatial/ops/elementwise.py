"""Element-wise ops run on the local shard and keep its layout.

The set is torch's own: every aten op tagged ``pointwise`` (in ``torch``, ``torch.Tensor``, ``torch.special``,
with in-place variants), the arithmetic and comparison operators, and the activations of
``torch.nn.functional``; plus ops that keep the operand's layout although aten does not tag them pointwise
(casts, ``contiguous``, fills, ``*_like`` factories). A replicated operand broadcasts along a sharded dim
(size 1) or is cut to this rank's part (full global size): ``tensor.localize``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_map

from ..fallback import fallback, is_inplace
from ..tensor import SpatialTensor, _dynamo_compiling, _Plain, adopt, on_shard, unwrap, wrap
from ._common import common_layout, localize


def _pointwise_names() -> set[str]:
    """Names of aten ops tagged pointwise (binary ``max``/``min``/``where`` overloads excluded: they share
    a name with reductions or with index-returning forms)."""
    names = set()
    for name in dir(torch.ops.aten):
        if name.startswith("_"):
            continue
        try:
            packet = getattr(torch.ops.aten, name)
            overloads = [getattr(packet, o) for o in packet.overloads()]
        except (AttributeError, RuntimeError):
            continue
        if any(torch.Tag.pointwise in o.tags for o in overloads):
            names.add(name)
    return names - {"max", "min", "where"}


def functions(names, namespaces) -> set[Callable]:
    """The torch functions of these names that exist in any of ``namespaces``."""
    return {getattr(ns, n) for n in names for ns in namespaces if hasattr(ns, n)}


_DUNDERS = [
    f"__{p}{op}__"
    for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift")
    for p in ("", "r", "i")
] + ["__neg__", "__pos__", "__abs__", "__invert__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"]

_ACTIVATIONS = [
    "relu",
    "relu_",
    "relu6",
    "gelu",
    "silu",
    "mish",
    "hardswish",
    "hardsigmoid",
    "hardtanh",
    "leaky_relu",
    "elu",
    "selu",
    "celu",
    "sigmoid",
    "tanh",
    "softplus",
    "softsign",
    "tanhshrink",
    "threshold",
    "logsigmoid",
    "glu_",
]

POINTWISE: frozenset[Callable] = frozenset(
    functions(_pointwise_names(), (torch, torch.Tensor, torch.special))
    | functions((n + "_" for n in _pointwise_names()), (torch.Tensor,))
    | functions(_DUNDERS, (torch.Tensor,))
    | functions(_ACTIVATIONS, (torch.nn.functional,))
)

# Results keep the operand's layout although aten does not tag these pointwise (casts, views of the same
# elements, composites of pointwise ops, fills, copies, ``*_like`` factories).
LAYOUT_PRESERVING: frozenset[Callable] = frozenset(
    functions(
        [
            "contiguous",
            "detach",
            "detach_",
            "float",
            "double",
            "half",
            "bfloat16",
            "long",
            "int",
            "short",
            "bool",
            "char",
            "byte",
            "cfloat",
            "cdouble",
            "cpu",
            "cuda",
            "pin_memory",
            "share_memory_",
            "conj",
            "resolve_conj",
            "resolve_neg",
            "negative",
            "negative_",
            "real",
            "imag",
            "isreal",
            "isclose",
            "float_power",
            "float_power_",
            "complex",
            "polar",
            "zero_",
            "fill_",
            "requires_grad_",
            "zeros_like",
            "ones_like",
            "full_like",
            "empty_like",
            "masked_fill_",
        ],
        (torch, torch.Tensor),
    )
)


def elementwise(func: Callable) -> Callable:
    """``func`` on the local shards, replicated operands localized; results keep the common layout.

    An in-place op on a *replicated* tensor (``y.add_(x)``, ``out=y``) with a sharded operand must write the
    whole of ``y`` on every rank, so it takes the exact fallback rather than updating this rank's rows."""
    inplace = is_inplace(func)

    def run(*args, **kwargs):
        # The common calls of eager code, on the host path of every activation: one or two positional operands, the
        # first a shard, options by keyword (``gelu(x)``, ``nn.GELU``'s ``approximate=``, ``x + y``, ``x * scale``).
        if 0 < len(args) <= 2 and type(args[0]) is SpatialTensor and not _dynamo_compiling():
            if not kwargs or not _tensor_in(kwargs):
                layout = args[0]._layout
                if len(args) == 2:
                    other = args[1]
                    if type(other) is SpatialTensor:
                        if other._layout is not layout and other._layout != layout:
                            return general(args, kwargs)  # one broadcasts against the other, or it raises
                    elif isinstance(other, torch.Tensor):
                        args = (args[0], localize(func, other, layout))
                with _Plain():
                    out = func(*args, **kwargs) if kwargs else func(*args)
                if type(out) is torch.Tensor and out is not args[-1]:  # computed here: no operand returned
                    return adopt(out, layout)
                return _result(out, args, layout)
        return general(args, kwargs)

    def general(args, kwargs):
        if (inplace and not isinstance(args[0], SpatialTensor)) or (
            kwargs and isinstance(kwargs.get("out"), torch.Tensor) and not isinstance(kwargs["out"], SpatialTensor)
        ):
            return fallback(func, args, kwargs)
        layout = common_layout(func, [*args, *kwargs.values()])
        args = [localize(func, a, layout) for a in args]
        if kwargs:
            kwargs = {k: localize(func, v, layout) for k, v in kwargs.items()}
        return _result(on_shard(func, *args, **kwargs), args, layout)

    return run


def _tensor_in(kwargs: dict) -> bool:
    for value in kwargs.values():  # a loop: a generator expression costs more than the check on this path
        if isinstance(value, torch.Tensor):
            return True
    return False


def _result(out, operands, layout):
    """``out`` with ``layout``: an operand returned as it is (in-place, or ``x.float()`` of a float x) keeps its
    class; a result computed here becomes the shard itself (``adopt``)."""
    for a in operands:
        if out is a:
            return out if isinstance(a, SpatialTensor) else wrap(out, layout)
    if type(out) is torch.Tensor:  # the common case, without a pytree walk
        return adopt(out, layout)
    return tree_map(lambda o: wrap(o, layout) if isinstance(o, torch.Tensor) else o, out)


def where(*args, **kwargs):
    """``torch.where(cond, x, y)`` is element-wise; ``torch.where(cond)`` returns global indices: fallback."""
    if len(args) + len(kwargs) == 1:
        return fallback(torch.where, args, kwargs)
    return _where(*args, **kwargs)


_where = elementwise(torch.where)


def _conversion(func: Callable) -> Callable:
    """``t.to(x)``/``t.type_as(x)``: only ``t`` is converted; a sharded ``x`` merely names a dtype and device."""

    def convert(input, *args, **kwargs):
        local, layout = unwrap(input)
        args = [a.to_local() if isinstance(a, SpatialTensor) else a for a in args]
        kwargs = {k: v.to_local() if isinstance(v, SpatialTensor) else v for k, v in kwargs.items()}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(local, *args, **kwargs)
        return wrap(out, layout) if isinstance(out, torch.Tensor) else out  # ``x.type()`` is a string

    return convert


_copy = elementwise(torch.Tensor.copy_)


def copy(target, src, non_blocking: bool = False):
    """``target.copy_(src)`` is element-wise (a replicated ``src`` broadcast or cut to this rank's part), and a plain
    ``src`` of exactly the shard's shape, where that is not the target's global shape, is written into the shard as
    it is: that is how aot_autograd's runtime hands a compiled graph's result back to a shard the graph mutated
    (torch 2.11 does it outside the graph). Single-device code cannot give such a source: its size would not
    broadcast to the global shape."""
    if type(target) is SpatialTensor and type(src) is torch.Tensor:
        with _Plain():
            local = target.shape
        if src.shape == local and local != target.shape:
            return on_shard(torch.Tensor.copy_, target, src, non_blocking)
    return _copy(target, src, non_blocking)


def on_the_storage(func: Callable) -> Callable:
    """``set_``/``as_strided_`` act on the shard's own storage and sizes (aot_autograd's runtime sets a shard's
    metadata so after a compiled graph changed it); the layout stays."""

    def run(input, *args, **kwargs):
        return on_shard(func, input, *args, **kwargs)

    return run


def _registrations() -> dict:
    handlers = {f: elementwise(f) for f in POINTWISE | LAYOUT_PRESERVING}
    handlers[torch.Tensor.copy_] = copy
    handlers.update({f: on_the_storage(f) for f in (torch.Tensor.set_, torch.Tensor.as_strided_)})
    handlers[torch.where] = handlers[torch.Tensor.where] = where
    handlers.update({f: _conversion(f) for f in (torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.type)})
    return handlers


HANDLERS = _registrations()

__all__ = ["HANDLERS", "LAYOUT_PRESERVING", "POINTWISE", "elementwise", "functions"]
