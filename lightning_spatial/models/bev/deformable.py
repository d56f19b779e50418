"""BEVFormer's attention over a BEV query map, in plain PyTorch around ``F.grid_sample`` (as the reference
``multi_scale_deformable_attn_pytorch``): every query cell predicts a few sampling offsets around its reference
points and a softmax weight for each, and reads the weighted sum of bilinear samples of value maps there.

BEV queries are a channels-last map ``(B, X, Y, C)`` (x along dim -3): linear layers and norms act on the last dim,
and the map's cells are the grid of the samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .geometry import on_device


def deformable_sample(
    maps: list[torch.Tensor], points: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """Multi-scale deformable attention's core: value maps, per level ``(B', Ch, h_l, w_l)``; ``points(level)``: that
    level's sampling locations ``(B', P, X, Y, 2)`` in [0, 1] of its map (x along its width, as ``grid_sample``) and
    their weights ``(B', P, X, Y)`` -> ``(B', Ch, X, Y)``, every query cell's weighted sum of its samples.

    A level's P points of every query cell are sampled as one image of P * X rows by Y columns, so the samples keep
    the query map's (X, Y) cells as their last two dims. The backward keeps only what ``points`` reads and the maps,
    and computes the locations and samples again, as mmcv's kernel does: the samples are P times the output (1.8 GiB
    a level in a BEVFormer-base cross-attention layer, fp32), and the cross-attention's locations and weights are
    per camera, N times its queries' offsets (132 MiB a layer at 200 x 200 on a rank of 4, fp32)."""
    out = 0
    for level, value in enumerate(maps):
        out = out + checkpoint(_weighted_samples, value, points, level, use_reentrant=False)
    return out


