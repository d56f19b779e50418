"""Lift-Splat (the BEVDet / BEVDepth family): every feature cell lifts its context features along its camera
ray, weighted by a per-pixel depth distribution over D bins; the frustum points are pooled into a BEV grid by
a scatter-add, then a BEV encoder (``bev_encoder.py``) and a CenterPoint head detect.

Tiny: ``LiftSplat.tiny()`` (a stack of conv3x3 layers as BEV encoder); the defaults are paper-sized (ConvNeXt-B, 64
depth bins, 80 context channels, a 128 x 128 grid of 0.8 m cells, Lift-Splat-Shoot's ResNet-18 BEV encoder).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torchmetrics
from torch import nn

from .backbone import ImageEncoder
from .base import NUSCENES_RANGE, BEVDetector, as_range, check_arguments
from .bev_encoder import build_bev_encoder
from .center_head import CenterHead
from .geometry import BEVGrid, frustum_to_ego


class LiftSplat(BEVDetector):
    TINY = dict(
        backbone="convnext_atto",
        embed_dims=32,
        context_channels=16,
        depth_bins=8,
        bev_size=(32, 32),
        bev_channels=32,
        bev_encoder="convs",
        bev_layers=2,
        head_channels=32,
        lr=1e-3,
    )

    def __init__(
        self,
        backbone: str = "convnext_base",
        embed_dims: int = 256,
        context_channels: int = 80,
        depth_bins: int = 64,
        depth_range: tuple[float, float] = (1.0, 60.0),
        stride: int = 16,
        bev_size: tuple[int, int] = (128, 128),
        bev_channels: int = 256,
        bev_encoder: str = "resnet18",
        bev_layers: int = 4,
        head_channels: int = 64,
        num_classes: int = 10,
        point_cloud_range: Sequence[float] = NUSCENES_RANGE,
        max_detections: int = 300,
        lr: float = 2e-4,
        weight_decay: float = 0.01,
        warmup_steps: int = 0,
        backbone_lr_mult: float = 1.0,
        checkpoint_path: str | None = None,
        metric: torchmetrics.Metric | None = None,
    ):
        super().__init__(metric)
        self.save_hyperparameters(ignore=["metric"])
        check_arguments(self.hparams)
        self.grid = BEVGrid(as_range(point_cloud_range), tuple(bev_size))
        self.encoder = ImageEncoder(backbone, embed_dims, stride, checkpoint_path)
        self.depth_net = nn.Conv2d(embed_dims, depth_bins + context_channels, 1)
        self.register_buffer("depths", torch.linspace(*depth_range, depth_bins), persistent=False)
        self.bev_encoder = build_bev_encoder(bev_encoder, context_channels, bev_channels, bev_layers)
        self.head = CenterHead(bev_channels, num_classes, self.grid, head_channels, max_detections)

    def forward(self, batch) -> dict[str, torch.Tensor]:
        self.check_batch(batch)
        images = batch["images"]
        features = self.encoder(images.flatten(0, 1))
        depth, context = self.depth_net(features).split([len(self.depths), self.hparams.context_channels], 1)
        volume = depth.softmax(1).unsqueeze(1) * context.unsqueeze(2)  # (B*N, C, D, h, w)
        return self.head(self.bev_encoder(self.splat(volume, batch["lidar2img"], images.shape[-2:])))

    def splat(self, volume: torch.Tensor, lidar2img: torch.Tensor, image_hw: Sequence[int]) -> torch.Tensor:
        """(B*N, C, D, h, w) frustum features -> (B, C, X, Y) sums per BEV cell. Points outside the range add
        zero (weight 0, index clamped into the grid), so no data-dependent indexing."""
        points = frustum_to_ego(lidar2img, self.depths, volume.shape[-2:], image_hw)  # (B, N, D, h, w, 3)
        index, valid = self.grid.flat_index(points)
        b, c, (nx, ny) = lidar2img.shape[0], volume.shape[1], self.grid.size
        index = index + torch.arange(b, device=index.device).view(b, 1, 1, 1, 1) * (nx * ny)
        rows = (volume * valid.flatten(0, 1).unsqueeze(1).to(volume.dtype)).permute(0, 2, 3, 4, 1).reshape(-1, c)
        bev = torch.zeros(b * nx * ny, c, device=volume.device, dtype=volume.dtype).index_add(0, index.flatten(), rows)
        return bev.view(b, nx, ny, c).permute(0, 3, 1, 2)
