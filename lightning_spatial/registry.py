"""Handlers by torch function: which function runs a torch function called on a ``SpatialTensor``, read live.

``SpatialTensor.__torch_function__`` asks this registry at every call (eager code by a dict lookup, code dynamo
traces through a slot it treats as a constant of the trace), so a handler registered, overridden or removed at any
time takes effect from the next call on; a torch function without a handler takes the exact fallback (gather, run,
reshard). Our op families register theirs in ``ops.install()``; users add handlers for functions of their own, or
replace ours, with ``register_handler``:

.. code-block:: python

    import torch
    import lightning_spatial
    from lightning_spatial import SpatialTensor


    def scale_rows(x: torch.Tensor, scale: float) -> torch.Tensor:
        if torch.overrides.has_torch_function_unary(x):  # torch's protocol: lets SpatialTensor dispatch it
            return torch.overrides.handle_torch_function(scale_rows, (x,), x, scale)
        return x * scale


    @lightning_spatial.register_handler(scale_rows)
    def scale_rows_on_shards(x: SpatialTensor, scale: float) -> SpatialTensor:
        return x * scale  # element-wise: each rank scales its own rows (the handler contract: docs/design.md)

What a handler receives, returns and may cache is the handler contract in docs/design.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Handler = Callable[..., object]

# The live table eager dispatch reads, and the same handlers by slot for traced dispatch: a slot number is a
# constant of a trace (``slot``), the handler in it is read (and guarded) by the trace.
_HANDLERS: dict[Callable, Handler] = {}
_SLOTS: list[Handler | None] = []
_SLOT_OF: dict[Callable, int] = {}


def handler_for(func: Callable) -> Handler | None:
    """The handler ``func`` dispatches to on shards now, or ``None`` (the exact fallback)."""
    return _HANDLERS.get(func)


def add_handlers(handlers: Mapping[Callable, Handler], override: bool = False) -> None:
    """Register ``func -> handler`` pairs; a function that has a handler already raises unless ``override``."""
    taken = [func for func in handlers if func in _HANDLERS and not override]
    if taken:
        names = ", ".join(_name(f) for f in taken)
        raise ValueError(f"{names} already has a spatial handler; pass override=True to replace it")
    for func, handler in handlers.items():
        if not callable(handler):
            raise TypeError(f"the handler for {_name(func)} must be callable, got {handler!r}")
        _HANDLERS[func] = handler
        if func in _SLOT_OF:
            _SLOTS[_SLOT_OF[func]] = handler
        else:
            _SLOT_OF[func] = len(_SLOTS)
            _SLOTS.append(handler)


def register_handler(*funcs: Callable, override: bool = False) -> Callable[[Handler], Handler]:
    """Decorator: the decorated function handles ``funcs`` on shards from now on.

    ``funcs`` are torch functions (``torch.nn.functional.gelu``, ``torch.Tensor.flip``) or functions of your own
    that take part in torch's ``__torch_function__`` protocol (``torch.overrides.handle_torch_function``). A
    function that has a handler (ours included) is replaced only with ``override=True``.
    """
    if not funcs:
        raise TypeError("register_handler needs the function(s) to handle: @register_handler(torch.flip)")

    def decorate(handler: Handler) -> Handler:
        add_handlers(dict.fromkeys(funcs, handler), override)
        return handler

    return decorate


def remove_handler(func: Callable) -> Handler:
    """Remove ``func``'s handler (it takes the exact fallback from now on) and return it, e.g. to put it back with
    ``register_handler(func, override=True)(handler)``."""
    if func not in _HANDLERS:
        raise KeyError(f"{_name(func)} has no spatial handler")
    _SLOTS[_SLOT_OF[func]] = None
    return _HANDLERS.pop(func)


@torch._dynamo.assume_constant_result
def slot(func: Callable) -> int:
    """``func``'s slot in ``_SLOTS`` (-1: none), looked up outside the trace: dynamo cannot hash every torch
    function that keys the table (torch 2.11)."""
    return _SLOT_OF.get(func, -1)


def traced_handler(func: Callable) -> Handler | None:
    """``func``'s handler as traced code finds it."""
    i = slot(func)
    return _SLOTS[i] if i >= 0 else None


def _name(func: Callable) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


__all__ = ["add_handlers", "handler_for", "register_handler", "remove_handler"]
