"""Synthetic surround-camera scenes: procedural, deterministic per (seed, index), rendered on the fly.

A scene holds 0..max_objects boxes of the ten nuScenes classes (size priors, random yaw, velocities along the
heading for movable classes) on the ground ``distance`` (6-48 m by default) from the ego vehicle without
overlaps, seen by up to six cameras on a nuScenes-like rig. Labels keep the boxes whose centre lies in the
point-cloud range and projects into at least one camera. With ``temporal=True`` a sample also holds the same
scene ``dt`` seconds earlier (objects moved back by their velocity, the ego vehicle by its own motion) and
``prev_lidar2img`` from the current ego frame. The world frame is the current ego frame.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

from .._arguments import integers
from .batch import CAMERAS, CLASSES, POINT_CLOUD_RANGE, check_sample
from .datamodule import SurroundDataModule
from .geometry import projection, rigid, yaw_matrix
from .records import DEFAULT_FORMAT
from .render import NEAR, Scene, render

# Camera -> (yaw and horizontal field of view in degrees, mount x, y, z in metres in the ego frame).
RIG = {
    "CAM_FRONT": (0, 70, 1.70, 0.02, 1.51),
    "CAM_FRONT_LEFT": (55, 70, 1.52, 0.49, 1.51),
    "CAM_FRONT_RIGHT": (-55, 70, 1.50, -0.49, 1.52),
    "CAM_BACK": (180, 110, 0.03, 0.00, 1.56),
    "CAM_BACK_LEFT": (110, 70, 1.04, 0.48, 1.59),
    "CAM_BACK_RIGHT": (-110, 70, 1.01, -0.48, 1.56),
}
# Per class (CLASSES order): mean (w, l, h) in metres, how often it appears, top speed in m/s.
SIZES = torch.tensor(
    [[1.95, 4.6, 1.7], [2.5, 6.9, 2.8], [2.9, 11.0, 3.5], [2.9, 12.0, 3.9], [2.8, 6.4, 3.2],
     [0.67, 0.73, 1.77], [0.77, 2.1, 1.45], [0.6, 1.7, 1.3], [0.41, 0.41, 1.07], [2.5, 0.5, 0.98]]
)  # fmt: skip
FREQUENCY = torch.tensor([0.30, 0.08, 0.04, 0.03, 0.03, 0.18, 0.05, 0.05, 0.12, 0.12])
TOP_SPEED = torch.tensor([10.0, 8.0, 8.0, 6.0, 3.0, 1.5, 10.0, 5.0, 0.0, 0.0])
DISTANCE = (6.0, 48.0)  # metres from the ego origin to an object's centre, on the ground


def camera_rig(cameras: Sequence[str], size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Intrinsics (N, 3, 3) for images of ``size`` (H, W) and cam2ego (N, 4, 4), float32."""
    height, width = size
    intrinsics, cam2ego = [], []
    for name in cameras:
        yaw, fov, *mount = RIG[name]
        c, s = math.cos(math.radians(yaw)), math.sin(math.radians(yaw))
        # columns: the camera's x (right), y (down), z (forward) in the ego frame
        rotation = torch.tensor([[s, 0.0, c], [-c, 0.0, s], [0.0, -1.0, 0.0]], dtype=torch.float64)
        f = width / 2 / math.tan(math.radians(fov) / 2)
        intrinsics.append(torch.tensor([[f, 0, (width - 1) / 2], [0, f, (height - 1) / 2], [0, 0, 1]]))
        cam2ego.append(rigid(rotation, mount))
    return torch.stack(intrinsics).float(), torch.stack(cam2ego).float()


