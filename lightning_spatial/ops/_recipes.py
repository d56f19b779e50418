"""Halo windows kept as recipes: autograd saves how to fetch a window again instead of the window itself.

A convolution or pooling runs on its input widened by halos, a fresh copy; autograd would keep that copy for
backward beside the input it was cut from, storing the activation twice. ``saved_as_recipe`` keeps the recipe
instead where that saves memory (docs/design.md, "Halo windows are rebuilt in backward where that saves memory").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from ..plans import planned
from ..saved import observes


class _Recipe:
    """What autograd keeps instead of a window: how to fetch it again."""

    def __init__(self, rebuild: Callable[[], torch.Tensor]):
        self.rebuild = rebuild


@contextmanager
def saved_as_recipe(window: torch.Tensor, source: torch.Tensor, rebuild: Callable[[], torch.Tensor]) -> Iterator[None]:
    """While an op runs on ``window`` (``source`` widened by halos: a fresh copy), autograd keeps the window as a
    recipe: backward fetches it again from ``source``, which stays alive as the plain op's saved input would.
    Halos cross the wire twice; the activation is stored once (a saved window beside the tensor it was cut from
    would store it twice). The rebuild runs under the backward's grad mode, so a second derivative still meets
    the halo's refusal. Outer saved-tensor hooks that only observe (our memory accounting, ``saved.observes``)
    see every other tensor; any other outer hooks (activation checkpointing, offloading) decide what is kept
    themselves, and the window is left to them. Under ``torch.compile`` the compiler's partitioner decides
    what backward keeps (it may recompute the window's copies; the messages are graph ops it keeps)."""
    if torch.compiler.is_dynamo_compiling():
        yield
        return
    fresh = window.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if not (fresh and torch.is_grad_enabled()) or (outer is not None and not observes(outer[0])):
        yield
        return
    if not _kept_anyway(source):  # the window would be its only copy: a recipe would keep as much, and refetch
        yield
        return
    outer_pack, outer_unpack = outer if outer is not None else (lambda t: t, lambda t: t)
    key = (window.data_ptr(), tuple(window.shape), window.stride())

    def pack(t: torch.Tensor):
        return _Recipe(rebuild) if (t.data_ptr(), tuple(t.shape), t.stride()) == key else outer_pack(t)

    def unpack(saved):
        return saved.rebuild() if isinstance(saved, _Recipe) else outer_unpack(saved)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _kept_anyway(t: torch.Tensor) -> bool:
    """Whether ``t`` stays alive without this op: a tensor outside the graph (a batch: its owner holds it) or
    one its producer saved for its own backward (ReLU's output, a norm's input). Otherwise (a residual sum, an
    autocast copy) keeping the window costs no more than keeping ``t``, and the recipe would only refetch."""
    fn = t.grad_fn
    while type(fn).__name__ == "AliasBackward0":  # wrap/unwrap (as_subclass) insert these: same data
        fn = fn.next_functions[0][0]
    if fn is None or type(fn).__name__ == "AccumulateGrad":
        return True
    ptr = t.data_ptr()
    return any(s.data_ptr() == ptr for s in _saved_tensors(fn))


def _saved_tensors(fn) -> Iterator[torch.Tensor]:
    if isinstance(fn, torch.autograd.function.BackwardCFunction):
        yield from fn.saved_tensors
        return
    for name in _saved_names(type(fn)):
        value = getattr(fn, name)
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, torch.Tensor):
                yield v


@planned
def _saved_names(node: type) -> tuple[str, ...]:
    """A C++ autograd node's saved-value attributes (``_saved_result``, ``_saved_self``, ...), per node type."""
    return tuple(n for n in dir(node) if n.startswith("_saved_"))


__all__ = ["saved_as_recipe"]
