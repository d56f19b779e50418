"""Per-pixel losses on sharded predictions and targets: global value and gradient, every reduction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchvision.ops import sigmoid_focal_loss

from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd

LAYOUT_NAMES = list(LAYOUTS)
CLASSES = 4


def _segmentation_targets(shape):
    target = torch.randint(0, CLASSES, shape)
    target[torch.rand(shape) < 0.2] = 255  # ignored pixels
    return target


LOSSES = {
    "cross_entropy": lambda p, t, r: F.cross_entropy(p, t.clamp(max=CLASSES - 1), reduction=r),
    "cross_entropy_weighted_ignored": lambda p, t, r: F.cross_entropy(
        p, t, weight=torch.tensor([0.5, 2.0, 1.0, 3.0]), ignore_index=255, reduction=r
    ),
    "cross_entropy_smoothed": lambda p, t, r: F.cross_entropy(
        p, t, weight=torch.tensor([0.5, 2.0, 1.0, 3.0]), ignore_index=255, label_smoothing=0.1, reduction=r
    ),
    "nll_loss": lambda p, t, r: F.nll_loss(F.log_softmax(p, 1), t, ignore_index=255, reduction=r),
    "bce": lambda p, t, r: F.binary_cross_entropy(torch.sigmoid(p[:, 0]), (t == 1).float(), reduction=r),
    "bce_logits_pos_weight": lambda p, t, r: F.binary_cross_entropy_with_logits(
        p,
        (t == 2).float().unsqueeze(1).expand_as(p),
        pos_weight=torch.tensor([1.0, 2.0, 3.0, 0.5]).view(4, 1, 1),
        reduction=r,
    ),
    "mse": lambda p, t, r: F.mse_loss(p[:, 0], t.float() / 100, reduction=r),
    "l1": lambda p, t, r: F.l1_loss(p[:, 1], t.float() / 100, reduction=r),
    "smooth_l1": lambda p, t, r: F.smooth_l1_loss(p[:, 2], t.float() / 100, beta=0.5, reduction=r),
    "huber": lambda p, t, r: F.huber_loss(p[:, 3], t.float() / 100, delta=0.5, reduction=r),
    "focal": lambda p, t, r: sigmoid_focal_loss(
        p, F.one_hot(t.clamp(max=3), 4).permute(0, 3, 1, 2).float(), reduction=r
    ),
}


def _case(layout, name, reduction):
    torch.manual_seed(13)
    width = 19 if layout == "w3" else 10
    pred, target = torch.randn(2, CLASSES, 5, width), _segmentation_targets((2, 5, width))
    check(lambda p, t: LOSSES[name](p, t, reduction), [pred, target], sharded=[0, 1], axes=axes(layout))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss(layout, name, reduction):
    run_spmd(_case, LAYOUTS[layout][0], layout, name, reduction)