def sample_scene(
    g: torch.Generator,
    max_objects: int,
    classes: Sequence[int] | None = None,
    distance: tuple[float, float] = DISTANCE,
) -> Scene:
    """A random scene drawn from ``g`` (a fixed sequence of draws, so a seed fixes the scene); ``classes``
    (indices into ``CLASSES``) limits the objects to those classes, ``distance`` (near, far) in metres the
    range of their centres' ground distance from the ego origin."""
    near, far = distance
    count = int(torch.randint(0, max_objects + 1, (1,), generator=g))
    frequency = FREQUENCY if classes is None else torch.zeros_like(FREQUENCY).index_fill(0, torch.tensor(classes), 1)
    labels = torch.multinomial(frequency, max(count, 1), replacement=True, generator=g)[:count]
    wlh = SIZES[labels] * (0.9 + 0.2 * torch.rand(count, 3, generator=g))
    radius, bearing, yaw, moving = (torch.rand(count, generator=g) for _ in range(4))
    radius, bearing, yaw = near + (far - near) * radius, math.tau * bearing - math.pi, math.tau * yaw - math.pi
    speed = TOP_SPEED[labels] * torch.where(moving < 0.5, 2 * moving, 0.0)  # half of them stand still
    boxes = torch.stack(
        [
            radius * bearing.cos(),
            radius * bearing.sin(),
            wlh[:, 2] / 2,
            *wlh.unbind(1),
            yaw,
            speed * yaw.cos(),
            speed * yaw.sin(),
        ],
        1,
    )
    keep = _apart(boxes)
    sun = torch.rand(1, generator=g) * math.tau
    sun = torch.cat([0.64 * sun.cos(), 0.64 * sun.sin(), torch.tensor([0.77])])
    texture = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
    return Scene(boxes[keep], labels[keep], texture, sun)


def _apart(boxes: torch.Tensor) -> torch.Tensor:
    """Indices of boxes kept greedily so that no two footprints (as circles) come closer than 0.5 m."""
    radius = torch.hypot(boxes[:, 3], boxes[:, 4]) / 2
    keep: list[int] = []
    for i in range(len(boxes)):
        gap = (boxes[keep, :2] - boxes[i, :2]).norm(dim=1) - radius[keep] - radius[i]
        if bool((gap > 0.5).all()):
            keep.append(i)
    return torch.tensor(keep, dtype=torch.long)


def labelled(boxes: torch.Tensor, lidar2img: torch.Tensor, size: tuple[int, int], pc_range=POINT_CLOUD_RANGE):
    """Mask of boxes whose centre is inside ``pc_range`` and projects into at least one camera's image."""
    centre = torch.cat([boxes[:, :3], torch.ones(len(boxes), 1)], 1)
    p = torch.einsum("nij,kj->nki", lidar2img, centre)
    depth = p[..., 2]
    u, v = p[..., 0] / depth, p[..., 1] / depth
    seen = (depth > NEAR) & (u >= -0.5) & (u < size[1] - 0.5) & (v >= -0.5) & (v < size[0] - 0.5)
    low, high = torch.tensor(pc_range[:3]), torch.tensor(pc_range[3:])
    return seen.any(0) & ((boxes[:, :3] >= low) & (boxes[:, :3] <= high)).all(1)


def _reindex(labels: torch.Tensor, subset: list[int]) -> torch.Tensor:
    """Labels as indices into the class subset instead of ``CLASSES``."""
    lookup = torch.full((len(CLASSES),), -1, dtype=labels.dtype)
    lookup[torch.tensor(subset)] = torch.arange(len(subset), dtype=labels.dtype)
    return lookup[labels]


