"""Activation checkpointing (``torch.utils.checkpoint``) on shards: the recomputed forward runs on shards too.

The non-reentrant checkpoint saves its inputs for backward and recomputes from them. Torch saves them as it saves
any tensor, and under a saved-tensor hook (memory accounting such as ``SpatialSummary``'s, offloading) it hands each
back as a new plain tensor: the bare local shard. The recompute would then run the block's ops on local shards
(convolutions without halos, samples without the gathered map): a different forward, which torch's checkpoint
reports as a shape mismatch when shapes differ, and which gives wrong gradients silently when they do not.
``install`` makes the checkpoint remember its inputs' layouts and give the recompute SpatialTensors again; a sum
still pending or a Selection (kinds of SpatialTensor whose data is not simply this rank's shard) is handed back as
the very object the forward read (its storage is what torch keeps anyway).

The reentrant checkpoint (``CheckpointFunction``) runs as the non-reentrant one: its backward re-enters autograd,
which leaves a replicated input's gradient as this rank's share (docs/design.md), where a Function's backward
returns the true one. The gradients are the same.
"""

from __future__ import annotations

from typing import Any

import torch.utils.checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointFunction, checkpoint

from ..tensor import SpatialTensor
from .functions import _APPLY, _rewrapped


def _layouts(args: tuple) -> tuple:
    """Per argument, what the recompute needs to see it as the forward did: a shard's layout, the object itself
    for other kinds of SpatialTensor, ``None`` for anything else."""
    return tuple((a._layout if type(a) is SpatialTensor else a) if isinstance(a, SpatialTensor) else None for a in args)


def _as_saved(unpacked: Any, saved: Any) -> Any:
    """An input as the forward saw it: ``saved`` is what ``_layouts`` kept for it."""
    if isinstance(saved, SpatialTensor):
        return saved if type(unpacked) is not type(saved) else unpacked
    return _rewrapped(unpacked, saved)


def install() -> None:
    """Keep the layouts of the checkpoint's saved inputs (idempotent). torch >= 2.14 saves them in its frame
    (``_CheckpointFrame.save_inputs`` / ``get_inputs``); earlier versions in a Function (``_NoopSaveInputs``,
    given a handler below)."""
    frame = getattr(torch_checkpoint, "_CheckpointFrame", None)
    if frame is None or not hasattr(frame, "save_inputs") or getattr(frame.save_inputs, "_keeps_layouts", False):
        return
    save, get = frame.save_inputs, frame.get_inputs

    def save_inputs(self, *args: Any) -> None:
        self._spatial_layouts = _layouts(args)
        save(self, *args)

    def get_inputs(self) -> list:
        inputs = get(self)
        layouts = getattr(self, "_spatial_layouts", ())
        return [_as_saved(a, kept) for a, kept in zip(inputs, layouts)] + inputs[len(layouts) :]

    save_inputs._keeps_layouts = True
    frame.save_inputs, frame.get_inputs = save_inputs, get_inputs


def saved_inputs(dummy: Any, kwargs: dict, *args: Any) -> Any:
    """torch < 2.14's ``_NoopSaveInputs.apply``: the checkpoint's inputs saved as torch saves them, and handed to
    the recompute with their layouts."""
    cls = torch_checkpoint._NoopSaveInputs
    out = _APPLY.__get__(None, cls)(dummy, kwargs, *args)
    ctx = out.grad_fn
    if ctx is not None:  # grad mode on: a recompute will ask for the inputs
        get, layouts = ctx.get_args, _layouts(args)

        def get_args(saved: tuple) -> list:
            kwargs, *inputs = get(saved)
            return [kwargs, *map(_as_saved, inputs, layouts)]

        ctx.get_args = get_args
    return out


def reentrant_checkpoint(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
    """``torch.utils.checkpoint(use_reentrant=True)`` on shards: the non-reentrant checkpoint (module docstring)."""
    return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)


HANDLERS: dict = {CheckpointFunction: reentrant_checkpoint}
if hasattr(torch_checkpoint, "_NoopSaveInputs"):
    HANDLERS[torch_checkpoint._NoopSaveInputs] = saved_inputs

__all__ = ["HANDLERS", "install", "reentrant_checkpoint", "saved_inputs"]
