"""Our reader and NuScenesDetection against the official devkit's whole detection evaluation (``NuScenes``,
``DetectionEval``: ``load_gt``, ``add_center_dist``, ``filter_eval_boxes``, ``evaluate`` with the
``detection_cvpr_2019`` config) on a nuScenes-format folder written here, with the same predictions given to
both: ours in the ego frame, the devkit's as a results file in the global frame.

The folder: three scenes (one of v1.0-mini's train split, left out by both; one with a 4 s gap between key
frames), ego poses with yaw, pitch, roll and height; tracked and lone annotations (NaN velocity) of every
detection class and some others, tilted, with and without attributes and points, near the class ranges and
above z = 3 m; bike racks with bicycles and motorcycles inside, beside and above them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from lightning_spatial.data import ATTRIBUTES, CLASSES, NuScenes
from lightning_spatial.data.nuscenes import BIKE_RACK, DETECTION_NAME
from lightning_spatial.metrics import NuScenesDetection
from lightning_spatial.models.bev.base import TARGETS
from tests.data.nuscenes_folder import NuScenesFolder, yaw_quaternion

SCENES = (("scene-0061", [0, 1, 2]), ("scene-0103", [0, 1, 2, 3, 4]), ("scene-0916", [0, 1, 9, 10]))  # 0.5 s steps
CATEGORY = {name: category for category, name in reversed(DETECTION_NAME.items())}  # a category per class
SIZE = {"car": (1.9, 4.6, 1.7), "truck": (2.5, 7.0, 3.0), "bus": (2.9, 11.0, 3.5), "trailer": (2.9, 12.0, 3.9),
        "construction_vehicle": (2.8, 6.5, 3.2), "pedestrian": (0.7, 0.7, 1.8), "motorcycle": (0.8, 2.1, 1.5),
        "bicycle": (0.6, 1.7, 1.3), "traffic_cone": (0.4, 0.4, 1.1), "barrier": (2.5, 0.5, 1.0)}  # fmt: skip
RANGE = {"car": 50, "truck": 50, "bus": 50, "trailer": 50, "construction_vehicle": 50, "pedestrian": 40,
         "motorcycle": 40, "bicycle": 40, "traffic_cone": 30, "barrier": 30}  # fmt: skip
# The attributes a class takes (the others: vehicle.*)
ATTRIBUTE_OF = {"pedestrian": "pedestrian", "motorcycle": "cycle", "bicycle": "cycle", "traffic_cone": None,
                "barrier": None}  # fmt: skip
ERRORS = {"ATE": "trans_err", "ASE": "scale_err", "AOE": "orient_err", "AVE": "vel_err", "AAE": "attr_err"}


def quaternion(yaw: float, pitch: float = 0.0, roll: float = 0.0) -> list[float]:
    """(w, x, y, z) of z-y-x Euler angles."""
    cy, sy, cp, sp, cr, sr = (f(a / 2) for a in (yaw, pitch, roll) for f in (math.cos, math.sin))
    return [cr * cp * cy + sr * sp * sy, sr * cp * cy - cr * sp * sy, cr * sp * cy + sr * cp * sy,
            cr * cp * sy - sr * sp * cy]  # fmt: skip


class Scenes:
    """Writes the folder; keeps each key frame's flat ego pose (yaw, translation) and the detection-class
    annotations to predict from."""

    def __init__(self, seed: int):
        self.g, self.folder = np.random.default_rng(seed), NuScenesFolder(cameras=("CAM_FRONT",), image_size=(9, 16))
        self.ego: dict[str, tuple[float, np.ndarray]] = {}
        self.objects: dict[str, list[tuple[str, dict, np.ndarray]]] = {}  # sample -> (class, annotation, velocity)
        self.count = 0

    def token(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def to_global(self, sample: str, local) -> np.ndarray:
        yaw, translation = self.ego[sample]
        c, s = math.cos(yaw), math.sin(yaw)
        return translation + np.array([c * local[0] - s * local[1], s * local[0] + c * local[1], local[2]])

    def scene(self, name: str, steps: list[int]) -> list[str]:
        g = self.g
        yaw, translation = g.uniform(-math.pi, math.pi), np.array([*g.uniform(300, 1500, 2), g.uniform(-1, 3)])
        samples = []
        for step in steps:
            token, timestamp = self.token("sample"), 10**9 + 500_000 * step
            heading = yaw + 0.01 * step
            position = translation + 2.5 * step * np.array([math.cos(yaw), math.sin(yaw), 0.0])
            tilt = g.uniform(-0.05, 0.05, 2)
            lidar = {"translation": position.tolist(), "rotation": quaternion(heading, *tilt)}
            camera = {"translation": (position + 0.02).tolist(), "rotation": quaternion(heading + 0.001, *tilt)}
            samples.append((token, timestamp, lidar, camera))
            self.ego[token], self.objects[token] = (heading, position), []
        self.folder.scene(self.token("scene"), name, samples)
        return [s[0] for s in samples]

    def object(self, samples: list[str], name: str, local, velocity=(0.0, 0.0), lidar=None, attribute=None):
        """An instance seen in ``samples`` (consecutive key frames), at ``local`` in the first one's ego frame,
        moving at ``velocity`` (global x-y, m/s)."""
        g, category = self.g, CATEGORY.get(name, name)
        instance = self.folder.instance(self.token("instance"), category)
        start = self.to_global(samples[0], local)
        size = np.array(SIZE.get(name, (1.0, 1.0, 1.0))) * g.uniform(0.8, 1.2, 3)
        yaw, tilt = g.uniform(-math.pi, math.pi), g.uniform(-0.03, 0.03, 2)
        first_time = self.time(samples[0])
        track = []
        for sample in samples:
            seconds = self.time(sample) - first_time
            translation = start + seconds * np.array([*velocity, 0.0])
            points = int(g.integers(0, 3) > 0) * 20 if lidar is None else lidar
            track.append(self.folder.annotation(self.token("ann"), sample, instance, translation.tolist(),
                                                size.tolist(), quaternion(yaw, *tilt), lidar=points,
                                                radar=int(g.integers(0, 2)), attribute=attribute))  # fmt: skip
            if name in SIZE:
                self.objects[sample].append((name, track[-1], np.array(velocity)))
        self.folder.track(track)

    def time(self, sample: str) -> float:
        return next(s["timestamp"] for s in self.folder.tables["sample"] if s["token"] == sample) * 1e-6

    def attribute(self, name: str):
        kind = ATTRIBUTE_OF.get(name, "vehicle")
        names = [a for a in ATTRIBUTES if kind and a.startswith(kind)]
        return None if not names or self.g.random() < 0.15 else str(self.g.choice(names))

    def rack(self, sample: str) -> None:
        """A rack (yaw only, as nuScenes annotates) with cycles inside it, beside it and above it."""
        g = self.g
        distance, angle = g.uniform(5, 30), g.uniform(-math.pi, math.pi)
        local = np.array([distance * math.cos(angle), distance * math.sin(angle), 0.5])
        w, length, h, yaw = g.uniform(1.5, 3), g.uniform(4, 8), g.uniform(1.0, 1.5), g.uniform(-math.pi, math.pi)
        instance = self.folder.instance(self.token("instance"), BIKE_RACK)
        centre = self.to_global(sample, local)
        size, rotation = [w, length, h], yaw_quaternion(yaw)
        self.folder.annotation(self.token("ann"), sample, instance, centre.tolist(), size, rotation, lidar=0)
        rack_yaw = yaw - self.ego[sample][0]  # in the ego frame
        c, s = math.cos(rack_yaw), math.sin(rack_yaw)
        # (along length, across w, up h) as fractions: two inside, one 0.4 m beside, one 0.3 m above
        places = ((0.3, 0.2, 0.1), (-0.35, -0.3, 0.0), (0.2, 0.5 + 0.4 / w, 0.0), (0.0, 0.0, 0.5 + 0.3 / h))
        for along, across, up in places:
            offset = np.array([along * length * c - across * w * s, along * length * s + across * w * c, up * h])
            name = str(g.choice(["bicycle", "motorcycle"]))
            self.object([sample], name, local + offset, lidar=5, attribute=self.attribute(name))


def write_scenes(root, seed: int = 0) -> Scenes:
    scenes = Scenes(seed)
    g = scenes.g
    for name, steps in SCENES:
        samples = scenes.scene(name, steps)
        for _ in range(14):  # tracks over consecutive key frames, and lone annotations
            first = int(g.integers(0, len(samples)))
            last = first + int(g.integers(0, len(samples) - first))
            name_ = str(g.choice([*SIZE, "animal", "movable_object.debris"]))
            angle, distance = g.uniform(-math.pi, math.pi), g.uniform(2, 50)
            local = [distance * math.cos(angle), distance * math.sin(angle), g.uniform(-1.5, 2.0)]
            moving = name_ not in ("traffic_cone", "barrier") and g.random() < 0.6
            velocity = tuple(g.uniform(-8, 8, 2)) if moving else (0.0, 0.0)
            scenes.object(samples[first : last + 1], name_, local, velocity, attribute=scenes.attribute(name_))
        for sample in samples:
            for name_, limit in RANGE.items():  # lone boxes just inside and just outside the class range
                angle, margin = g.uniform(-math.pi, math.pi), g.choice([-0.05, 0.05])
                local = [(limit + margin) * math.cos(angle), (limit + margin) * math.sin(angle), 0.5]
                scenes.object([sample], name_, local, lidar=3, attribute=scenes.attribute(name_))
            scenes.object([sample], "car", [12.0, -3.0, 4.5], lidar=8, attribute="vehicle.parked")  # above 3 m
            scenes.rack(sample)
    scenes.folder.write(root)
    return scenes


def predictions(scenes: Scenes, sample: str):
    """Noisy detections of the sample's annotations (some twice, some with another class or attribute) and
    strays, as global rows (x, y, z, w, l, h, yaw, vx, vy, label, attribute, score)."""
    g, rows = scenes.g, []
    for name, ann, velocity in scenes.objects[sample]:
        for _ in range(int(g.random() < 0.85) + int(g.random() < 0.15)):
            centre = np.array(ann["translation"]) + g.normal(0, [0.4, 0.4, 0.2])
            size = np.abs(np.array(ann["size"]) * (1 + g.normal(0, 0.1, 3))) + 0.05
            w, x, y, z = ann["rotation"]
            yaw = math.atan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z)) + g.normal(0, 0.3)
            label = CLASSES.index(name) if g.random() < 0.9 else int(g.integers(0, len(CLASSES)))
            attribute = ann["attribute_tokens"][0][5:] if ann["attribute_tokens"] and g.random() < 0.6 else None
            attribute = ATTRIBUTES.index(attribute) if attribute else int(g.integers(-1, len(ATTRIBUTES)))
            rows.append([*centre, *size, yaw, *(velocity + g.normal(0, 0.5, 2)), label, attribute, g.uniform(0.05, 1)])
    for _ in range(3):
        local = [*g.uniform(-45, 45, 2), g.uniform(-1, 2)]
        box = [*scenes.to_global(sample, local), *g.uniform(0.5, 4, 3), g.uniform(-math.pi, math.pi)]
        rows.append([*box, *g.normal(0, 3, 2), int(g.integers(0, len(CLASSES))), -1, g.uniform(0.05, 1)])
    return np.array(rows)


def to_ego(rows: np.ndarray, yaw: float, translation: np.ndarray) -> dict[str, torch.Tensor]:
    """Global rows -> our prediction dict in the gravity-aligned ego frame (the pose's yaw and translation)."""
    c, s = math.cos(yaw), math.sin(yaw)
    turn = np.array([[c, s], [-s, c]])  # global -> ego in x-y
    boxes = rows[:, :9].copy()
    boxes[:, :3] -= translation
    boxes[:, :2], boxes[:, 7:9] = boxes[:, :2] @ turn.T, rows[:, 7:9] @ turn.T
    boxes[:, 6] -= yaw
    labels, attributes = (torch.tensor(rows[:, i], dtype=torch.int64) for i in (9, 10))
    scores = torch.tensor(rows[:, 11])
    return {"boxes": torch.tensor(boxes), "labels": labels, "attributes": attributes, "scores": scores}


def results_file(path, rows_of: dict[str, np.ndarray]) -> None:
    """The devkit's submission format."""
    results = {
        sample: [
            {
                "sample_token": sample,
                "translation": r[:3].tolist(),
                "size": r[3:6].tolist(),
                "rotation": yaw_quaternion(r[6]),
                "velocity": r[7:9].tolist(),
                "detection_name": CLASSES[int(r[9])],
                "detection_score": float(r[11]),
                "attribute_name": ATTRIBUTES[int(r[10])] if r[10] >= 0 else "",
            }
            for r in rows
        ]  # fmt: skip
        for sample, rows in rows_of.items()
    }
    meta = {"use_camera": True, "use_lidar": False, "use_radar": False, "use_map": False, "use_external": False}
    path.write_text(json.dumps({"meta": meta, "results": results}))


@pytest.fixture(scope="module")
def devkit():
    try:
        from nuscenes import NuScenes as DevkitNuScenes
        from nuscenes.eval.common.config import config_factory
        from nuscenes.eval.common.utils import quaternion_yaw
        from nuscenes.eval.detection.evaluate import DetectionEval
        from pyquaternion import Quaternion
    except ImportError as error:
        pytest.skip(f"needs the nuScenes devkit and its imports, as bin/setup installs them ({error})")
    return DevkitNuScenes, config_factory, DetectionEval, lambda q: quaternion_yaw(Quaternion(q))


def test_reader_and_metric_equal_the_devkits_detection_eval(devkit, tmp_path):
    DevkitNuScenes, config_factory, DetectionEval, quaternion_yaw = devkit
    root = tmp_path / "nuscenes"
    scenes = write_scenes(root)
    # val: v1.0-mini's default, the devkit's mini_val
    data = NuScenes(str(root), height=9, width=16, cameras=("CAM_FRONT",), batch_size=3, train_scenes=["scene-0061"])
    data.setup("validate")
    tokens = data.val_set.tokens
    poses = {s["token"]: s for s in scenes.folder.tables["ego_pose"]}
    rows = {token: predictions(scenes, token) for token in tokens}
    ours, without_racks, targets = NuScenesDetection(), NuScenesDetection(ignore_classes=()), []
    for batch in data.val_dataloader():
        targets += [dict(zip(TARGETS, values)) for values in zip(*(batch[key] for key in TARGETS))]
    for token, target in zip(tokens, targets):
        pose = poses[f"ego-lidar-{token}"]  # the devkit's ego pose: LIDAR_TOP's
        pred = to_ego(rows[token], quaternion_yaw(pose["rotation"]), np.array(pose["translation"]))
        ours.update([pred], [target])
        without_racks.update([pred], [target])
    ours, without_racks = ({k: v.item() for k, v in m.compute().items()} for m in (ours, without_racks))

    results_file(tmp_path / "results.json", rows)
    nusc = DevkitNuScenes(version="v1.0-mini", dataroot=str(root), verbose=False)
    evaluation = DetectionEval(nusc, config_factory("detection_cvpr_2019"), str(tmp_path / "results.json"),
                               "mini_val", str(tmp_path / "devkit"), verbose=False)  # fmt: skip
    theirs = evaluation.evaluate()[0].serialize()
    expected = {"mAP": theirs["mean_ap"], "NDS": theirs["nd_score"]}
    for e, metric in ERRORS.items():
        expected[f"m{e}"] = theirs["tp_errors"][metric]
        expected.update({f"{e}/{name}": theirs["label_tp_errors"][name][metric] for name in CLASSES})
    expected.update({f"AP/{name}": theirs["mean_dist_aps"][name] for name in CLASSES})
    assert ours.keys() == expected.keys()
    # 1e-6: our boxes are float32 (the batch contract): at 50 m a position rounds by up to 2e-6 m
    close = {k: ours[k] == pytest.approx(expected[k], abs=1e-6, nan_ok=True) for k in ours}
    assert all(close.values()), {k: (ours[k], expected[k]) for k, ok in close.items() if not ok}

    # What the folder covers: the samples of mini_val only, NaN velocities, boxes above 3 m, racks that drop
    # boxes, every class matched.
    assert set(tokens) == set(evaluation.gt_boxes.sample_tokens)
    boxes = torch.cat([t["boxes"] for t in targets])
    assert boxes[:, 7:].isnan().any() and (boxes[:, 2] > 3).any()
    assert (ours["AP/bicycle"], ours["AP/motorcycle"]) != (without_racks["AP/bicycle"], without_racks["AP/motorcycle"])
    assert all(ours[f"AP/{name}"] > 0 for name in CLASSES) and 0 < ours["mAAE"] < 1
