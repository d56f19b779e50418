"""Focal and L1 losses, summed (callers divide by their positive count, as DETR and CenterPoint do)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sigmoid_focal_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    alpha: float = 0.25,
    gamma: float = 2.0,
    weight: torch.Tensor | None = None,
    dim: tuple[int, ...] | None = None,
):
    """RetinaNet's focal loss with 0/1 targets, summed over all elements (or over ``dim``: one sum per decoder
    layer), each times ``weight`` (broadcast; a 0/1 mask selects elements without boolean indexing, which would
    wait for the GPU)."""
    p = logits.sigmoid()
    ce = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    p_t = p * targets + (1 - p) * (1 - targets)
    alpha_t = alpha * targets + (1 - alpha) * (1 - targets)
    loss = alpha_t * ce * (1 - p_t) ** gamma
    return (loss if weight is None else loss * weight).sum(dim)  # dim None: every element


def gaussian_focal_loss(logits: torch.Tensor, heatmap: torch.Tensor, alpha: float = 2.0, gamma: float = 4.0):
    """CenterNet's focal loss against a gaussian heatmap (peaks exactly 1), summed. Negatives near a peak
    are down-weighted by (1 - heatmap)^gamma; masks multiply, so no boolean indexing of the dense map."""
    positive = (heatmap == 1).to(logits.dtype)
    p = logits.sigmoid()
    pos = -F.logsigmoid(logits) * (1 - p) ** alpha * positive
    neg = -F.logsigmoid(-logits) * p**alpha * (1 - heatmap) ** gamma * (1 - positive)
    return (pos + neg).sum()


def l1_known(
    prediction: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, dim: tuple[int, ...] | None = None
) -> torch.Tensor:
    """L1 loss times ``weight`` (broadcast), summed over the elements whose target is known (or over ``dim``): a
    NaN target (a velocity the data does not know) adds nothing, not even to the gradient."""
    known = ~target.isnan()
    return ((prediction - target.nan_to_num()).abs() * weight * known).sum(dim)
