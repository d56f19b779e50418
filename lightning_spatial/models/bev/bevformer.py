"""BEVFormer: a grid of learned BEV queries builds the bird's-eye view by deformable attention, layer by layer:
temporal self-attention to the previous frame's BEV and spatial cross-attention to the multi-scale features of the
cameras each query's pillar hits (``deformable.py``); object queries then detect with Deformable DETR's decoder,
sampling the BEV around their reference points, and PETR's head, losses and matching (``decoder.py``).

``temporal=True`` builds the previous frame's BEV first, without gradients as BEVFormer does, from
``prev_images`` and ``prev_lidar2img``: the previous cameras in the current ego frame, so that BEV is already
aligned by the ego motion. ``num_cameras`` sizes the learned camera embedding, as BEVFormer's. Tiny:
``BEVFormer.tiny()``; the defaults are BEVFormer-base-like (ConvNeXt-B, 256 dims, 200 x 200 BEV queries, 6 encoder
and 6 decoder layers, 900 object queries, 3 feature levels).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torchmetrics
from torch import nn

from .backbone import ImageEncoder
from .base import NUSCENES_RANGE, as_range, check_arguments
from .decoder import QueryDetector
from .deformable import DeformableDecoderLayer, SpatialCrossAttention, TemporalSelfAttention
from .geometry import BEVGrid, project


class EncoderLayer(nn.Module):
    """Post-norm BEVFormer encoder layer: temporal self-attention, spatial cross-attention, FFN."""

    def __init__(self, dims: int, heads: int, ffn_dims: int, levels: int, anchors: int, sca_points: int,
                 tsa_points: int, dropout: float):  # fmt: skip
        super().__init__()
        self.temporal = TemporalSelfAttention(dims, heads, tsa_points)
        self.spatial = SpatialCrossAttention(dims, heads, levels, anchors, sca_points)
        self.ffn = nn.Sequential(nn.Linear(dims, ffn_dims), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ffn_dims, dims))
        self.dropout = nn.Dropout(dropout)
        self.norms = nn.ModuleList(nn.LayerNorm(dims) for _ in range(3))

    def forward(self, queries, query_pos, previous, tokens, shapes, reference, hit):
        x = self.norms[0](queries + self.dropout(self.temporal(queries, query_pos, previous)))
        x = self.norms[1](x + self.dropout(self.spatial(x, query_pos, tokens, shapes, reference, hit)))
        return self.norms[2](x + self.ffn(x))


class BEVFormer(QueryDetector):
    TINY = dict(
        backbone="convnext_atto",
        embed_dims=32,
        stride=8,
        bev_size=(8, 8),
        encoder_layers=2,
        num_layers=2,
        num_heads=4,
        ffn_dims=64,
        num_queries=20,
        num_cameras=2,
        lr=1e-3,
    )

    def __init__(
        self,
        backbone: str = "convnext_base",
        embed_dims: int = 256,
        stride: int = 8,
        bev_size: tuple[int, int] = (200, 200),
        encoder_layers: int = 6,
        z_anchors: int = 4,
        sca_points: int = 2,
        tsa_points: int = 4,
        num_layers: int = 6,
        num_heads: int = 8,
        ffn_dims: int = 512,
        num_queries: int = 900,
        num_cameras: int = 6,
        num_classes: int = 10,
        point_cloud_range: Sequence[float] = NUSCENES_RANGE,
        temporal: bool = False,
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
        self.grid = BEVGrid(point_cloud_range, tuple(bev_size))
        self.encoder = ImageEncoder(backbone, embed_dims, stride, checkpoint_path, pyramid=True)
        levels = len(self.encoder.levels)
        nx, ny = self.grid.size
        self.bev_queries = nn.Parameter(torch.randn(nx, ny, embed_dims) * 0.02)
        self.bev_rows = nn.Parameter(torch.rand(nx, embed_dims // 2))  # learned position, as BEVFormer's
        self.bev_columns = nn.Parameter(torch.rand(ny, embed_dims - embed_dims // 2))
        self.level_embedding = nn.Parameter(torch.randn(levels, embed_dims) * 0.02)
        self.camera_embedding = nn.Parameter(torch.randn(num_cameras, embed_dims) * 0.02)
        self.bev_layers = nn.ModuleList(
            EncoderLayer(embed_dims, num_heads, ffn_dims, levels, z_anchors, sca_points, tsa_points, dropout)
            for _ in range(encoder_layers)
        )
        self.build_decoder(point_cloud_range, DeformableDecoderLayer)

    def forward(self, batch) -> dict[str, torch.Tensor]:
        self.check_batch(batch)
        previous = None
        if self.hparams.temporal:
            with torch.no_grad():  # the history BEV carries no gradient (BEVFormer's obtain_history_bev)
                previous = self.bev(batch["prev_images"], batch["prev_lidar2img"], None)
        bev = self.bev(batch["images"], batch["lidar2img"], previous)
        return self.decode_queries((bev,), batch)

    def bev_position(self) -> torch.Tensor:
        """(X, Y, C): a learned row embedding beside a learned column embedding."""
        nx, ny = self.grid.size
        rows = self.bev_rows[:, None].expand(-1, ny, -1)
        return torch.cat([rows, self.bev_columns[None].expand(nx, -1, -1)], -1)

    def bev(self, images: torch.Tensor, lidar2img: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """Surround images (B, N, 3, H, W) -> BEV features (B, X, Y, C)."""
        b, n = images.shape[:2]
        if n != self.hparams.num_cameras:
            raise ValueError(
                f"images hold {n} cameras but the model's camera embedding has num_cameras="
                f"{self.hparams.num_cameras}: set num_cameras to the data's camera count"
            )
        levels = self.encoder(images.flatten(0, 1))  # finest first, each (B*N, C, h, w)
        shapes = [tuple(f.shape[-2:]) for f in levels]
        tokens = torch.cat([f.flatten(2).transpose(1, 2) + e for f, e in zip(levels, self.level_embedding)], 1)
        tokens = (tokens.unflatten(0, (b, n)) + self.camera_embedding[:, None]).flatten(0, 1)
        reference, hit = (t.to(tokens.dtype) for t in self.pillars(lidar2img, images.shape[-2:]))
        queries = self.bev_queries.expand(b, -1, -1, -1)
        position = self.bev_position()
        for layer in self.bev_layers:
            queries = layer(queries, position, previous, tokens, shapes, reference, hit)
        return queries

    def pillars(self, lidar2img: torch.Tensor, image_hw: Sequence[int]):
        """Every BEV cell's pillar of ``z_anchors`` heights in every camera: image positions (B, N, X, Y, Z, 2) in
        [0, 1] and whether the camera sees the pillar at all (B, N, X, Y) as 0/1."""
        z, (nx, ny), r = self.hparams.z_anchors, self.grid.size, self.grid.point_cloud_range
        device = lidar2img.device
        heights = r[2] + (torch.arange(z, device=device, dtype=torch.float32) + 0.5) * (r[5] - r[2]) / z
        xy = self.grid.centres(device)[:, :, None].expand(nx, ny, z, 2)
        points = torch.cat([xy, heights.view(1, 1, z, 1).expand(nx, ny, z, 1)], -1).reshape(-1, 3)
        grid, valid = project(points, lidar2img, image_hw)
        b, n = lidar2img.shape[:2]
        return ((grid + 1) / 2).view(b, n, nx, ny, z, 2), valid.view(b, n, nx, ny, z).amax(-1)
