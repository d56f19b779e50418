"""nuScenes reader: the devkit's JSON tables and ``samples/CAM_*`` images -> the shared surround batch.

Point ``root`` at a copy laid out as the devkit expects (``root/v1.0-mini/*.json``, ``root/samples/CAM_*``);
the devkit itself is not needed. Per key-frame sample:

- the ego frame is the ego pose at the sample's LIDAR_TOP key frame (CAM_FRONT's when there is no lidar);
  each camera's own ego pose (its timestamp differs by a few ms) goes into its ``cam2ego``;
- images are resized to ``height x width`` with the intrinsics scaled to match (pixel-centre exact);
- annotations map to the ten detection classes as the devkit's ``category_to_detection_name`` does; boxes
  without lidar or radar points are dropped (the devkit's ground-truth filter), as are boxes whose centre is
  outside the point-cloud range; global positions, yaws and velocities are turned into the ego frame;
- velocity is the devkit's ``box_velocity`` (centred difference over the neighbouring annotations, at most
  1.5 s apart per step); where it is undefined (a lone annotation) it is 0, as mmdetection3d stores it;
- ``temporal=True`` adds the previous key frame (0.5 s earlier; the first sample of a scene reuses itself)
  with ``prev_lidar2img`` from the current ego frame.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import Dataset

from .batch import CAMERAS, CLASSES, POINT_CLOUD_RANGE, check_sample
from .datamodule import SurroundDataModule
from .geometry import projection, quaternion_matrix, rigid, rigid_inverse, scale_intrinsics
from .records import DEFAULT_FORMAT

# Table -> the fields this reader uses (checked on load so a broken export names its file and field).
TABLES = {
    "scene": ("token", "name"),
    "sample": ("token", "timestamp", "scene_token", "prev"),
    "sample_data": (
        "token",
        "sample_token",
        "ego_pose_token",
        "calibrated_sensor_token",
        "filename",
        "width",
        "height",
        "is_key_frame",
    ),
    "calibrated_sensor": ("token", "sensor_token", "translation", "rotation", "camera_intrinsic"),
    "sensor": ("token", "channel"),
    "ego_pose": ("token", "translation", "rotation"),
    "sample_annotation": (
        "token",
        "sample_token",
        "instance_token",
        "translation",
        "size",
        "rotation",
        "prev",
        "next",
        "num_lidar_pts",
        "num_radar_pts",
    ),
    "instance": ("token", "category_token"),
    "category": ("token", "name"),
}
DETECTION_NAME = {
    "movable_object.barrier": "barrier",
    "vehicle.bicycle": "bicycle",
    "vehicle.bus.bendy": "bus",
    "vehicle.bus.rigid": "bus",
    "vehicle.car": "car",
    "vehicle.construction": "construction_vehicle",
    "vehicle.motorcycle": "motorcycle",
    "human.pedestrian.adult": "pedestrian",
    "human.pedestrian.child": "pedestrian",
    "human.pedestrian.construction_worker": "pedestrian",
    "human.pedestrian.police_officer": "pedestrian",
    "movable_object.trafficcone": "traffic_cone",
    "vehicle.trailer": "trailer",
    "vehicle.truck": "truck",
}
MINI_SPLITS = {
    "train": (
        "scene-0061",
        "scene-0553",
        "scene-0655",
        "scene-0757",
        "scene-0796",
        "scene-1077",
        "scene-1094",
        "scene-1100",
    ),
    "val": ("scene-0103", "scene-0916"),
}
MAX_TIME_DIFF = 1.5  # seconds between neighbouring annotations for a velocity (the devkit's default)


def load_tables(root, version: str) -> dict[str, dict[str, dict]]:
    """Each table as {token: record}; a missing table file or field raises naming it."""
    folder = Path(root) / version
    tables = {}
    for name, fields in TABLES.items():
        path = folder / f"{name}.json"
        if not path.exists():
            raise FileNotFoundError(f"nuScenes table missing: {path} (a {version} folder holds {sorted(TABLES)}.json)")
        records = json.loads(path.read_text())
        for record in records:
            missing = [f for f in fields if f not in record]
            if missing:
                raise ValueError(f"{path}: record {record.get('token', '?')} lacks field(s) {missing}")
        tables[name] = {record["token"]: record for record in records}
    return tables


class NuScenesSurround(Dataset):
    """Key-frame samples of the scenes named in ``scenes`` (all when None), in scene and time order."""

    def __init__(
        self,
        root,
        version: str = "v1.0-mini",
        height: int = 256,
        width: int = 704,
        cameras: Sequence[str] = CAMERAS,
        scenes: Sequence[str] | None = None,
        temporal: bool = False,
        pc_range: Sequence[float] = POINT_CLOUD_RANGE,
        tables: dict | None = None,
    ):
        """``tables`` (from ``load_tables``) lets several splits share one load of the JSON."""
        self.root, self.version, self.size, self.cameras = Path(root), version, (height, width), tuple(cameras)
        self.temporal, self.pc_range = temporal, tuple(pc_range)
        t = self.tables = tables or load_tables(root, version)
        self.where = {name: self.root / version / f"{name}.json" for name in TABLES}
        names = {s["name"] for s in t["scene"].values()}
        if scenes is not None and set(scenes) - names:
            raise ValueError(f"{self.where['scene']}: no scene(s) {sorted(set(scenes) - names)}")
        wanted = {tok for tok, s in t["scene"].items() if scenes is None or s["name"] in scenes}
        self.scenes = sorted(t["scene"][tok]["name"] for tok in wanted)
        self.tokens = [
            tok
            for tok, s in sorted(t["sample"].items(), key=lambda i: (i[1]["scene_token"], i[1]["timestamp"]))
            if s["scene_token"] in wanted
        ]
        self.key_frames: dict[str, dict[str, dict]] = defaultdict(dict)  # sample -> channel -> sample_data
        for sd in t["sample_data"].values():
            if sd["is_key_frame"]:
                sensor = t["sensor"][t["calibrated_sensor"][sd["calibrated_sensor_token"]]["sensor_token"]]
                self.key_frames[sd["sample_token"]][sensor["channel"]] = sd
        self.annotations: dict[str, list[dict]] = defaultdict(list)
        for ann in t["sample_annotation"].values():
            self.annotations[ann["sample_token"]].append(ann)

    def describe(self) -> dict:
        """Every setting that changes the samples (a records folder's identity)."""
        h, w = self.size
        return {
            "source": "NuScenesSurround",
            "root": str(self.root.resolve()),
            "version": self.version,
            "scenes": self.scenes,
            "samples": len(self),
            "cameras": list(self.cameras),
            "height": h,
            "width": w,
            "temporal": self.temporal,
            "pc_range": list(self.pc_range),
        }

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        token = self.tokens[index]
        frames = self.key_frames[token]
        reference = frames.get("LIDAR_TOP") or frames.get("CAM_FRONT")
        if reference is None:
            raise ValueError(f"{self.where['sample_data']}: sample {token} has no LIDAR_TOP or CAM_FRONT key frame")
        ego2global = self._pose(reference["ego_pose_token"])
        images, intrinsics, cam2ego = self._cameras(token, ego2global)
        boxes, labels = self._boxes(token, ego2global)
        sample = {
            "images": images,
            "lidar2img": projection(intrinsics, cam2ego),
            "intrinsics": intrinsics,
            "cam2ego": cam2ego,
            "boxes": boxes,
            "labels": labels,
        }
        if self.temporal:
            previous = self.tables["sample"][token]["prev"] or token
            prev_images, prev_intrinsics, prev_cam2ego = self._cameras(previous, ego2global)
            sample["prev_images"], sample["prev_lidar2img"] = prev_images, projection(prev_intrinsics, prev_cam2ego)
        return check_sample(sample, f"nuScenes sample {token} ({self.root})", self.size, len(self.cameras))

    def _pose(self, token: str) -> torch.Tensor:
        pose = self.tables["ego_pose"][token]
        return rigid(quaternion_matrix(pose["rotation"]), pose["translation"])

    def _cameras(self, token: str, ego2global: torch.Tensor):
        """uint8 images (N, 3, H, W), intrinsics (N, 3, 3) and cam2ego (N, 4, 4) into the frame of ``ego2global``."""
        frames, global2ego = self.key_frames[token], rigid_inverse(ego2global)
        images, intrinsics, cam2ego = [], [], []
        for channel in self.cameras:
            if channel not in frames:
                have = sorted(c for c in frames if c.startswith("CAM"))
                raise ValueError(
                    f"{self.where['sample_data']}: sample {token} has no {channel} key frame "
                    f"(it has {have}); pass cameras= with those"
                )
            sd = frames[channel]
            calibration = self.tables["calibrated_sensor"][sd["calibrated_sensor_token"]]
            if len(calibration["camera_intrinsic"]) != 3:
                raise ValueError(
                    f"{self.where['calibrated_sensor']}: {calibration['token']} ({channel}) has no 3x3 camera_intrinsic"
                )
            sensor2ego = rigid(quaternion_matrix(calibration["rotation"]), calibration["translation"])
            cam2ego.append(global2ego @ self._pose(sd["ego_pose_token"]) @ sensor2ego)
            calibrated = (sd["height"], sd["width"])
            intrinsics.append(
                scale_intrinsics(
                    torch.tensor(calibration["camera_intrinsic"], dtype=torch.float64), calibrated, self.size
                )
            )
            images.append(self._image(self.root / sd["filename"], calibrated))
        return torch.stack(images), torch.stack(intrinsics).float(), torch.stack(cam2ego).float()

    def _image(self, path: Path, calibrated: tuple[int, int]) -> torch.Tensor:
        with Image.open(path) as image:
            if image.size != calibrated[::-1]:
                raise ValueError(
                    f"{path}: image is {image.size[1]}x{image.size[0]} (HxW) but sample_data calibrates "
                    f"{calibrated[0]}x{calibrated[1]}"
                )
            image = image.convert("RGB").resize(self.size[::-1], Image.Resampling.BILINEAR)
        return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(*self.size, 3).permute(2, 0, 1)

    def _boxes(self, token: str, ego2global: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, global2ego = self.tables, rigid_inverse(ego2global)
        rows, labels = [], []
        for ann in self.annotations[token]:
            category = t["category"][t["instance"][ann["instance_token"]]["category_token"]]["name"]
            name = DETECTION_NAME.get(category)
            if name is None or ann["num_lidar_pts"] + ann["num_radar_pts"] == 0:
                continue
            for field in ("translation", "size", "rotation"):  # before the range filter drops a NaN silently
                if not all(map(math.isfinite, ann[field])):
                    raise ValueError(
                        f"{self.where['sample_annotation']}: annotation {ann['token']} (sample {token}) "
                        f"has a non-finite {field} {ann[field]}"
                    )
            centre = global2ego[:3, :3] @ torch.tensor(ann["translation"], dtype=torch.float64) + global2ego[:3, 3]
            heading = global2ego[:3, :3] @ quaternion_matrix(ann["rotation"])[:, 0]
            velocity = global2ego[:3, :3] @ self._velocity(ann)
            rows.append([*centre.tolist(), *ann["size"], math.atan2(heading[1], heading[0]), *velocity[:2].tolist()])
            labels.append(CLASSES.index(name))
        boxes = torch.tensor(rows, dtype=torch.float32).reshape(-1, 9)
        low, high = torch.tensor(self.pc_range[:3]), torch.tensor(self.pc_range[3:])
        keep = ((boxes[:, :3] >= low) & (boxes[:, :3] <= high)).all(1)
        return boxes[keep], torch.tensor(labels, dtype=torch.int64)[keep]

    def _velocity(self, ann: dict) -> torch.Tensor:
        """Global velocity (3,) from the neighbouring annotations of the same instance (the devkit's rule)."""
        anns, samples = self.tables["sample_annotation"], self.tables["sample"]
        first = anns[ann["prev"]] if ann["prev"] else ann
        last = anns[ann["next"]] if ann["next"] else ann
        seconds = 1e-6 * (samples[last["sample_token"]]["timestamp"] - samples[first["sample_token"]]["timestamp"])
        steps = bool(ann["prev"]) + bool(ann["next"])
        if steps == 0 or seconds > MAX_TIME_DIFF * steps:
            return torch.zeros(3, dtype=torch.float64)
        return (torch.tensor(last["translation"]) - torch.tensor(first["translation"])).double() / seconds


class NuScenes(SurroundDataModule):
    """Train/val splits of ``NuScenesSurround`` by scene name (v1.0-mini defaults to the devkit's mini split;
    other versions need ``train_scenes``/``val_scenes``, e.g. the devkit's ``nuscenes.utils.splits``)."""

    def __init__(
        self,
        root: str,
        version: str = "v1.0-mini",
        height: int = 256,
        width: int = 704,
        cameras: Sequence[str] = CAMERAS,
        temporal: bool = False,
        batch_size: int = 2,
        num_workers: int = 0,
        train_scenes: Sequence[str] | None = None,
        val_scenes: Sequence[str] | None = None,
        records_dir: str | None = None,
        records_format: str = DEFAULT_FORMAT,
    ):
        super().__init__()
        if (train_scenes is None or val_scenes is None) and version != "v1.0-mini":
            raise ValueError(
                f"NuScenes({version!r}) needs train_scenes and val_scenes (scene names); only "
                "v1.0-mini has a built-in split"
            )
        self.save_hyperparameters()

    def datasets(self) -> tuple[NuScenesSurround, NuScenesSurround]:
        h = self.hparams
        if getattr(self, "_datasets", None) is None:  # the JSON tables load once for both splits
            tables = load_tables(h.root, h.version)
            self._datasets = tuple(
                NuScenesSurround(h.root, h.version, h.height, h.width, h.cameras, scenes, h.temporal, tables=tables)
                for scenes in (h.train_scenes or MINI_SPLITS["train"], h.val_scenes or MINI_SPLITS["val"])
            )
        return self._datasets


__all__ = ["DETECTION_NAME", "MINI_SPLITS", "NuScenes", "NuScenesSurround", "load_tables"]
