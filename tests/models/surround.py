"""A tiny random surround-camera batch (the shared BEV batch contract) on a rig built here, independently of
the model code: six cameras at 1.5 m height looking out at 60-degree steps, 70-degree horizontal field of view."""

from __future__ import annotations

import math

import torch

RANGE = (-51.2, -51.2, -5.0, 51.2, 51.2, 3.0)


def rig(cameras: int = 6, height: int = 32, width: int = 88, fov: float = math.radians(70)):
    """(intrinsics (N, 3, 3), cam2ego (N, 4, 4), lidar2img (N, 4, 4)); camera i faces yaw 2*pi*i/N."""
    f = width / 2 / math.tan(fov / 2)
    k = torch.tensor([[f, 0, (width - 1) / 2], [0, f, (height - 1) / 2], [0, 0, 1]])
    cam2ego = []
    for i in range(cameras):
        yaw = 2 * math.pi * i / cameras
        forward = torch.tensor([math.cos(yaw), math.sin(yaw), 0.0])
        right, down = torch.tensor([math.sin(yaw), -math.cos(yaw), 0.0]), torch.tensor([0.0, 0.0, -1.0])
        pose = torch.eye(4)
        pose[:3, :3] = torch.stack([right, down, forward], 1)
        pose[:3, 3] = forward + torch.tensor([0.0, 0.0, 1.5])
        cam2ego.append(pose)
    cam2ego = torch.stack(cam2ego)
    k4 = torch.eye(4)
    k4[:3, :3] = k
    return k.expand(cameras, 3, 3), cam2ego, k4 @ torch.linalg.inv(cam2ego)


def random_boxes(count: int, generator: torch.Generator) -> torch.Tensor:
    u = torch.rand(count, 9, generator=generator)
    low = torch.tensor([-30.0, -30.0, 0.0, 1.0, 1.0, 1.0, -math.pi, -5.0, -5.0])
    high = torch.tensor([30.0, 30.0, 1.5, 2.5, 5.0, 2.0, math.pi, 5.0, 5.0])
    return low + u * (high - low)


def surround_batch(batch=2, cameras=6, height=32, width=88, boxes=3, temporal=False, seed=0, classes=10):
    """``boxes``: the box count of every sample, or one count per sample."""
    g = torch.Generator().manual_seed(seed)
    counts = [boxes] * batch if isinstance(boxes, int) else list(boxes)
    intrinsics, cam2ego, lidar2img = rig(cameras, height, width)
    out = {
        "images": torch.randn(batch, cameras, 3, height, width, generator=g),
        "lidar2img": lidar2img.expand(batch, -1, -1, -1).clone(),
        "intrinsics": intrinsics.expand(batch, -1, -1, -1).clone(),
        "cam2ego": cam2ego.expand(batch, -1, -1, -1).clone(),
        "boxes": [random_boxes(m, g) for m in counts],
        "labels": [torch.randint(classes, (m,), generator=g) for m in counts],
    }
    if temporal:
        # The previous frame: the ego was 2 m behind, so its cameras sit 2 m back in the current ego frame.
        shift = torch.eye(4)
        shift[0, 3] = -2.0
        out["prev_images"] = torch.randn(batch, cameras, 3, height, width, generator=g)
        out["prev_lidar2img"] = (lidar2img @ torch.linalg.inv(shift)).expand(batch, -1, -1, -1).clone()
    return out
