"""What autograd saves for backward, counted: the activation memory of a step (``SpatialSummary``, the planner).

``SavedActivations`` only observes: it hands every tensor back unchanged. Ops that keep a halo window as a recipe
instead of the window (``ops._common.saved_as_recipe``) still do so under it, and it counts them as kept, since
``observes`` tells such hooks from ones that decide what is kept (activation checkpointing, offloading).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .tensor import SpatialTensor

_OBSERVERS: set[Callable] = set()  # pack functions of hooks that only observe


def observes(pack: Callable) -> bool:
    """Whether a saved-tensor pack function only observes (hands every tensor back unchanged)."""
    return pack in _OBSERVERS


class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Adds up the distinct storages that autograd saves for backward (``module``'s parameters excluded) while
    entered: ``nbytes``."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.nbytes = 0
        seen = {p.untyped_storage().data_ptr() for p in module.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            local = t.to_local() if isinstance(t, SpatialTensor) else t
            try:
                storage = local.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # storage-less tensor subclasses
                key, size = id(t), local.numel() * local.element_size()
            if key not in seen:
                seen.add(key)
                self.nbytes += size
            return t

        self._pack = pack
        super().__init__(pack, lambda t: t)

    def __enter__(self) -> SavedActivations:
        _OBSERVERS.add(self._pack)
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        _OBSERVERS.discard(self._pack)


__all__ = ["SavedActivations", "observes"]
