"""A nuScenes-format folder built record by record: every table the devkit's ``NuScenes`` loads, solid-colour
JPEGs for the camera key frames (one colour per camera) and a blank map, so that both our reader and the
devkit read what a test writes."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from PIL import Image

from lightning_spatial.data import ATTRIBUTES, CAMERAS

FRONT = [0.5, -0.5, 0.5, -0.5]  # camera x right, y down, z forward -> ego (x forward, y left, z up)
COLOURS = {name: (40 * i + 20, 200 - 30 * i, 90) for i, name in enumerate(CAMERAS)}
TABLES = ("attribute", "calibrated_sensor", "category", "ego_pose", "instance", "log", "map", "sample",
          "sample_annotation", "sample_data", "scene", "sensor", "visibility")  # fmt: skip


def yaw_quaternion(yaw: float) -> list[float]:
    """(w, x, y, z) of a rotation by ``yaw`` about +z."""
    return [math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2)]


class NuScenesFolder:
    """Cameras share one calibration (1.5 m ahead of and above the ego origin, looking along +x); the lidar sits
    at (0.9, 0, 1.8). Each sample has key frames of every camera and of the lidar."""

    def __init__(self, cameras: Sequence[str] = CAMERAS, image_size: tuple[int, int] = (90, 160)):
        self.cameras, self.image_size = tuple(cameras), image_size
        self.tables = {name: [] for name in TABLES}
        self.tables["log"].append({"token": "log0", "logfile": "", "vehicle": "", "date_captured": "", "location": ""})
        self.tables["map"].append({"token": "map0", "log_tokens": ["log0"], "category": "", "filename": "maps/0.png"})
        self.tables["visibility"].append({"token": "4", "level": "v80-100", "description": ""})
        self.tables["attribute"] += [{"token": f"attr-{a}", "name": a, "description": ""} for a in ATTRIBUTES]
        for channel in (*self.cameras, "LIDAR_TOP"):
            camera = channel != "LIDAR_TOP"
            self.tables["sensor"].append(
                {"token": f"sensor-{channel}", "channel": channel, "modality": "camera" if camera else "lidar"}
            )
            self.tables["calibrated_sensor"].append(
                {"token": f"cs-{channel}", "sensor_token": f"sensor-{channel}",
                 "translation": [1.5, 0.0, 1.5] if camera else [0.9, 0.0, 1.8],
                 "rotation": FRONT if camera else [1, 0, 0, 0],
                 "camera_intrinsic": [[100.0, 0.0, 80.0], [0.0, 100.0, 45.0], [0.0, 0.0, 1.0]] if camera else []}
            )  # fmt: skip
        self.images: list[tuple[str, str]] = []  # (filename, channel)

    def scene(self, token: str, name: str, samples: Sequence[tuple[str, int, dict, dict]]) -> None:
        """A scene of key-frame samples (token, timestamp in us, lidar ego pose, camera ego pose), each pose a
        dict with ``translation`` and ``rotation``."""
        tokens = [s[0] for s in samples]
        self.tables["scene"].append({"token": token, "name": name, "log_token": "log0", "description": "",
                                     "nbr_samples": len(samples), "first_sample_token": tokens[0],
                                     "last_sample_token": tokens[-1]})  # fmt: skip
        for k, (sample, timestamp, lidar_pose, camera_pose) in enumerate(samples):
            self.tables["sample"].append({"token": sample, "timestamp": timestamp, "scene_token": token,
                                          "prev": tokens[k - 1] if k else "",
                                          "next": tokens[k + 1] if k + 1 < len(tokens) else ""})  # fmt: skip
            for kind, pose in (("lidar", lidar_pose), ("cam", camera_pose)):
                self.tables["ego_pose"].append({"token": f"ego-{kind}-{sample}", "timestamp": timestamp, **pose})
            for channel in (*self.cameras, "LIDAR_TOP"):
                camera = channel != "LIDAR_TOP"
                filename = f"samples/{channel}/{sample}.jpg" if camera else f"samples/LIDAR_TOP/{sample}.pcd.bin"
                self.tables["sample_data"].append(
                    {"token": f"sd-{sample}-{channel}", "sample_token": sample, "timestamp": timestamp,
                     "calibrated_sensor_token": f"cs-{channel}", "is_key_frame": True, "filename": filename,
                     "ego_pose_token": f"ego-cam-{sample}" if camera else f"ego-lidar-{sample}",
                     "fileformat": "jpg" if camera else "pcd", "height": self.image_size[0] if camera else 0,
                     "width": self.image_size[1] if camera else 0, "prev": "", "next": ""}
                )  # fmt: skip
                if camera:
                    self.images.append((filename, channel))

    def instance(self, token: str, category: str) -> str:
        if not any(c["name"] == category for c in self.tables["category"]):
            self.tables["category"].append({"token": f"cat-{category}", "name": category, "description": ""})
        self.tables["instance"].append({"token": token, "category_token": f"cat-{category}", "nbr_annotations": 0})
        return token

    def annotation(self, token, sample, instance, translation, size, rotation, lidar=10, radar=0, attribute=None):
        """One box in the global frame; ``attribute`` a name from ATTRIBUTES or None."""
        self.tables["sample_annotation"].append(
            {"token": token, "sample_token": sample, "instance_token": instance, "visibility_token": "4",
             "attribute_tokens": [] if attribute is None else [f"attr-{attribute}"],
             "translation": list(translation), "size": list(size), "rotation": list(rotation), "prev": "",
             "next": "", "num_lidar_pts": lidar, "num_radar_pts": radar}
        )  # fmt: skip
        return self.tables["sample_annotation"][-1]

    def track(self, annotations: Sequence[dict]) -> None:
        """Link an instance's annotations (in time order) through ``prev``/``next``."""
        for earlier, later in zip(annotations, annotations[1:]):
            earlier["next"], later["prev"] = later["token"], earlier["token"]

    def write(self, root: Path, version: str = "v1.0-mini") -> Path:
        (root / version).mkdir(parents=True)
        for name, records in self.tables.items():
            (root / version / f"{name}.json").write_text(json.dumps(records))
        for filename, channel in self.images:
            (root / filename).parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", self.image_size[::-1], COLOURS[channel]).save(root / filename, quality=95)
        (root / "maps").mkdir()
        Image.new("L", (4, 4)).save(root / "maps" / "0.png")
        return root
