"""The detection head shared by Lift-Splat and Simple-BEV (after their BEV encoder, ``bev_encoder.py``): a
CenterPoint head (per-class gaussian heatmaps, box regression at the centre cells, max-pool peak decoding).

Targets are dense (B, K, X, Y) / (B, 10, X, Y) maps and the losses use masks by multiplication, so the head
needs no gather from a BEV map. Regression channels: (dx, dy) offset of the centre inside its cell, z,
log w, log l, log h, sin yaw, cos yaw, vx, vy (the box code with x, y relative to the cell).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import boxes as box_code
from .geometry import BEVGrid
from .losses import gaussian_focal_loss, l1_known


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Half-precision outputs in float32 for the losses and the decoding; float32 and float64 as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def conv_bn_relu(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]


def gaussian_radius(length: torch.Tensor, width: torch.Tensor, min_overlap: float = 0.1) -> torch.Tensor:
    """CenterPoint's radius (in cells) of the gaussian drawn for a box, the smallest of CornerNet's three
    corner-case roots, exactly as CenterPoint computes them (each divided by 2)."""
    o, s, p = min_overlap, length + width, length * width
    r1 = s + (s**2 - 4 * p * (1 - o) / (1 + o)).sqrt()
    r2 = 2 * s + (4 * s**2 - 16 * (1 - o) * p).sqrt()
    r3 = -2 * o * s + (4 * o**2 * s**2 - 16 * o * (o - 1) * p).sqrt()
    return torch.minimum(torch.minimum(r1, r2), r3) / 2


class CenterHead(nn.Module):
    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        grid: BEVGrid,
        channels: int = 64,
        max_detections: int = 300,
        min_radius: int = 2,
        regression_weight: float = 0.25,
    ):
        super().__init__()
        self.grid, self.num_classes = grid, num_classes
        self.max_detections, self.min_radius, self.regression_weight = max_detections, min_radius, regression_weight
        self.shared = nn.Sequential(*conv_bn_relu(in_channels, channels))
        self.heatmap = nn.Sequential(*conv_bn_relu(channels, channels), nn.Conv2d(channels, num_classes, 1))
        self.regression = nn.Sequential(*conv_bn_relu(channels, channels), nn.Conv2d(channels, box_code.CODE_SIZE, 1))
        nn.init.constant_(self.heatmap[-1].bias, -2.19)  # prior probability 0.1, as in CenterPoint

    def forward(self, bev: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.shared(bev)
        return {"heatmap": self.heatmap(x), "regression": self.regression(x)}

    @torch.no_grad()
    def targets(self, boxes: torch.Tensor, labels: torch.Tensor):
        """One sample's boxes (m, 9) -> heatmap (K, X, Y), regression (10, X, Y) and centre mask (1, X, Y).
        Each class's heatmap is the maximum of its boxes' gaussians, cut to a square of the box's radius.
        Boxes centred outside the grid write to a spare cell that is dropped (no data-dependent indexing)."""
        (nx, ny), (cx, cy) = self.grid.size, self.grid.cell
        centre = self.grid.cell_coordinates(boxes[:, :2].float())
        cell = centre.floor()
        inside = (cell >= 0).all(-1) & (cell[:, 0] < nx) & (cell[:, 1] < ny)
        radius = gaussian_radius(boxes[:, 4] / cx, boxes[:, 3] / cy).floor().clamp(min=self.min_radius)
        sigma = (2 * radius + 1) / 6
        every = torch.meshgrid(*(torch.arange(n, device=boxes.device) for n in (nx, ny)), indexing="ij")
        delta = torch.stack(every, -1).reshape(1, -1, 2) - cell[:, None]  # (m, X*Y, 2)
        window = (delta.abs() <= radius[:, None, None]).all(-1) & inside[:, None]
        gaussian = torch.exp(-(delta**2).sum(-1) / (2 * sigma[:, None] ** 2)) * window
        heatmap = gaussian.new_zeros(self.num_classes, nx * ny)
        heatmap = heatmap.scatter_reduce(0, labels[:, None].expand_as(gaussian), gaussian, "amax")
        flat = torch.where(inside, cell[:, 0] * ny + cell[:, 1], nx * ny).long()
        code = torch.cat([centre - cell, box_code.encode(boxes.float())[:, 2:]], -1)
        regression = code.new_zeros(nx * ny + 1, box_code.CODE_SIZE).index_put((flat,), code)[:-1]
        mask = code.new_zeros(nx * ny + 1).index_put((flat,), torch.ones_like(flat, dtype=code.dtype))[:-1]
        return heatmap.view(-1, nx, ny), regression.T.reshape(-1, nx, ny), mask.view(1, nx, ny)

    def loss(self, outputs, boxes, labels, normaliser=lambda count: count) -> dict[str, torch.Tensor]:
        """Gaussian focal loss over the heatmap and weighted L1 at the centre cells, both divided by the number
        of centres (``normaliser`` may average it over data replicas; at least 1). An empty scene trains the
        heatmap's negatives only."""
        heatmap, regression, mask = (torch.stack(t) for t in zip(*map(self.targets, boxes, labels)))
        count = normaliser(mask.sum()).clamp(min=1)
        weights = box_code.code_weights(outputs["regression"]).view(1, -1, 1, 1)
        heat = gaussian_focal_loss(_wide(outputs["heatmap"]), heatmap) / count
        reg = self.regression_weight * l1_known(_wide(outputs["regression"]), regression, weights * mask) / count
        return {"loss": heat + reg, "loss_heatmap": heat, "loss_regression": reg}

    @torch.no_grad()
    def decode(self, outputs) -> list[dict[str, torch.Tensor]]:
        """Top-k heatmap peaks (3x3 max-pool NMS) -> boxes from the regression at the peak cells."""
        heat = _wide(outputs["heatmap"]).sigmoid()
        b, k, nx, ny = heat.shape
        peaks = heat * (F.max_pool2d(heat, 3, stride=1, padding=1) == heat)
        scores, index = peaks.flatten(1).topk(min(self.max_detections, k * nx * ny))
        labels, cells = index // (nx * ny), index % (nx * ny)
        code = _wide(outputs["regression"]).flatten(2).gather(2, cells[:, None].expand(-1, box_code.CODE_SIZE, -1))
        code = code.transpose(1, 2)
        r, (cx, cy) = self.grid.point_cloud_range, self.grid.cell
        x = r[0] + (cells // ny + code[..., 0]) * cx
        y = r[1] + (cells % ny + code[..., 1]) * cy
        boxes = box_code.decode(torch.cat([x[..., None], y[..., None], code[..., 2:]], -1))
        return [{"boxes": boxes[i], "scores": scores[i], "labels": labels[i]} for i in range(b)]
