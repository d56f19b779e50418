"""Spatial x data parallel training under Lightning Fabric, for training loops of your own.

``import lightning_spatial`` (or this module) registers ``"spatial_tp"`` and ``"spatial_tp_fork"`` in Fabric's
strategy registry, beside the Trainer's: ``Fabric(strategy="spatial_tp_fork", devices=2)``, or
``Fabric(strategy=SpatialParallelStrategy(spatial_size=(2, 2)), devices=8)``. A loop:
``recipes/fabric_train.py``.
"""

from __future__ import annotations

from .strategy import SpatialParallelStrategy

__all__ = ["SpatialParallelStrategy"]
