"""Batches to local slices: the DataLoader collate hook that cuts every image-sized tensor to this rank's
rows (before pinning and the host-to-device copy), leaving everything else replicated.

By default "the image" is the first floating-point tensor with at least 4 dims ((B, C, H, W) or
multi-camera (B, N, C, H, W)), and every tensor with at least 3 dims whose trailing two dims equal its
(H, W) is sharded, so dense targets (B, H, W) and masks follow their images. ``select(path, tensor)``
overrides the choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from .layout import Axis, LayoutError
from .tensor import shard, wrap

Select = Callable[[str, torch.Tensor], bool]


def image_size(leaves: list[tuple[str, Any]]) -> tuple[int, int]:
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim() >= 4:
            return tuple(leaf.shape[-2:])
    shapes = [f"{path}: {tuple(leaf.shape)}" for path, leaf in leaves if isinstance(leaf, torch.Tensor)]
    raise LayoutError(
        "spatial sharding found no image-sized tensor in the batch (expected a floating-point tensor with at least "
        f"4 dims, (B, C, H, W) or (B, N, C, H, W)); batch tensors: {shapes or 'none'}. Pass "
        "SpatialParallelStrategy(shard_select=...) to choose the tensors to shard"
    )


def shard_batch(batch: Any, axes: dict[int, Axis], select: Select | None = None) -> Any:
    """This rank's view of ``batch``: selected tensors become ``SpatialTensor`` shards along ``axes``."""
    if not axes:
        return batch
    flat, spec = tree_flatten_with_path(batch)
    leaves = [(keystr(path), leaf) for path, leaf in flat]
    if select is None:
        size = image_size(leaves)

        def select(path: str, t: torch.Tensor) -> bool:
            return t.dim() >= 3 and tuple(t.shape[-2:]) == size

    out = [
        _compact_shard(leaf, axes) if isinstance(leaf, torch.Tensor) and select(path, leaf) else leaf
        for path, leaf in leaves
    ]
    return tree_unflatten(out, spec)


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


__all__ = ["ShardingCollate", "image_size", "shard_batch"]
