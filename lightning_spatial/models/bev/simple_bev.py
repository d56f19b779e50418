"""Simple-BEV: the centre of every BEV cell at Z heights is projected into every camera, features are sampled
bilinearly there (``F.grid_sample``) and averaged over the cameras that see the point; the (C * Z) x X x Y
volume goes through a BEV encoder (``bev_encoder.py``) and the same CenterPoint head as Lift-Splat.

Tiny: ``SimpleBEV.tiny()`` (a stack of conv3x3 layers as BEV encoder); the defaults are paper-sized (ConvNeXt-B,
stride-8 features of 128 channels, a 200 x 200 grid of 0.512 m cells at 8 heights, Lift-Splat-Shoot's ResNet-18
BEV encoder: ResNet stages with upsampling skips, as Simple-BEV's decoder).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
import torchmetrics

from .backbone import ImageEncoder
from .base import NUSCENES_RANGE, BEVDetector, as_range, check_arguments
from .bev_encoder import build_bev_encoder
from .center_head import CenterHead
from .geometry import BEVGrid, project


class SimpleBEV(BEVDetector):
    TINY = dict(
        backbone="convnext_atto",
        embed_dims=16,
        stride=16,
        bev_size=(32, 32),
        z_bins=4,
        bev_channels=32,
        bev_encoder="convs",
        bev_layers=2,
        head_channels=32,
        lr=1e-3,
    )

    def __init__(
        self,
        backbone: str = "convnext_base",
        embed_dims: int = 128,
        stride: int = 8,
        bev_size: tuple[int, int] = (200, 200),
        z_bins: int = 8,
        bev_channels: int = 128,
        bev_encoder: str = "resnet18",
        bev_layers: int = 4,
        head_channels: int = 64,
        num_classes: int = 10,
        point_cloud_range: Sequence[float] = NUSCENES_RANGE,
        max_detections: int = 300,
        lr: float = 3e-4,
        weight_decay: float = 1e-7,
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
        self.bev_encoder = build_bev_encoder(bev_encoder, embed_dims * z_bins, bev_channels, bev_layers)
        self.head = CenterHead(bev_channels, num_classes, self.grid, head_channels, max_detections)

    def points(self, device: torch.device) -> torch.Tensor:
        """(Z * X * Y, 3) ego centres of the BEV voxels, height-major."""
        z, (nx, ny), r = self.hparams.z_bins, self.grid.size, self.grid.point_cloud_range
        heights = r[2] + (torch.arange(z, device=device, dtype=torch.float32) + 0.5) * (r[5] - r[2]) / z
        xy = self.grid.centres(device).expand(z, nx, ny, 2)
        return torch.cat([xy, heights.view(z, 1, 1, 1).expand(z, nx, ny, 1)], -1).reshape(-1, 3)

    def forward(self, batch) -> dict[str, torch.Tensor]:
        self.check_batch(batch)
        images = batch["images"]
        features = self.encoder(images.flatten(0, 1))
        return self.head(self.bev_encoder(self.lift(features, batch["lidar2img"], images.shape[-2:])))

    def lift(self, features: torch.Tensor, lidar2img: torch.Tensor, image_hw: Sequence[int]) -> torch.Tensor:
        """(B*N, C, h, w) features -> (B, C*Z, X, Y): each voxel centre's bilinear sample, averaged over the
        cameras that see it (zero where none does)."""
        (b, n), c = lidar2img.shape[:2], features.shape[1]
        z, (nx, ny) = self.hparams.z_bins, self.grid.size
        grid, valid = project(self.points(features.device), lidar2img, image_hw)
        grid = grid.view(b * n, z * nx, ny, 2).to(features.dtype)
        sampled = F.grid_sample(features, grid, align_corners=False).view(b, n, c, z, nx, ny)
        valid = valid.view(b, n, 1, z, nx, ny).to(features.dtype)
        bev = (sampled * valid).sum(1) / valid.sum(1).clamp(min=1)  # (B, C, Z, X, Y)
        return bev.reshape(b, c * z, nx, ny)
