"""Ray-cast renderer for synthetic surround scenes: a textured ground plane, sky, upright oriented boxes.

Every pixel casts a ray ``o + t * d`` with ``d`` scaled so that ``t`` is the depth along the optical axis.
The ground z = 0 carries a hashed cell texture in world coordinates, so it moves consistently between frames
and tells the network how far a pixel is. Boxes are intersected with the slab test in their own frame, one
crop per (camera, box) pair limited to the box's projected rectangle (work grows with the pixels a box
covers, not pixels x boxes), and a depth buffer keeps the nearest surface. A box's front face (+x in its
frame, the heading) is light and its back dark, so its yaw is visible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .geometry import rigid_inverse, yaw_matrix

CLASS_COLOURS = torch.tensor(
    [
        [0.85, 0.15, 0.15],  # car
        [0.95, 0.55, 0.10],  # truck
        [0.95, 0.85, 0.10],  # bus
        [0.55, 0.35, 0.15],  # trailer
        [0.70, 0.75, 0.20],  # construction_vehicle
        [0.15, 0.75, 0.20],  # pedestrian
        [0.60, 0.20, 0.80],  # motorcycle
        [0.15, 0.70, 0.80],  # bicycle
        [1.00, 0.40, 0.60],  # traffic_cone
        [0.20, 0.30, 0.90],  # barrier
    ]
)
HORIZON = torch.tensor([0.78, 0.82, 0.86])  # sky at the horizon, also the haze far surfaces fade into
ZENITH = torch.tensor([0.30, 0.50, 0.85])
ASPHALT = torch.tensor([1.0, 0.96, 0.90])
NEAR, FAR, FOG = 0.1, 1000.0, 150.0
_EDGES = torch.tensor([(i, i | 1 << b) for i in range(8) for b in range(3) if not i >> b & 1])  # box_corners' 12


@dataclass(frozen=True)
class Scene:
    """Objects in the world frame: ``boxes`` (K, 9) as in the batch contract, ``labels`` (K,) class indices."""

    boxes: torch.Tensor
    labels: torch.Tensor
    texture: int  # seed of the ground texture
    sun: torch.Tensor  # (3,) unit vector towards the sun


def box_corners(boxes: torch.Tensor) -> torch.Tensor:
    """(K, 9) boxes -> (K, 8, 3) corners in the world frame."""
    signs = torch.tensor([[i >> 2 & 1, i >> 1 & 1, i & 1] for i in range(8)], dtype=boxes.dtype) - 0.5
    local = signs * boxes[:, None, [4, 3, 5]]  # (l, w, h) along the box's x, y, z
    c, s = boxes[:, 6].cos()[:, None], boxes[:, 6].sin()[:, None]
    x, y = c * local[..., 0] - s * local[..., 1], s * local[..., 0] + c * local[..., 1]
    return torch.stack([x, y, local[..., 2]], -1) + boxes[:, None, :3]


def render(scene: Scene, intrinsics: torch.Tensor, cam2world: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 images (N, 3, H, W) of ``scene`` seen by N pinhole cameras (no skew)."""
    height, width = size
    rot, origin = cam2world[:, :3, :3].float(), cam2world[:, :3, 3].float()
    fx, fy, cx, cy = (intrinsics[:, i, j].float() for i, j in ((0, 0), (1, 1), (0, 2), (1, 2)))
    u = ((torch.arange(width) - cx[:, None]) / fx[:, None])[:, None, :, None]  # (N, 1, W, 1)
    v = ((torch.arange(height) - cy[:, None]) / fy[:, None])[:, :, None, None]  # (N, H, 1, 1)
    up = u * rot[:, 2, 0, None, None, None] + v * rot[:, 2, 1, None, None, None] + rot[:, 2, 2, None, None, None]
    elevation = (up * (u * u + v * v + 1).rsqrt()).clamp(0, 0.25)[..., 0] * 4  # sine of the ray's elevation, x4
    colour = HORIZON[:, None, None] + (ZENITH - HORIZON)[:, None, None] * elevation[:, None]  # sky, (N, 3, H, W)
    depth = torch.full((len(rot), height, width), torch.inf)
    first = int((up[..., 0] < 0).any(-1).any(0).int().argmax())  # rows above it see only sky
    ground_depth, ground = _ground(scene.texture, origin, _rays(u, v[:, first:], rot))
    depth[:, first:] = ground_depth
    colour[:, :, first:] = torch.where(ground_depth.isfinite()[:, None], ground, colour[:, :, first:])
    for cam, k, (v0, v1, u0, u1) in _pairs(scene.boxes, intrinsics, cam2world, size):
        rays = _rays(u[cam, :, u0:u1], v[cam, v0:v1], rot[cam])
        _draw_box(
            scene.boxes[k],
            CLASS_COLOURS[scene.labels[k]],
            origin[cam],
            rays,
            depth[cam, v0:v1, u0:u1],
            colour[cam, :, v0:v1, u0:u1],
            scene.sun,
        )
    fog = torch.where(depth.isinf(), 1.0, torch.exp(-depth / FOG))[:, None]  # far surfaces fade into the horizon
    return torch.lerp(HORIZON[:, None, None], colour, fog).mul_(255).add_(0.5).to(torch.uint8)


