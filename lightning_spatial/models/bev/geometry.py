"""Camera and BEV-grid geometry shared by the detectors.

Pixel convention (OpenCV): pixel j of an image covers [j - 0.5, j + 0.5], so its centre is at integer j, as
`lidar2img` maps it. A feature map of n cells covers the whole image of n_image pixels, so cell j's centre lies
at image pixel (j + 0.5) * n_image / n - 0.5, and `F.grid_sample(align_corners=False)` reaches image pixel u at
normalised (2u + 1) / n_image - 1. Coordinates come from `torch.arange` over global sizes and the camera
matrices are replicated, so every result here is a small replicated tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def on_device(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """``values`` as a vector of ``like``'s dtype made on its device by fills: ``torch.tensor(..., device=...)``
    copies from the host, which waits for the device to finish its queue (a GPU idles after it while Python catches
    up) and which a CUDA graph's capture refuses."""
    return torch.cat([torch.full((1,), value, dtype=like.dtype, device=like.device) for value in values])


def inverse_sigmoid(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    x = x.clamp(0, 1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


def pixel_centres(n: int, n_image: int, device: torch.device | None = None) -> torch.Tensor:
    """Image-pixel coordinate of the centre of each of the n feature cells spanning n_image pixels."""
    return (torch.arange(n, device=device, dtype=torch.float32) + 0.5) * (n_image / n) - 0.5


def frustum_to_ego(
    lidar2img: torch.Tensor, depths: torch.Tensor, feature_hw: Sequence[int], image_hw: Sequence[int]
) -> torch.Tensor:
    """Ego-frame points (B, N, D, h, w, 3) of every feature cell centre at every depth (lidar2img inverted)."""
    device = lidar2img.device
    v = pixel_centres(feature_hw[0], image_hw[0], device)
    u = pixel_centres(feature_hw[1], image_hw[1], device)
    d, v, u = torch.meshgrid(depths.to(device=device, dtype=torch.float32), v, u, indexing="ij")
    pixels = torch.stack([u * d, v * d, d, torch.ones_like(d)], -1)  # (D, h, w, 4)
    # inv_ex: inv's singularity check would wait for the GPU; the models' batch check rejects singular ones on the host
    img2lidar = torch.linalg.inv_ex(lidar2img.float()).inverse
    return torch.einsum("bnij,dhwj->bndhwi", img2lidar, pixels)[..., :3]


def project(points: torch.Tensor, lidar2img: torch.Tensor, image_hw: Sequence[int], eps: float = 1e-3):
    """Ego points (P, 3) into every camera: grid_sample coordinates (B, N, P, 2) and validity (B, N, P) as 0/1,
    valid when the point lies in front of the camera and inside the image."""
    homogeneous = torch.cat([points, torch.ones_like(points[:, :1])], -1)
    camera = torch.einsum("bnij,pj->bnpi", lidar2img.float(), homogeneous)
    depth = camera[..., 2:3]
    pixels = camera[..., :2] / depth.clamp(min=eps)
    grid = (2 * pixels + 1) / on_device([image_hw[1], image_hw[0]], pixels) - 1
    valid = (depth[..., 0] > eps) & (grid.abs() <= 1).all(-1)
    return grid, valid.float()


@dataclass(frozen=True)
class BEVGrid:
    """An X x Y grid of BEV cells over the point-cloud range [x0, y0, z0, x1, y1, z1] (x along dim -2)."""

    point_cloud_range: tuple[float, ...]
    size: tuple[int, int]

    def __post_init__(self):
        if len(self.point_cloud_range) != 6 or len(self.size) != 2:
            raise ValueError(
                f"BEVGrid needs a 6-value range and an (X, Y) size, got {self.point_cloud_range}, {self.size}"
            )

    @property
    def cell(self) -> tuple[float, float]:
        r = self.point_cloud_range
        return (r[3] - r[0]) / self.size[0], (r[4] - r[1]) / self.size[1]

    def centres(self, device: torch.device | None = None) -> torch.Tensor:
        """(X, Y, 2) ego x, y of every cell centre."""
        r, (cx, cy) = self.point_cloud_range, self.cell
        x = r[0] + (torch.arange(self.size[0], device=device, dtype=torch.float32) + 0.5) * cx
        y = r[1] + (torch.arange(self.size[1], device=device, dtype=torch.float32) + 0.5) * cy
        return torch.stack(torch.meshgrid(x, y, indexing="ij"), -1)

    def cell_coordinates(self, xy: torch.Tensor) -> torch.Tensor:
        """Continuous cell coordinates (..., 2) of ego x, y: cell (i, j) spans [i, i + 1) x [j, j + 1)."""
        r, (cx, cy) = self.point_cloud_range, self.cell
        return torch.stack([(xy[..., 0] - r[0]) / cx, (xy[..., 1] - r[1]) / cy], -1)

    def flat_index(self, points: torch.Tensor):
        """Flat cell index x * Y + y (long, clamped into the grid) and validity (0/1, inside the whole range)
        of ego points (..., 3)."""
        r = self.point_cloud_range
        ij = self.cell_coordinates(points).floor().long()
        inside = (ij >= 0).all(-1) & (ij[..., 0] < self.size[0]) & (ij[..., 1] < self.size[1])
        inside = inside & (points[..., 2] >= r[2]) & (points[..., 2] < r[5])
        index = ij[..., 0].clamp(0, self.size[0] - 1) * self.size[1] + ij[..., 1].clamp(0, self.size[1] - 1)
        return index, inside.float()
