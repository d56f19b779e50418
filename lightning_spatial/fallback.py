"""The exact fallback for a torch function without a spatial handler: gather, run, reshard, announced.

Exact but slow: every sharded operand is gathered on every rank, the function runs on full tensors and the result
is resharded. The current run's ``fallback`` mode (``run.fallback_mode``, ``SpatialParallelStrategy(fallback=)``)
decides what is said: a ``SpatialFallbackWarning`` once per op and layer, an error before any communication, or
nothing. Messages name the op as users call it and the layer it ran in.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from . import tensor
from .layout import LayoutError
from .run import current


class SpatialFallbackWarning(UserWarning):
    """An op without a spatial handler gathered full tensors on every rank (exact, but costs memory and
    communication). Filter it, or turn it into an error, like any warning (``warnings.filterwarnings``)."""


_OURS = (__file__.rsplit("/", 1)[0], torch.__file__.rsplit("/", 1)[0])  # frames a warning should not point at


@torch.compiler.disable  # compiled code breaks its graph here and runs the fallback as eager code does
def fallback(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func`` on full tensors, resharded.

    A result with the global shape of the first sharded operand is sharded like it; anything else is
    replicated (every rank computed the same value). An op that writes into a tensor (in place, ``out=``)
    writes its local part back into a sharded target, and the whole of a replicated one.
    """
    flat, _ = tree_flatten((args, kwargs))
    operands = [t for t in flat if isinstance(t, tensor.SpatialTensor)]
    layout, shape = operands[0]._layout, operands[0]._layout.global_shape(operands[0].to_local())
    announce(func, operands)
    full_args, full_kwargs = tree_map(
        lambda t: tensor.gather(t) if isinstance(t, tensor.SpatialTensor) else t, (args, kwargs)
    )
    target, full_target = (args[0], full_args[0]) if is_inplace(func) else (kwargs.get("out"), full_kwargs.get("out"))
    with tensor._Plain():
        out = func(*full_args, **full_kwargs)
    if isinstance(target, tensor.SpatialTensor):
        return tensor.on_shard(torch.Tensor.copy_, target, target._layout.take_local(full_target))
    if isinstance(target, torch.Tensor):  # a replicated target was written whole
        return target

    def reshard(o):
        if isinstance(o, torch.Tensor) and o.shape == shape:
            return tensor.wrap(layout.take_local(o), layout)
        return o

    return tree_map(reshard, out)


def announce(func: Callable, operands: list) -> None:
    """Name the op, the layer and the bytes a fallback gathers: a warning (once per op and layer and run) or, in
    ``"error"`` mode, an error raised before any communication."""
    run = current()
    if run.fallback == "silent":
        return
    name, where = name_of(func), _where(run.module_names)
    if run.fallback == "warn" and (name, where) in run.warned:
        return
    gathered = size_text(sum(_global_bytes(t) for t in operands))
    count = f"{len(operands)} sharded operand{'s' if len(operands) > 1 else ''}"
    avoid = (
        "Exact, but it costs memory and communication. To avoid it use an op with a spatial handler (docs/ops.md), "
        "register one (lightning_spatial.register_handler), or call lightning_spatial.gather(x) where the full "
        "tensor is meant"
    )
    if run.fallback == "error":
        raise LayoutError(
            f"lightning_spatial: {name}{where} has no spatial handler, and fallbacks are errors (fallback_mode "
            f"'error'): it would gather {gathered} ({count}) on every rank and run on the full tensors. {avoid}"
        )
    warnings.warn(
        f"lightning_spatial: {name}{where} has no spatial handler; gathering {gathered} ({count}) on every rank, "
        f"running it on the full tensors and resharding the result. {avoid}; fallback_mode('error') or "
        "warnings.filterwarnings('error', category=SpatialFallbackWarning) makes it an error",
        SpatialFallbackWarning,
        stacklevel=_caller_level(),
    )
    run.warned.add((name, where))  # only once announced: a filter that raised leaves the next call to raise too


def _where(module_names: dict[int, str]) -> str:
    """The innermost registered module whose ``forward`` is on the stack (frames are only read here)."""
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in module_names:
            return f" in module '{module_names[id(owner)]}' ({type(owner).__name__})"
        frame = frame.f_back
    return ""


def _caller_level() -> int:
    """``stacklevel`` of the first frame outside lightning_spatial and torch: the user's line that ran the op."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_OURS):
        frame, level = frame.f_back, level + 1
    return level


def _global_bytes(t) -> int:
    return t.nbytes  # the global tensor's (a shard answers for it; so does a selection of rows, ops.selection)


def size_text(n: float) -> str:
    """Bytes for people: ``"3.00 MiB"``."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}"


# Where torch's builtins live -> where users call them from.
_PUBLIC = {
    "torch._C._nn": "torch.nn.functional",
    "torch._C._linalg": "torch.linalg",
    "torch._C._special": "torch.special",
    "torch._C._fft": "torch.fft",
    "torch.functional": "torch",
}


def name_of(func: Callable) -> str:
    """The name a user calls ``func`` by: ``torch.flip``, ``Tensor.sum``, ``torch.linalg.vector_norm``, ``Tensor.T``."""
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor":  # a property's getter or setter
        return f"Tensor.{owner.__name__}" + (" (assignment)" if func.__name__ == "__set__" else "")
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    module = getattr(func, "__module__", None) or ""
    if qual.startswith(("_TensorBase.", "TensorBase.")):
        return "Tensor." + qual.split(".", 1)[1]
    if qual.startswith("_VariableFunctionsClass."):
        return "torch." + qual.split(".", 1)[1]
    if module in _PUBLIC:
        public = _PUBLIC[module]
        return f"{public}.{qual.removeprefix(public.rsplit('.', 1)[-1] + '_')}"
    return f"{module}.{qual}" if module else qual


def is_inplace(func: Callable) -> bool:
    name = getattr(func, "__name__", "")
    return (
        name == "__setitem__"
        or (name.startswith("__i") and name.endswith("__"))
        or (name.endswith("_") and not name.endswith("__"))
    )


__all__ = ["SpatialFallbackWarning", "announce", "fallback", "is_inplace", "name_of", "size_text"]