def _rays(u: torch.Tensor, v: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Ray directions (..., h, w, 3) with unit depth along the optical axis, from normalised pixel coordinates."""
    return u * rot[..., None, None, :, 0] + v * rot[..., None, None, :, 1] + rot[..., None, None, :, 2]


def _ground(texture: int, origin: torch.Tensor, rays: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth (inf for sky) and colour (N, 3, h, w) of the ground z = 0: random 4 m and 0.5 m cells, a 2 m checker."""
    dz = rays[..., 2]
    depth = -origin[:, 2, None, None] / dz.clamp(max=-1e-6)
    depth = torch.where((dz < -1e-6) & (depth < FAR), depth, torch.inf)
    xy = origin[:, None, None, :2] + depth.clamp(max=FAR)[..., None] * rays[..., :2]
    fine = torch.floor(xy * 2).int()  # 0.5 m cells; shifts give the 4 m cells and the 2 m checker
    coarse, checker = fine >> 3, ((fine[..., 0] >> 2) + (fine[..., 1] >> 2)) & 1
    table = torch.rand(2, 256 * 256, generator=torch.Generator().manual_seed(texture))
    value = table[0][(coarse[..., 0] & 255) << 8 | coarse[..., 1] & 255] * 0.18
    value += table[1][(fine[..., 0] & 255) << 8 | fine[..., 1] & 255] * 0.08
    value += checker * 0.05 + 0.28
    return depth, value[:, None] * ASPHALT[:, None, None]


def _pairs(boxes: torch.Tensor, intrinsics: torch.Tensor, cam2world: torch.Tensor, size: tuple[int, int]):
    """(camera, box, (v0, v1, u0, u1)) for each box that some camera sees: the pixel rectangle covered by the
    box's part in front of the camera (its corners there and its edges' crossings of the near plane)."""
    if len(boxes) == 0:
        return []
    world2cam = rigid_inverse(cam2world.double())
    corners = box_corners(boxes.double())
    cam = torch.einsum("nij,kcj->nkci", world2cam[:, :3, :3], corners) + world2cam[:, None, None, :3, 3]
    start, end = cam[:, :, _EDGES[:, 0]], cam[:, :, _EDGES[:, 1]]
    crossing = (start[..., 2] - NEAR) * (end[..., 2] - NEAR) < 0
    t = ((NEAR - start[..., 2]) / (end[..., 2] - start[..., 2]).where(crossing, 1.0))[..., None]
    points = torch.cat([cam, start + t * (end - start)], 2)
    valid = torch.cat([cam[..., 2] > NEAR, crossing], 2)[..., None]
    pix = torch.einsum("nij,nkcj->nkci", intrinsics.double(), points)
    pix = pix[..., :2] / pix[..., 2:].clamp(min=NEAR / 2)
    bounds = torch.tensor([size[1], size[0]], dtype=pix.dtype)
    low = torch.where(valid, pix, torch.inf).amin(2).floor().clamp(min=0).minimum(bounds)
    high = (torch.where(valid, pix, -torch.inf).amax(2).floor() + 1).clamp(min=0).minimum(bounds)
    keep = valid[..., 0].any(-1) & (high > low).all(-1)
    return [
        (n, k, (int(low[n, k, 1]), int(high[n, k, 1]), int(low[n, k, 0]), int(high[n, k, 0])))
        for n, k in keep.nonzero().tolist()
    ]


def _draw_box(box, base, origin, rays, depth, colour, sun) -> None:
    """Slab-test the rays of one crop against one box and write its shaded faces where they are nearest."""
    world_from_box = yaw_matrix(float(box[6])).float()
    d = rays @ world_from_box  # ray directions in the box frame
    d = torch.where(d.abs() < 1e-9, 1e-9, d)
    o = (origin - box[:3]) @ world_from_box
    half = box[[4, 3, 5]] / 2
    t1, t2 = (-half - o) / d, (half - o) / d
    near, axis = torch.minimum(t1, t2).max(-1)
    hit = (near <= torch.maximum(t1, t2).amin(-1)) & (near > NEAR) & (near < depth)
    if not hit.any():
        return
    sign = -d.gather(-1, axis[..., None]).sign()  # the entry face's outward normal along ``axis``
    normal = torch.nn.functional.one_hot(axis, 3).float() * sign
    shade = 0.55 + 0.45 * (normal @ world_from_box.T @ sun).clamp(min=0)
    front, back = (axis == 0) & (sign[..., 0] > 0), (axis == 0) & (sign[..., 0] < 0)
    face = torch.where(front[..., None], 0.4 * base + 0.6, torch.where(back[..., None], 0.5 * base, base))
    depth[hit] = near[hit]
    colour[:, hit] = (face * shade[..., None])[hit].T


__all__ = ["CLASS_COLOURS", "Scene", "box_corners", "render"]
