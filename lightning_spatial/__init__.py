"""lightning_spatial: spatially sharded activations for training camera models across GPUs.

``import lightning_spatial`` registers the ``"spatial_tp"`` and ``"horovod"`` strategies in Lightning's
StrategyRegistry, and ``"spatial_tp"`` in Fabric's (``lightning_spatial.fabric``). The building blocks under them
(layouts, halo windows, collectives) are in ``lightning_spatial.primitives``.
"""

from __future__ import annotations

from . import compiling, ops
from .callbacks import LatestCheckpoint, SpatialSummary
from .fallback import SpatialFallbackWarning
from .layout import LayoutError
from .registry import handler_for, register_handler, remove_handler
from .run import fallback_mode
from .strategies import HorovodStrategy, SpatialParallelStrategy
from .tensor import SpatialTensor, gather, shard

ops.install()
compiling.install()


def _register_strategies() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from . import fabric

    for registry, strategies in (
        (StrategyRegistry, (SpatialParallelStrategy, HorovodStrategy)),
        (STRATEGY_REGISTRY, (fabric.SpatialParallelStrategy,)),
    ):
        for strategy in strategies:
            if strategy.strategy_name not in registry:
                strategy.register_strategies(registry)


_register_strategies()

__version__ = "0.1.0"

__all__ = [
    "HorovodStrategy",
    "LatestCheckpoint",
    "LayoutError",
    "SpatialFallbackWarning",
    "SpatialParallelStrategy",
    "SpatialSummary",
    "SpatialTensor",
    "fallback_mode",
    "gather",
    "handler_for",
    "register_handler",
    "remove_handler",
    "shard",
]
