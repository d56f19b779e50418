"""Query denoising (DN-DETR; StreamPETR trains its PETR heads with it): in training, extra queries start at
ground-truth centres jittered inside each box and must reconstruct that box, or say "no object" when the
jitter (as a fraction of the half size) has a norm above ``split``. They need no Hungarian matching, so from
the first step every box teaches the decoder to read the features around a reference point, which matching
alone teaches slowly. The groups of denoising queries and the matching queries cannot see each other in
self-attention; inference runs the matching queries alone, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Denoising:
    """``groups`` copies of each sample's boxes, padded to the batch's largest box count ``P // groups``."""

    reference: torch.Tensor  # (B, P, 3) jittered centres, normalised to the point-cloud range
    boxes: torch.Tensor  # (B, P, 9) the box each query reconstructs
    labels: torch.Tensor  # (B, P) its class, or -1 (no object)
    real: torch.Tensor  # (B, P) bool: a box, not padding
    mask: torch.Tensor  # (P + Q, P + Q) bool self-attention mask, True = may not attend


def denoising_queries(
    boxes: list[torch.Tensor],
    labels: list[torch.Tensor],
    groups: int,
    num_queries: int,
    low: torch.Tensor,
    extent: torch.Tensor,
    noise: float = 1.0,
    split: float = 0.75,
) -> Denoising | None:
    """The denoising queries of a batch (None when it holds no box). The jitter is uniform in +-``noise`` times
    the half size (w, l, h along x, y, z, as StreamPETR) and draws from the global RNG."""
    most = max(len(b) for b in boxes)
    if most == 0:
        return None
    target = low.new_zeros(len(boxes), most, boxes[0].shape[-1])
    label = torch.full(target.shape[:2], -1, dtype=torch.long, device=low.device)
    for i, (b, lab) in enumerate(zip(boxes, labels)):
        target[i, : len(b)], label[i, : len(b)] = b, lab
    target, label = target.repeat(1, groups, 1), label.repeat(1, groups)
    jitter = torch.rand(target.shape[:2] + (3,), device=low.device, dtype=low.dtype) * 2 - 1
    centre = target[..., :3] + jitter * noise * target[..., 3:6] / 2
    p = groups * most
    group = torch.arange(p, device=low.device) // most
    mask = torch.zeros(p + num_queries, p + num_queries, dtype=torch.bool, device=low.device)
    mask[:p, :p] = group[:, None] != group[None, :]  # a denoising group sees no other group's answers
    mask[p:, :p] = True  # nor do the matching queries
    return Denoising(
        reference=((centre - low) / extent).clamp(0, 1),
        boxes=target,
        labels=torch.where(jitter.norm(dim=-1) > split, -1, label),
        real=label >= 0,
        mask=mask,
    )
