"""Data modules for the recipes (no strategy imports)."""

from .scenes import SyntheticScenes

__all__ = ["SyntheticScenes"]
