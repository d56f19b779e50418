"""LightningModules for the recipes (plain modules: nothing in them knows about sharding)."""

from .bev import PETR, BEVFormer, LiftSplat, SimpleBEV
from .image import ImageTask

__all__ = ["BEVFormer", "ImageTask", "LiftSplat", "PETR", "SimpleBEV"]
