"""The optimizer the recipes' modules build."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def adamw(params: Iterable[Any], **options: Any) -> torch.optim.AdamW:
    """AdamW, one fused kernel where every parameter is on CUDA: ``foreach`` launches a kernel per list operation
    over hundreds of tensors (host time a short spatially split step shows) and allocates parameter-sized
    temporaries (its square roots); elsewhere torch's default."""
    params = list(params)
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    return torch.optim.AdamW(params, fused=all(p.is_cuda for p in tensors) or None, **options)