class SurroundScenes(Dataset):
    """``num_samples`` synthetic surround samples (see the module docstring); uint8 images, collate normalises."""

    def __init__(
        self,
        num_samples: int,
        height: int,
        width: int,
        cameras: int | Sequence[str] = 6,
        temporal: bool = False,
        seed: int = 0,
        max_objects: int = 20,
        dt: float = 0.5,
        classes: Sequence[str] | None = None,
        distance: Sequence[float] = DISTANCE,
    ):
        names = CAMERAS[:cameras] if isinstance(cameras, int) else tuple(cameras)
        unknown = set(classes or ()) - set(CLASSES)
        if unknown or (classes is not None and not classes):
            raise ValueError(f"classes={classes!r}: choose a non-empty subset of {CLASSES}")
        # labels index ``classes`` (the model's and the metric's class list) when a subset is asked for
        self.classes = tuple(classes) if classes is not None else CLASSES
        if (isinstance(cameras, int) and not 1 <= cameras <= len(RIG)) or not set(names) <= RIG.keys():
            raise ValueError(f"cameras={cameras!r}: the synthetic rig calibrates {len(RIG)} cameras, {CAMERAS}")
        integers(1, height=height, width=width)
        integers(0, num_samples=num_samples, max_objects=max_objects)
        if len(distance) != 2 or not 0 <= distance[0] <= distance[1]:
            raise ValueError(f"distance={tuple(distance)!r}: give (near, far) metres with 0 <= near <= far")
        self.distance = (float(distance[0]), float(distance[1]))
        self.num_samples, self.size, self.cameras = num_samples, (height, width), names
        self.temporal, self.seed, self.max_objects, self.dt = temporal, seed, max_objects, dt
        self.intrinsics, self.cam2ego = camera_rig(names, self.size)
        self.lidar2img = projection(self.intrinsics, self.cam2ego)

    def describe(self) -> dict:
        """Every setting that changes the samples (a records folder's identity)."""
        h, w = self.size
        return {
            "source": "SurroundScenes",
            "samples": self.num_samples,
            "cameras": list(self.cameras),
            "height": h,
            "width": w,
            "temporal": self.temporal,
            "dt": self.dt,
            "classes": list(self.classes),
            "seed": self.seed,
            "max_objects": self.max_objects,
            "distance": list(self.distance),
        }

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} synthetic scenes")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        subset = None if self.classes == CLASSES else [CLASSES.index(c) for c in self.classes]
        scene = sample_scene(g, self.max_objects, subset, self.distance)
        ego_speed, yaw_rate = 10 * torch.rand(1, generator=g).item(), 0.6 * torch.rand(1, generator=g).item() - 0.3
        keep = labelled(scene.boxes, self.lidar2img, self.size)
        sample = {
            "images": render(scene, self.intrinsics, self.cam2ego, self.size),
            "lidar2img": self.lidar2img,
            "intrinsics": self.intrinsics,
            "cam2ego": self.cam2ego,
            "boxes": scene.boxes[keep],
            "labels": scene.labels[keep] if subset is None else _reindex(scene.labels[keep], subset),
        }
        if self.temporal:
            turn = -yaw_rate * self.dt  # the previous ego pose in the current ego frame
            step = -ego_speed * self.dt * torch.tensor([math.cos(turn / 2), math.sin(turn / 2), 0.0])
            prev_cam2ego = (rigid(yaw_matrix(turn), step) @ self.cam2ego.double()).float()
            boxes = scene.boxes.clone()
            boxes[:, :2] -= boxes[:, 7:9] * self.dt
            past = Scene(boxes, scene.labels, scene.texture, scene.sun)
            sample["prev_images"] = render(past, self.intrinsics, prev_cam2ego, self.size)
            sample["prev_lidar2img"] = projection(self.intrinsics, prev_cam2ego)
        return check_sample(sample, f"SurroundScenes sample {index}", size=self.size, cameras=len(self.cameras))


class SurroundSynthetic(SurroundDataModule):
    """Train/val splits of ``SurroundScenes`` (val uses ``seed + 1``), optionally packed into ``records_dir``."""

    def __init__(
        self,
        num_samples: int = 64,
        val_samples: int = 16,
        height: int = 256,
        width: int = 704,
        cameras: int | Sequence[str] = 6,
        temporal: bool = False,
        batch_size: int = 2,
        num_workers: int = 0,
        seed: int = 0,
        max_objects: int = 20,
        classes: Sequence[str] | None = None,
        distance: Sequence[float] = DISTANCE,
        records_dir: str | None = None,
        records_format: str = DEFAULT_FORMAT,
    ):
        super().__init__()
        self.save_hyperparameters()
        integers(1, num_samples=num_samples, batch_size=batch_size)
        integers(0, num_workers=num_workers)
        self.datasets()  # their arguments checked now, not in each rank's setup

    def datasets(self) -> tuple[SurroundScenes, SurroundScenes]:
        h = self.hparams
        classes = list(h.classes) if h.classes is not None else None  # Hydra hands a ListConfig
        common = dict(cameras=h.cameras, temporal=h.temporal, max_objects=h.max_objects, classes=classes)
        common["distance"] = tuple(h.distance)  # (near, far) metres
        return (
            SurroundScenes(h.num_samples, h.height, h.width, seed=h.seed, **common),
            SurroundScenes(h.val_samples, h.height, h.width, seed=h.seed + 1, **common),
        )


__all__ = ["RIG", "SurroundScenes", "SurroundSynthetic", "camera_rig", "labelled", "sample_scene"]
