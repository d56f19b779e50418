"""PETR and PETRv2: camera tokens carry a 3-D position embedding from each camera's ``lidar2img`` and a
transformer decoder cross-attends from learnable 3-D reference-point queries to all of them.

PETRv2 options: ``temporal=True`` adds the previous frame's tokens (their embedding from the ego-motion
aligned ``prev_lidar2img``); ``feature_guided_pe=True`` gates the embedding per pixel with a sigmoid of an MLP
of the image features. ``denoise_groups=G`` trains G groups of query-denoising queries beside the matching ones
(DN-DETR, as StreamPETR: ``denoise.py``). Tiny: ``PETR.tiny()``; the defaults are paper-sized (ConvNeXt-B, 256
dims, 6 layers, 900 queries, 64 depth bins).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torchmetrics
from torch import nn

from .backbone import ImageEncoder
from .base import NUSCENES_RANGE, as_range, check_arguments
from .decoder import QueryDetector
from .geometry import frustum_to_ego, inverse_sigmoid


def lid_depths(bins: int, near: float, far: float) -> torch.Tensor:
    """PETR's linear-increasing depth bins: spacing grows linearly with depth."""
    index = torch.arange(bins, dtype=torch.float32)
    return near + (far - near) / (bins * (1 + bins)) * index * (index + 1)


def _mlp(cin: int, hidden: int, cout: int) -> nn.Sequential:
    """Per-pixel MLP as 1x1 convs."""
    return nn.Sequential(nn.Conv2d(cin, hidden, 1), nn.ReLU(), nn.Conv2d(hidden, cout, 1))


class PositionEmbedding3D(nn.Module):
    """Frustum points of every feature cell at D depths -> ego frame -> normalised to the point-cloud range ->
    inverse sigmoid -> 1x1-conv MLP; optionally gated by the features (PETRv2's FPE)."""

    def __init__(self, dims: int, depths: torch.Tensor, point_cloud_range: Sequence[float], feature_guided: bool):
        super().__init__()
        self.register_buffer("depths", depths, persistent=False)
        r = torch.tensor(point_cloud_range, dtype=torch.float32)
        self.register_buffer("low", r[:3], persistent=False)
        self.register_buffer("extent", r[3:] - r[:3], persistent=False)
        self.encoder = _mlp(3 * len(depths), 4 * dims, dims)
        self.gate = _mlp(dims, dims, dims) if feature_guided else None

    def forward(self, features: torch.Tensor, lidar2img: torch.Tensor, image_hw: Sequence[int]) -> torch.Tensor:
        """features (B*N, C, h, w) -> embedding of the same shape."""
        points = frustum_to_ego(lidar2img, self.depths, features.shape[-2:], image_hw)
        coords = inverse_sigmoid((points - self.low) / self.extent)
        b, n, d, h, w, _ = coords.shape
        coords = coords.permute(0, 1, 2, 5, 3, 4).reshape(b * n, d * 3, h, w)
        # Zeros laid out like the features cut the frustum (made from the map's size: whole) to their layout before
        # the MLP: under spatial_tp each rank embeds its own columns, not every camera column (a no-op on one device);
        # cast after the cut, so that only those columns are copied.
        embedding = self.encoder((coords + torch.zeros_like(features[:, :1])).to(features.dtype))
        return embedding if self.gate is None else embedding * self.gate(features).sigmoid()


def camera_tokens(features: torch.Tensor, batch: int) -> torch.Tensor:
    """(B*N, C, h, w) -> (B, N*h*w, C)."""
    return features.flatten(-2).permute(0, 2, 1).reshape(batch, -1, features.shape[1])


class PETR(QueryDetector):
    TINY = dict(
        backbone="convnext_atto",
        embed_dims=32,
        num_layers=2,
        num_heads=4,
        ffn_dims=64,
        num_queries=20,
        depth_bins=8,
        lr=1e-3,
    )

    def __init__(
        self,
        backbone: str = "convnext_base",
        embed_dims: int = 256,
        num_layers: int = 6,
        num_heads: int = 8,
        ffn_dims: int = 2048,
        num_queries: int = 900,
        depth_bins: int = 64,
        depth_range: tuple[float, float] = (1.0, 61.2),
        stride: int = 16,
        num_classes: int = 10,
        point_cloud_range: Sequence[float] = NUSCENES_RANGE,
        temporal: bool = False,
        feature_guided_pe: bool = False,
        denoise_groups: int = 0,
        dropout: float = 0.0,
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
        point_cloud_range = as_range(point_cloud_range)
        self.encoder = ImageEncoder(backbone, embed_dims, stride, checkpoint_path)
        depths = lid_depths(depth_bins, *depth_range)
        self.position = PositionEmbedding3D(embed_dims, depths, point_cloud_range, feature_guided_pe)
        self.build_decoder(point_cloud_range)

    def forward(self, batch) -> dict[str, torch.Tensor]:
        self.check_batch(batch)
        images, lidar2img = batch["images"], batch["lidar2img"]
        if self.hparams.temporal:
            images = torch.cat([images, batch["prev_images"]], 1)
            lidar2img = torch.cat([lidar2img, batch["prev_lidar2img"]], 1)
        b = images.shape[0]
        features = self.encoder(images.flatten(0, 1))
        keys = camera_tokens(features + self.position(features, lidar2img, images.shape[-2:]), b)
        values = camera_tokens(features, b)
        return self.decode_queries((keys, values), batch)
