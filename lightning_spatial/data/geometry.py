"""Rigid transforms and pinhole projection shared by the synthetic and nuScenes sources.

Pixel convention (OpenCV): pixel ``i`` is centred on coordinate ``i``, so an image of width W spans
[-0.5, W - 0.5] and a resize by ``s`` maps ``u -> s * (u + 0.5) - 0.5``.
"""

from __future__ import annotations

import math

import torch


def rigid(rotation: torch.Tensor, translation) -> torch.Tensor:
    """4x4 transform from a 3x3 rotation and a translation."""
    out = torch.eye(4, dtype=rotation.dtype)
    out[:3, :3] = rotation
    out[:3, 3] = torch.as_tensor(translation, dtype=rotation.dtype)
    return out


def rigid_inverse(transform: torch.Tensor) -> torch.Tensor:
    """Inverse of rigid 4x4 transforms ``(..., 4, 4)`` (transpose the rotation; no general matrix inverse)."""
    rotation_t = transform[..., :3, :3].transpose(-1, -2)
    out = torch.zeros_like(transform)
    out[..., :3, :3] = rotation_t
    out[..., :3, 3] = -(rotation_t @ transform[..., :3, 3:]).squeeze(-1)
    out[..., 3, 3] = 1
    return out


def yaw_matrix(yaw: float) -> torch.Tensor:
    """Rotation by ``yaw`` radians about +z (float64)."""
    c, s = math.cos(yaw), math.sin(yaw)
    return torch.tensor([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)


def gravity_aligned(pose: torch.Tensor) -> torch.Tensor:
    """``pose`` (4, 4) turned about z alone: the heading of its x axis in the x-y plane, its translation kept."""
    rotation = pose[:3, :3].double()
    return rigid(yaw_matrix(math.atan2(rotation[1, 0], rotation[0, 0])), pose[:3, 3].double())


def quaternion_matrix(q) -> torch.Tensor:
    """Rotation matrix (float64) of a quaternion given as (w, x, y, z), as nuScenes stores them; normalised first."""
    q = torch.as_tensor(q, dtype=torch.float64)
    w, x, y, z = (q / torch.linalg.vector_norm(q)).tolist()
    return torch.tensor(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
        ],
        dtype=torch.float64,
    )


def scale_intrinsics(intrinsics: torch.Tensor, from_size: tuple[int, int], to_size: tuple[int, int]) -> torch.Tensor:
    """Intrinsics of an image resized from ``from_size`` to ``to_size`` (both (H, W)), pixel-centre exact."""
    sy, sx = to_size[0] / from_size[0], to_size[1] / from_size[1]
    out = intrinsics.clone()
    out[..., 0, :] *= sx
    out[..., 1, :] *= sy
    out[..., 0, 2] += 0.5 * sx - 0.5
    out[..., 1, 2] += 0.5 * sy - 0.5
    return out


def projection(intrinsics: torch.Tensor, cam2ego: torch.Tensor) -> torch.Tensor:
    """``lidar2img`` ``(..., 4, 4)``: ego point (x, y, z, 1) -> (u*d, v*d, d, 1) = K @ ego2cam."""
    k = torch.zeros_like(cam2ego)
    k[..., :3, :3] = intrinsics
    k[..., 3, 3] = 1
    return k @ rigid_inverse(cam2ego)


__all__ = [
    "gravity_aligned",
    "projection",
    "quaternion_matrix",
    "rigid",
    "rigid_inverse",
    "scale_intrinsics",
    "yaw_matrix",
]
