"""Data modules for the recipes (no strategy imports): synthetic wide scenes, and surround-camera sources
(synthetic, nuScenes, packed records) that all produce the shared BEV batch (``collate_surround``)."""

<<<<<<< HEAD
from .batch import CAMERAS, CLASSES, POINT_CLOUD_RANGE, check_sample, collate_surround, normalise
from .nuscenes import NuScenes, NuScenesSurround
from .records import DEFAULT_FORMAT, PackedSurround, write_records
=======
from .folder import ImageFolderData
>>>>>>> userday
from .scenes import SyntheticScenes
from .surround import SurroundScenes, SurroundSynthetic

<<<<<<< HEAD
__all__ = [
    "CAMERAS",
    "CLASSES",
    "DEFAULT_FORMAT",
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
    "write_records",
]
=======
__all__ = ["ImageFolderData", "SyntheticScenes"]
>>>>>>> userday
