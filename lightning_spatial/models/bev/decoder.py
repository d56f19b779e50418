"""The DETR-style detection decoder PETR and BEVFormer share: learnable 3-D reference-point queries read the scene
through post-norm decoder layers (PETR: cross-attention to every camera token; BEVFormer: deformable attention to the
BEV around each query's reference point, ``deformable.py``), and a ``QueryHead`` reads every layer's output
(auxiliary losses). Optional query denoising (``denoise.py``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .base import BEVDetector
from .denoise import denoising_queries
from .geometry import inverse_sigmoid
from .query_head import QueryHead


def sine_embedding(points: torch.Tensor, feats: int, temperature: float = 10000.0) -> torch.Tensor:
    """(..., 3) points in [0, 1] -> (..., 3 * feats) interleaved sin/cos features per coordinate."""
    dim_t = temperature ** (2 * (torch.arange(feats, device=points.device) // 2) / feats)
    angles = points[..., None] * (2 * math.pi) / dim_t
    return torch.stack([angles[..., 0::2].sin(), angles[..., 1::2].cos()], -1).flatten(-3)


class DecoderLayer(nn.Module):
    """Post-norm DETR decoder layer: self-attention over queries, cross-attention to scene tokens, FFN."""

    def __init__(self, dims: int, heads: int, ffn_dims: int, dropout: float):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dims, heads, dropout=dropout, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(dims, heads, dropout=dropout, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(dims, ffn_dims), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ffn_dims, dims))
        self.norms = nn.ModuleList(nn.LayerNorm(dims) for _ in range(3))

    def forward(self, x, query_pos, reference, keys, values, mask=None):
        """``reference`` (the queries' reference points) is unused: PETR's keys carry the geometry."""
        q = x + query_pos
        x = self.norms[0](x + self.self_attn(q, q, x, attn_mask=mask, need_weights=False)[0])
        x = self.norms[1](x + self.cross_attn(x + query_pos, keys, values, need_weights=False)[0])
        return self.norms[2](x + self.ffn(x))


class QueryDetector(BEVDetector):
    """A ``BEVDetector`` whose detections come from the shared decoder: ``build_decoder`` in ``__init__`` (after
    ``save_hyperparameters``, which holds ``embed_dims``, ``num_layers``, ``num_heads``, ``ffn_dims``,
    ``num_queries``, ``dropout``, ``denoise_groups``, ``num_classes`` and ``max_detections``), ``decode_queries``
    at the end of ``forward``. ``layer(dims, heads, ffn_dims, dropout)`` makes a decoder layer, called as
    ``layer(x, query_pos, reference, *memory, mask)``."""

    def build_decoder(self, point_cloud_range: Sequence[float], layer: Callable[..., nn.Module] = DecoderLayer) -> None:
        h = self.hparams
        dims = h.embed_dims
        if dims % 4 or dims % h.num_heads:
            raise ValueError(
                f"embed_dims={dims} must be a multiple of 4 (the queries' sine embedding pairs sin and cos for "
                f"each of 3 coordinates) and of num_heads={h.num_heads}"
            )
        # Reference points live in [0, 1]^3 of the range; stored as logits so they never leave it.
        self.reference_logits = nn.Parameter(inverse_sigmoid(torch.rand(h.num_queries, 3)))
        self.query_embedding = nn.Sequential(nn.Linear(3 * (dims // 2), dims), nn.ReLU(), nn.Linear(dims, dims))
        self.layers = nn.ModuleList(layer(dims, h.num_heads, h.ffn_dims, h.dropout) for _ in range(h.num_layers))
        self.head = QueryHead(dims, h.num_classes, point_cloud_range, h.max_detections)

    def decode_queries(self, memory: tuple[torch.Tensor, ...], batch) -> dict[str, torch.Tensor]:
        """What the layers read (PETR: keys and values (B, tokens, C); BEVFormer: the BEV (B, X, Y, C)) -> the
        head's outputs for every decoder layer."""
        reference = self.reference_logits.sigmoid().expand(memory[0].shape[0], -1, -1)
        denoise = None
        if self.training and self.hparams.denoise_groups and "boxes" in batch:
            denoise = denoising_queries(
                batch["boxes"], batch["labels"], self.hparams.denoise_groups, len(self.reference_logits),
                self.head.low, self.head.extent,
            )  # fmt: skip
        if denoise is not None:
            reference = torch.cat([denoise.reference, reference], 1)
        query_pos = self.query_embedding(sine_embedding(reference, self.hparams.embed_dims // 2))
        x, hidden = torch.zeros_like(query_pos), []
        for layer in self.layers:
            x = layer(x, query_pos, reference, *memory, None if denoise is None else denoise.mask)
            hidden.append(x)
        return self.head(torch.stack(hidden), reference, denoise)