def _weighted_samples(value: torch.Tensor, points: Callable, level: int) -> torch.Tensor:
    """One level: ``value`` sampled at ``points(level)``'s locations, weighted, summed over the P points ->
    (B', Ch, X, Y)."""
    locations, weights = points(level)
    grid = (2 * locations - 1).flatten(1, 2)  # (B', P * X, Y, 2)
    sampled = F.grid_sample(value, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return (sampled.unflatten(2, weights.shape[1:3]) * weights[:, None]).sum(2)


def _offset_layers(dims_in: int, dims: int, heads: int, count: int, directions: int) -> tuple[nn.Linear, nn.Linear]:
    """The offset and weight projections, initialised as Deformable DETR: zero weights, offset biases pointing
    each head in its own direction (the k-th point k steps out), uniform attention."""
    offsets = nn.Linear(dims_in, heads * count * 2)
    weights = nn.Linear(dims_in, heads * count)
    nn.init.zeros_(offsets.weight)
    angle = torch.arange(heads, dtype=torch.float32) * (2 * math.pi / heads)
    unit = torch.stack([angle.cos(), angle.sin()], -1)
    unit = unit / unit.abs().max(-1, keepdim=True).values
    steps = torch.arange(1, count // directions + 1, dtype=torch.float32).repeat(directions)
    with torch.no_grad():
        offsets.bias.copy_((unit[:, None] * steps[None, :, None]).flatten())
    nn.init.zeros_(weights.weight)
    nn.init.zeros_(weights.bias)
    return offsets, weights


class TemporalSelfAttention(nn.Module):
    """BEVFormer's temporal self-attention: each BEV query samples the previous BEV (already in the current ego
    frame) and the current queries around its own cell; the two results are averaged. Without a previous BEV the
    queries stand in for it (the first frame)."""

    def __init__(self, dims: int, heads: int, points: int):
        super().__init__()
        self.heads, self.points = heads, points
        # offsets and weights read the previous BEV beside the queries: 2 queues x heads x points
        self.offsets, self.weights = _offset_layers(2 * dims, dims, 2 * heads, points, 1)
        self.value = nn.Linear(dims, dims)
        self.output = nn.Linear(dims, dims)

    def forward(self, queries: torch.Tensor, query_pos: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """queries, query_pos, previous (B, X, Y, C) -> (B, X, Y, C)."""
        previous = queries if previous is None else previous
        b, nx, ny, c = queries.shape
        heads, points = self.heads, self.points
        both = torch.cat([previous, queries + query_pos], -1)
        offsets = self.offsets(both).view(b, nx, ny, 2, heads, points, 2)
        weights = self.weights(both).view(b, nx, ny, 2, heads, points).softmax(-1)
        centres = _cell_centres(nx, ny, queries)  # (X, Y, 2) in [0, 1], x along Y (the maps' width)
        size = on_device([ny, nx], queries)
        locations = centres[:, :, None, None, None] + offsets / size  # (B, X, Y, 2, heads, P, 2)
        locations = locations.permute(0, 3, 4, 5, 1, 2, 6).reshape(b * 2 * heads, 1, points, nx, ny, 2)
        weights = weights.permute(0, 3, 4, 5, 1, 2).reshape(b * 2 * heads, 1, points, nx, ny)
        value = self.value(torch.stack([previous, queries], 1))  # (B, 2, X, Y, C)
        value = _head_maps(value, heads)
        out = deformable_sample([value], lambda level: (locations[:, level], weights[:, level]))
        out = out.view(b, 2, c, nx, ny).mean(1)
        return self.output(out.permute(0, 2, 3, 1))


class SpatialCrossAttention(nn.Module):
    """BEVFormer's spatial cross-attention: every BEV query's pillar of ``anchors`` heights is projected into each
    camera; around each projected anchor it samples ``points`` offsets on every level of that camera's features,
    and the cameras that see the pillar are averaged."""

    def __init__(self, dims: int, heads: int, levels: int, anchors: int, points: int):
        super().__init__()
        self.heads, self.levels, self.anchors, self.points = heads, levels, anchors, points
        self.offsets, self.weights = _offset_layers(dims, dims, heads, levels * anchors * points, levels * anchors)
        self.value = nn.Linear(dims, dims)
        self.output = nn.Linear(dims, dims)

    def forward(
        self,
        queries: torch.Tensor,
        query_pos: torch.Tensor,
        tokens: torch.Tensor,
        shapes: list[tuple[int, int]],
        reference: torch.Tensor,
        hit: torch.Tensor,
    ) -> torch.Tensor:
        """queries, query_pos (B, X, Y, C); camera ``tokens`` (B*N, sum h*w, C) of the levels of ``shapes``
        concatenated; ``reference`` (B, N, X, Y, anchors, 2): each anchor's image position in [0, 1]; ``hit``
        (B, N, X, Y): 1 where a camera sees the pillar -> (B, X, Y, C)."""
        b, nx, ny, c = queries.shape
        n = hit.shape[1]
        heads, levels, anchors, points = self.heads, self.levels, self.anchors, self.points
        q = queries + query_pos
        offsets = self.offsets(q).view(b, 1, nx, ny, heads, levels, anchors, points, 2)
        weights = self.weights(q).view(b, nx, ny, heads, levels * anchors * points).softmax(-1)
        weights = weights.view(b, 1, nx, ny, heads, levels, anchors * points)
        sizes = on_device([n for h, w in shapes for n in (w, h)], q).view(-1, 2)  # per level (w, h)

        def camera_points(level: int) -> tuple[torch.Tensor, torch.Tensor]:
            """Every camera's locations around its projected anchors, and the query's weights for each camera: per
            camera, so made again in the backward (``deformable_sample``) from the queries' offsets."""
            at = reference[:, :, :, :, None, :, None] + offsets[:, :, :, :, :, level] / sizes[level]
            at = at.permute(0, 1, 4, 5, 6, 2, 3, 7).reshape(b * n * heads, -1, nx, ny, 2)  # (B*N*heads, Z*P, X, Y, 2)
            w = weights[:, :, :, :, :, level].expand(-1, n, -1, -1, -1, -1)
            return at, w.permute(0, 1, 4, 5, 2, 3).reshape(b * n * heads, -1, nx, ny)

        values = self.value(tokens).split([h * w for h, w in shapes], 1)  # each level's tokens
        maps = [
            v.unflatten(-1, (heads, c // heads)).permute(0, 2, 3, 1).reshape(-1, c // heads, h, w)
            for v, (h, w) in zip(values, shapes)
        ]
        out = deformable_sample(maps, camera_points).view(b, n, c, nx, ny) * hit[:, :, None]
        out = out.sum(1) / hit.sum(1)[:, None].clamp(min=1)
        return self.output(out.permute(0, 2, 3, 1))


def _head_maps(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Channels-last maps ``(..., X, Y, C)`` -> one map per head ``(... * heads, C / heads, X, Y)``, as
    ``grid_sample`` reads them."""
    nx, ny, c = x.shape[-3:]
    return x.unflatten(-1, (heads, c // heads)).movedim((-4, -3), (-2, -1)).reshape(-1, c // heads, nx, ny)


def _cell_centres(nx: int, ny: int, like: torch.Tensor) -> torch.Tensor:
    """(X, Y, 2) centres of an X x Y map's cells in [0, 1] as grid_sample reads them: (along Y, along X)."""
    x = (torch.arange(nx, device=like.device, dtype=like.dtype) + 0.5) / nx
    y = (torch.arange(ny, device=like.device, dtype=like.dtype) + 0.5) / ny
    rows, cols = torch.meshgrid(x, y, indexing="ij")
    return torch.stack([cols, rows], -1)


class DeformableDecoderLayer(nn.Module):
    """BEVFormer's post-norm detection decoder layer (Deformable DETR's): self-attention over the object queries,
    deformable attention to the BEV around each query's reference point, FFN."""

    def __init__(self, dims: int, heads: int, ffn_dims: int, dropout: float, points: int = 4):
        super().__init__()
        self.heads, self.points = heads, points
        self.self_attn = nn.MultiheadAttention(dims, heads, dropout=dropout, batch_first=True)
        self.offsets, self.weights = _offset_layers(dims, dims, heads, points, 1)
        self.value = nn.Linear(dims, dims)
        self.output = nn.Linear(dims, dims)
        self.ffn = nn.Sequential(nn.Linear(dims, ffn_dims), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ffn_dims, dims))
        self.dropout = nn.Dropout(dropout)
        self.norms = nn.ModuleList(nn.LayerNorm(dims) for _ in range(3))

    def forward(self, x, query_pos, reference, bev, mask=None):
        """x, query_pos (B, Q, C); reference (B, Q, 3) in [0, 1] of the point-cloud range; bev (B, X, Y, C)."""
        q = x + query_pos
        x = self.norms[0](x + self.self_attn(q, q, x, attn_mask=mask, need_weights=False)[0])
        x = self.norms[1](x + self.dropout(self.sample(x + query_pos, reference, bev)))
        return self.norms[2](x + self.ffn(x))

    def sample(self, q: torch.Tensor, reference: torch.Tensor, bev: torch.Tensor) -> torch.Tensor:
        """Each query's weighted samples of the BEV at ``points`` offsets around its reference (x, y) per head."""
        b, nq, c = q.shape
        nx, ny = bev.shape[1:3]
        heads, points = self.heads, self.points
        offsets = self.offsets(q).view(b, nq, heads, points, 2)
        weights = self.weights(q).view(b, nq, heads, points).softmax(-1)
        centre = reference[..., :2].flip(-1).to(q.dtype)  # (y, x): along the map's width (Y), then its height (X)
        locations = centre[:, :, None, None] + offsets / on_device([ny, nx], q)  # (B, Q, heads, P, 2)
        grid = (2 * locations - 1).permute(0, 2, 1, 3, 4).reshape(b * heads, nq, points, 2)
        value = _head_maps(self.value(bev), heads)
        # the queries' samples as one flat row each: a sharded BEV's partial sums are all-reduced, queries stay whole
        sampled = F.grid_sample(value, grid, mode="bilinear", padding_mode="zeros", align_corners=False).flatten(2)
        weights = weights.permute(0, 2, 1, 3).reshape(b * heads, 1, nq * points)
        out = (sampled * weights).unflatten(2, (nq, points)).sum(-1)  # (B * heads, C / heads, Q)
        return self.output(out.reshape(b, c, nq).transpose(1, 2))
