"""lightning_spatial: spatially sharded activations for training camera models across GPUs.

``import lightning_spatial`` registers the ``"spatial_tp"`` and ``"horovod"`` strategies in Lightning's
StrategyRegistry.
"""

from __future__ import annotations

from . import compiling, ops
from .callbacks import LatestCheckpoint, SpatialSummary
from .collectives import all_gather, all_reduce
from .halo import fetch_window
from .layout import Axis, DimShard, Layout, LayoutError, partition
from .mesh import SpatialDims
from .sharding import shard_batch
from .strategies import HorovodStrategy, SpatialParallelStrategy
from .tensor import SpatialFallbackWarning, SpatialTensor, fallback_mode, gather, shard

ops.install()
compiling.install()


def _register_strategies() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for strategy in (SpatialParallelStrategy, HorovodStrategy):
        if strategy.strategy_name not in StrategyRegistry:
            strategy.register_strategies(StrategyRegistry)


_register_strategies()

__version__ = "0.1.0"

__all__ = [
    "Axis",
    "DimShard",
    "HorovodStrategy",
    "LatestCheckpoint",
    "Layout",
    "LayoutError",
    "SpatialDims",
    "SpatialFallbackWarning",
    "SpatialParallelStrategy",
    "SpatialSummary",
    "SpatialTensor",
    "all_gather",
    "all_reduce",
    "fallback_mode",
    "fetch_window",
    "gather",
    "partition",
    "shard",
    "shard_batch",
]
