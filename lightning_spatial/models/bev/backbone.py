"""Any timm backbone with a small FPN neck: one feature level for the camera images, or every level (``pyramid``).

The backbone runs over the flattened (B*N, 3, H, W) images. Weights: ``pretrained=False`` unless
``checkpoint_path`` names local timm weights for the same architecture (no hub is reachable).
"""

from __future__ import annotations

import timm
import torch
import torch.nn.functional as F
from torch import nn


class ImageEncoder(nn.Module):
    """timm features at strides >= ``stride``, merged top-down (1x1 laterals, upsample + add) and smoothed
    by a 3x3 conv into one (B*N, dims, H/stride, W/stride) map; with ``pyramid`` every merged level is smoothed by
    a 3x3 conv of its own and all are returned, finest first (BEVFormer's multi-scale camera features)."""

    def __init__(
        self, backbone: str, dims: int, stride: int = 16, checkpoint_path: str | None = None, pyramid: bool = False
    ):
        super().__init__()
        overlay = {"file": checkpoint_path} if checkpoint_path else None
        self.backbone = timm.create_model(
            backbone, features_only=True, pretrained=checkpoint_path is not None, pretrained_cfg_overlay=overlay
        )
        reductions = self.backbone.feature_info.reduction()
        if stride not in reductions:
            raise ValueError(f"backbone {backbone!r} has feature strides {reductions}; stride={stride} is not one")
        self.levels = [i for i, r in enumerate(reductions) if r >= stride]
        self.coarsest = reductions[-1]
        channels = self.backbone.feature_info.channels()
        self.laterals = nn.ModuleList(nn.Conv2d(channels[i], dims, 1) for i in self.levels)
        if pyramid:
            self.outputs = nn.ModuleList(nn.Conv2d(dims, dims, 3, padding=1) for _ in self.levels)
        else:
            self.output = nn.Conv2d(dims, dims, 3, padding=1)
        self.pyramid = pyramid

    def forward(self, images: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        if min(images.shape[-2:]) < self.coarsest:
            raise ValueError(
                f"images of {tuple(images.shape[-2:])} pixels are smaller than the backbone's coarsest "
                f"stride {self.coarsest}: use images of at least {self.coarsest} x {self.coarsest}"
            )
        features = self.backbone(images)
        x, merged = None, []
        for level, lateral in zip(reversed(self.levels), reversed(self.laterals)):
            y = lateral(features[level])
            x = y if x is None else y + F.interpolate(x, size=y.shape[-2:], mode="nearest")
            merged.insert(0, x)
        if self.pyramid:
            return [output(x) for output, x in zip(self.outputs, merged)]
        return self.output(x)
