"""LightningModules for the recipes (plain modules: nothing in them knows about sharding)."""

from .image import ImageTask

__all__ = ["ImageTask"]
