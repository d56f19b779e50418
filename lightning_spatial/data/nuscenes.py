"""nuScenes reader: the devkit's JSON tables and ``samples/CAM_*`` images -> the shared surround batch.

Point ``root`` at a copy laid out as the devkit expects (``root/v1.0-mini/*.json``, ``root/samples/CAM_*``);
the devkit itself is not needed. Per key-frame sample it performs the ground-truth side of the devkit's
``load_gt`` and the box-level part of ``filter_eval_boxes`` (docs/data.md lists each step):

- the ego frame is the ego pose at the sample's LIDAR_TOP key frame (CAM_FRONT's when there is no lidar),
  gravity-aligned: its translation and its yaw, no pitch or roll, so that x-y distances, yaws and velocities
  are the devkit's global x-y ones turned about z; each camera's own full ego pose (its timestamp differs by a
  few ms) goes into its ``cam2ego``;
- images are resized to ``height x width`` with the intrinsics scaled to match (pixel-centre exact);
- annotations map to the ten detection classes as the devkit's ``category_to_detection_name`` does; boxes
  without lidar or radar points are dropped (the devkit's ground-truth filter), as are boxes whose centre is
  outside the point-cloud range in x or y (the default range holds every class range of the metric);
- velocity is the devkit's ``box_velocity`` (centred difference over the neighbouring annotations, at most
  1.5 s apart per step), NaN where it is undefined (a lone annotation or too long a gap), as the devkit has it;
- ``attributes``: an annotation's single attribute, -1 if it has none (the devkit's ``load_gt``);
- ``ignore_regions``: the sample's bike racks, in which the metric drops bicycles and motorcycles;
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

from .._arguments import integers
from .batch import ATTRIBUTES, CAMERAS, CLASSES, POINT_CLOUD_RANGE, check_sample
from .datamodule import SurroundDataModule
from .geometry import gravity_aligned, projection, quaternion_matrix, rigid, rigid_inverse, scale_intrinsics
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
        "attribute_tokens",
    ),
    "instance": ("token", "category_token"),
    "category": ("token", "name"),
    "attribute": ("token", "name"),
}
# Table -> field -> the table its token (or list of tokens) points at; "" points at nothing.
REFERENCES = {
    "sample": {"scene_token": "scene", "prev": "sample"},
    "sample_data": {
        "sample_token": "sample",
        "ego_pose_token": "ego_pose",
        "calibrated_sensor_token": "calibrated_sensor",
    },
    "calibrated_sensor": {"sensor_token": "sensor"},
    "sample_annotation": {
        "sample_token": "sample",
        "instance_token": "instance",
        "prev": "sample_annotation",
        "next": "sample_annotation",
        "attribute_tokens": "attribute",
    },
    "instance": {"category_token": "category"},
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
BIKE_RACK = "static_object.bicycle_rack"  # the devkit's filter_eval_boxes drops bicycles and motorcycles in these
MAX_TIME_DIFF = 1.5  # seconds between neighbouring annotations for a velocity (the devkit's default)


def load_tables(root, version: str) -> dict[str, dict[str, dict]]:
    """Each table as {token: record}; a missing or corrupt table file, a missing field or a token pointing at
    no record raises naming the file (and the record)."""
    folder = Path(root) / version
    tables = {}
    for name, fields in TABLES.items():
        path = folder / f"{name}.json"
        if not path.exists():
            raise FileNotFoundError(f"nuScenes table missing: {path} (a {version} folder holds {sorted(TABLES)}.json)")
        try:
            records = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error}); restore it from the nuScenes download") from error
        if not isinstance(records, list):
            raise ValueError(f"{path}: expected a JSON list of records, got {type(records).__name__}")
        for record in records:
            missing = [f for f in fields if f not in record]
            if missing:
                raise ValueError(f"{path}: record {record.get('token', '?')} lacks field(s) {missing}")
        tables[name] = {record["token"]: record for record in records}
    for name, fields in REFERENCES.items():
        for record in tables[name].values():
            for field, target in fields.items():
                tokens = record[field] if isinstance(record[field], list) else [record[field]]
                for token in tokens:
                    if token and token not in tables[target]:
                        raise ValueError(
                            f"{folder / name}.json: record {record['token']} has {field} {token}, which is not in "
                            f"{folder / target}.json"
                        )
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
        ego2global = gravity_aligned(self._pose(reference["ego_pose_token"]))
        images, intrinsics, cam2ego = self._cameras(token, ego2global)
        sample = {
            "images": images,
            "lidar2img": projection(intrinsics, cam2ego),
            "intrinsics": intrinsics,
            "cam2ego": cam2ego,
            **self._annotations(token, rigid_inverse(ego2global)),
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

    def _annotations(self, token: str, global2ego: torch.Tensor) -> dict[str, torch.Tensor]:
        """``boxes``, ``labels`` and ``attributes`` of the detection-class annotations with lidar or radar points
        centred in the x-y range, and ``ignore_regions``: every bike rack of the sample."""
        t = self.tables
        rows, labels, attributes, racks = [], [], [], []
        for ann in self.annotations[token]:
            category = t["category"][t["instance"][ann["instance_token"]]["category_token"]]["name"]
            name = DETECTION_NAME.get(category)
            if category == BIKE_RACK:
                racks.append(self._box(ann, global2ego))
            elif name is not None and ann["num_lidar_pts"] + ann["num_radar_pts"] > 0:
                velocity = global2ego[:3, :3] @ self._velocity(ann)
                rows.append([*self._box(ann, global2ego), *velocity[:2].tolist()])
                labels.append(CLASSES.index(name))
                attributes.append(self._attribute(ann))
        boxes = torch.tensor(rows, dtype=torch.float32).reshape(-1, 9)
        low, high = torch.tensor(self.pc_range[:2]), torch.tensor(self.pc_range[3:5])
        keep = ((boxes[:, :2] >= low) & (boxes[:, :2] <= high)).all(1)
        return {
            "boxes": boxes[keep],
            "labels": torch.tensor(labels, dtype=torch.int64)[keep],
            "attributes": torch.tensor(attributes, dtype=torch.int64)[keep],
            "ignore_regions": torch.tensor(racks, dtype=torch.float32).reshape(-1, 7),
        }

    def _box(self, ann: dict, global2ego: torch.Tensor) -> list[float]:
        """x, y, z, w, l, h, yaw of an annotation in the ego frame."""
        for field in ("translation", "size", "rotation"):  # before the range filter drops a NaN silently
            if not all(map(math.isfinite, ann[field])):
                raise ValueError(
                    f"{self.where['sample_annotation']}: annotation {ann['token']} (sample {ann['sample_token']}) "
                    f"has a non-finite {field} {ann[field]}"
                )
        centre = global2ego[:3, :3] @ torch.tensor(ann["translation"], dtype=torch.float64) + global2ego[:3, 3]
        heading = global2ego[:3, :3] @ quaternion_matrix(ann["rotation"])[:, 0]
        return [*centre.tolist(), *ann["size"], math.atan2(heading[1], heading[0])]

    def _attribute(self, ann: dict) -> int:
        """The index in ATTRIBUTES of an annotation's one attribute, -1 if it has none (the devkit's rule)."""
        tokens = ann["attribute_tokens"]
        if len(tokens) > 1:
            raise ValueError(
                f"{self.where['sample_annotation']}: annotation {ann['token']} has {len(tokens)} attributes "
                f"{tokens}; the devkit's detection ground truth allows at most one"
            )
        if not tokens:
            return -1
        name = self.tables["attribute"][tokens[0]]["name"]
        if name not in ATTRIBUTES:
            raise ValueError(f"{self.where['attribute']}: attribute {tokens[0]} is {name!r}, not one of {ATTRIBUTES}")
        return ATTRIBUTES.index(name)

    def _velocity(self, ann: dict) -> torch.Tensor:
        """Global velocity (3,) from the neighbouring annotations of the same instance, NaN where undefined:
        the devkit's ``box_velocity``, with its arithmetic."""
        anns, samples = self.tables["sample_annotation"], self.tables["sample"]
        first = anns[ann["prev"]] if ann["prev"] else ann
        last = anns[ann["next"]] if ann["next"] else ann
        seconds = 1e-6 * samples[last["sample_token"]]["timestamp"] - 1e-6 * samples[first["sample_token"]]["timestamp"]
        steps = bool(ann["prev"]) + bool(ann["next"])
        if steps == 0 or seconds > MAX_TIME_DIFF * steps:
            return torch.full((3,), math.nan, dtype=torch.float64)
        end, start = (torch.tensor(a["translation"], dtype=torch.float64) for a in (last, first))
        return (end - start) / seconds


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
        integers(1, height=height, width=width, batch_size=batch_size)
        integers(0, num_workers=num_workers)

    def datasets(self) -> tuple[NuScenesSurround, NuScenesSurround]:
        h = self.hparams
        if getattr(self, "_datasets", None) is None:  # the JSON tables load once for both splits
            tables = load_tables(h.root, h.version)
            self._datasets = tuple(
                NuScenesSurround(h.root, h.version, h.height, h.width, h.cameras, scenes, h.temporal, tables=tables)
                for scenes in (h.train_scenes or MINI_SPLITS["train"], h.val_scenes or MINI_SPLITS["val"])
            )
        return self._datasets


__all__ = ["BIKE_RACK", "DETECTION_NAME", "MINI_SPLITS", "NuScenes", "NuScenesSurround", "load_tables"]
