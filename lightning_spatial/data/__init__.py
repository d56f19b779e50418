"""Data modules for the recipes (no strategy imports)."""

from .folder import ImageFolderData
from .scenes import SyntheticScenes

__all__ = ["ImageFolderData", "SyntheticScenes"]
