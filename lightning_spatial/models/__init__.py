"""LightningModules for the recipes (plain modules: nothing in them knows about sharding)."""

from .bev import PETR, LiftSplat, SimpleBEV
from .image import ImageTask

__all__ = ["ImageTask", "LiftSplat", "PETR", "SimpleBEV"]
