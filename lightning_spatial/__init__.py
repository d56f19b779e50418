"""lightning_spatial: spatially sharded activations for training camera models across GPUs."""

from __future__ import annotations

from . import ops
from .collectives import all_gather, all_reduce
from .halo import fetch_window
from .layout import partition
from .tensor import Axis, DimShard, Layout, LayoutError, SpatialTensor, gather, shard

ops.install()

__version__ = "0.1.0"

__all__ = [
    "Axis",
    "DimShard",
    "Layout",
    "LayoutError",
    "SpatialTensor",
    "all_gather",
    "all_reduce",
    "fetch_window",
    "gather",
    "partition",
    "shard",
]
