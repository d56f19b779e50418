"""Metrics for the recipes (no strategy imports)."""

from .nuscenes import NuScenesDetection

__all__ = ["NuScenesDetection"]
