"""Dropout on sharded activations: decisions as one device would draw them.

Element-wise dropout draws the mask for the *global* tensor and keeps this rank's slice: every rank of a
spatial group consumes the same random stream (the strategy seeds them alike), so the mask is the one a
single device would draw (bit-exact on CPU) and never a periodic repetition of one local mask. Feature
dropout (per sample and channel) draws its small (N, C, 1, ...) mask identically on every rank. DropPath
(timm) needs nothing: its per-sample mask is a new replicated tensor broadcast onto the shard.
The global mask costs one activation's worth of memory on every rank while dropout is active.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..tensor import unwrap, wrap
from ._binding import bound


def dropout(input, p=0.5, training=True, inplace=False):
    if not training or p == 0:
        return input
    x, layout = unwrap(input)
    if p == 1:
        return wrap(x.mul_(0) if inplace else x * 0, layout)
    noise = torch.empty(layout.global_shape(x), dtype=x.dtype, device=x.device).bernoulli_(1 - p).div_(1 - p)
    noise = layout.take_local(noise)
    return wrap(x.mul_(noise) if inplace else x * noise, layout)


def _feature_dropout(nd: int):
    def feature_dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        x, layout = unwrap(input)
        if x.dim() != nd + 2:
            raise ValueError(f"dropout{nd}d on a sharded tensor expects a batched {nd + 2}-d input, got {x.dim()}-d")
        noise = x.new_empty(x.shape[:2] + (1,) * nd).bernoulli_(1 - p).div_(1 - p)
        return wrap(x.mul_(noise) if inplace else x * noise, layout)

    return feature_dropout


HANDLERS = (
    bound(dropout, F.dropout)
    | bound(_feature_dropout(1), F.dropout1d)
    | bound(_feature_dropout(2), F.dropout2d)
    | bound(_feature_dropout(3), F.dropout3d)
)

__all__ = ["HANDLERS"]
