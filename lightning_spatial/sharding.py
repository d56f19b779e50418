"""Batches to local slices: the DataLoader collate hook that cuts every image-sized tensor to this rank's
rows (before pinning and the host-to-device copy), leaving everything else replicated.

By default "the image" is the batch entry named ``image`` or ``images`` if there is one, else the image-like
tensor (at least 4 dims, (B, C, H, W) or multi-camera (B, N, C, H, W); floating point or uint8) with the
largest H x W: camera matrices (B, N, 3, 3) beside (B, N, 3, H, W) images never win. Every tensor with at
least 3 dims whose trailing two dims equal the image's (H, W) is sharded, so dense targets (B, H, W) and masks
follow their images. ``select(path, tensor)`` overrides the choice. The strategy logs once which tensors were
sharded (``describe``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves_with_path, tree_unflatten

from .layout import LayoutError
from .mesh import Axis
from .tensor import SpatialTensor, shard, wrap

Select = Callable[[str, torch.Tensor], bool]

IMAGE_KEYS = ("image", "images")


def image_size(leaves: list[tuple[tuple, Any]]) -> tuple[int, int]:
    """The (H, W) of the batch's image: see the module docstring. ``leaves`` are (pytree path, leaf) pairs."""
    images = [(path, t) for path, t in leaves if _image_like(t)]
    named = [t for path, t in images if path and getattr(path[-1], "key", None) in IMAGE_KEYS]
    if named:
        return tuple(named[0].shape[-2:])
    if images:
        return tuple(max((t for _, t in images), key=lambda t: t.shape[-2] * t.shape[-1]).shape[-2:])
    shapes = [f"{keystr(path)}: {tuple(leaf.shape)}" for path, leaf in leaves if isinstance(leaf, torch.Tensor)]
    raise LayoutError(
        "spatial sharding found no image-sized tensor in the batch (expected a floating-point or uint8 tensor with "
        f"at least 4 dims, (B, C, H, W) or (B, N, C, H, W)); batch tensors: {shapes or 'none'}. Pass "
        "SpatialParallelStrategy(shard_select=...) to choose the tensors to shard"
    )


def _image_like(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 4 and (t.is_floating_point() or t.dtype == torch.uint8)


def shard_batch(batch: Any, axes: dict[int, Axis], select: Select | None = None) -> Any:
    """This rank's view of ``batch``: selected tensors become ``SpatialTensor`` shards along ``axes``."""
    if not axes:
        return batch
    flat, spec = tree_flatten_with_path(batch)
    if select is None:
        size = image_size(flat)

        def select(path: str, t: torch.Tensor) -> bool:
            return t.dim() >= 3 and tuple(t.shape[-2:]) == size

    out = [
        _compact_shard(leaf, axes) if isinstance(leaf, torch.Tensor) and select(keystr(path), leaf) else leaf
        for path, leaf in flat
    ]
    return tree_unflatten(out, spec)


def describe(batch: Any) -> str:
    """Which batch tensors are sharded (global shapes) and which stay replicated, for a one-time log line."""
    tensors = [(keystr(path), t) for path, t in tree_leaves_with_path(batch) if isinstance(t, torch.Tensor)]
    sharded = [f"{path} {tuple(t.shape)}" for path, t in tensors if isinstance(t, SpatialTensor)]
    replicated = [f"{path} {tuple(t.shape)}" for path, t in tensors if not isinstance(t, SpatialTensor)]
    return f"sharded batch tensors: {', '.join(sharded) or 'none'}; replicated: {', '.join(replicated) or 'none'}"


def _compact_shard(t: torch.Tensor, axes: dict[int, Axis]) -> torch.Tensor:
    """A shard that owns its memory: pinning, worker transfer and the device copy move 1/S of the tensor."""
    view = shard(t, axes)
    return wrap(view.to_local().clone(), view.shard_layout)


@dataclass
class ShardingCollate:
    """Wraps a DataLoader's ``collate_fn``: collate as usual, then keep this rank's slices (picklable)."""

    collate_fn: Callable
    axes: dict[int, Axis]
    select: Select | None = None

    def __call__(self, samples):
        return shard_batch(self.collate_fn(samples), self.axes, self.select)


__all__ = ["IMAGE_KEYS", "ShardingCollate", "describe", "image_size", "shard_batch"]
