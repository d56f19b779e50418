"""Data modules for the recipes (no strategy imports): synthetic wide scenes, images from a folder, and
surround-camera sources (synthetic, nuScenes, packed records) that all produce the shared BEV batch
(``collate_surround``)."""

from .batch import ATTRIBUTES, CAMERAS, CLASSES, POINT_CLOUD_RANGE, check_sample, collate_surround, normalise
from .folder import ImageFolderData
from .loading import EpochShuffle, resumable_loader
from .nuscenes import NuScenes, NuScenesSurround
from .records import DEFAULT_FORMAT, PackedSurround, write_records
from .scenes import SyntheticScenes
from .surround import SurroundScenes, SurroundSynthetic

__all__ = [
    "ATTRIBUTES",
    "CAMERAS",
    "CLASSES",
    "DEFAULT_FORMAT",
    "EpochShuffle",
    "ImageFolderData",
    "NuScenes",
    "NuScenesSurround",
    "POINT_CLOUD_RANGE",
    "PackedSurround",
    "SurroundScenes",
    "SurroundSynthetic",
    "SyntheticScenes",
    "check_sample",
    "collate_surround",
    "normalise",
    "resumable_loader",
    "write_records",
]
