"""The BEV encoders of Lift-Splat and Simple-BEV, chosen by name (``bev_encoder=``), both (B, C, X, Y) ->
(B, channels, X, Y).

``"convs"``: ``bev_layers`` conv3x3-BN-ReLU layers at full BEV resolution, small and cheap (the tiny models and
the CPU experiments). A timm ResNet name (``"resnet18"``, ``"resnet34"``, ``"resnet50"``, ...): the layout of
Lift-Splat-Shoot's ``BevEncode``, whose receptive field spans the grid where the conv stack's sees a few cells: the
ResNet stem (7x7 stride-2 conv, BN, ReLU; no max-pool) from the BEV channels, ``layer1`` (stride 2), ``layer2``
(4) and ``layer3`` (8); ``layer3`` upsampled x4 (bilinear, ``align_corners=True``) and concatenated with
``layer1``, two conv3x3-BN-ReLU; upsampled x2 to the grid, a conv3x3-BN-ReLU and a 1x1 conv to ``channels``. The
stride-8 stage must divide the grid exactly (``check_bev_encoder``).
"""

from __future__ import annotations

from collections.abc import Sequence

import timm
import torch
import torch.nn.functional as F
from torch import nn

from .center_head import conv_bn_relu

CONVS = "convs"
STRIDE = 8  # the ResNet's deepest stage, upsampled back to the grid


def is_resnet(name: str) -> bool:
    """A timm model built by its ResNet class (``resnet*``, ``resnext*``, ``seresnet*``, ...): stem and layer1-3."""
    return isinstance(name, str) and timm.is_model(name) and timm.models.is_model_in_modules(name, ["resnet"])


def check_bev_encoder(name: str, bev_size: Sequence[int]) -> None:
    """Raises naming the argument: an encoder that is neither ``"convs"`` nor a timm ResNet, or a grid the
    ResNet's stride-8 stage does not divide (its upsampling would not return to the grid's size)."""
    if name != CONVS and not is_resnet(name):
        raise ValueError(
            f"bev_encoder must be {CONVS!r} (bev_layers conv3x3-BN-ReLU layers) or a timm ResNet name such as "
            f"'resnet18', 'resnet34' or 'resnet50', got {name!r}"
        )
    x, y = bev_size
    if name != CONVS and (x % STRIDE or y % STRIDE):
        fit = [STRIDE * -(-n // STRIDE) for n in (x, y)]  # rounded up
        raise ValueError(
            f"bev_size={[x, y]} does not fit bev_encoder={name!r}: its stride-{STRIDE} stage is upsampled back to "
            f"the grid, so X and Y must be multiples of {STRIDE} (X={x}, Y={y}); use bev_size={fit} (and the "
            f"point_cloud_range for those cells) or bev_encoder={CONVS!r}"
        )


class ResNetBEVEncoder(nn.Module):
    """Lift-Splat-Shoot's BEV encoder on a timm ResNet's stem and ``layer1..3`` (channels read from the model);
    ``width`` channels after the x4 upsampling, ``width // 2`` after the x2 (256 and 128, as Lift-Splat-Shoot).
    timm's initialisation zeroes each block's last BatchNorm scale, as Lift-Splat-Shoot's ``zero_init_residual``."""

    def __init__(self, name: str, in_channels: int, channels: int, width: int = 256):
        super().__init__()
        trunk = timm.create_model(name, pretrained=False, in_chans=in_channels)
        self.stem = nn.Sequential(trunk.conv1, trunk.bn1, trunk.act1)
        self.layer1, self.layer2, self.layer3 = trunk.layer1, trunk.layer2, trunk.layer3
        skip, deep = (trunk.feature_info[i]["num_chs"] for i in (1, 3))  # layer1's and layer3's outputs
        self.fuse = nn.Sequential(*conv_bn_relu(skip + deep, width), *conv_bn_relu(width, width))
        self.out = nn.Sequential(*conv_bn_relu(width, width // 2), nn.Conv2d(width // 2, channels, 1))

    def forward(self, bev: torch.Tensor) -> torch.Tensor:
        skip = self.layer1(self.stem(bev))
        deep = F.interpolate(self.layer3(self.layer2(skip)), scale_factor=4, mode="bilinear", align_corners=True)
        x = self.fuse(torch.cat([skip, deep], 1))
        return self.out(F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True))


def conv_encoder(in_channels: int, channels: int, layers: int) -> nn.Sequential:
    """``layers`` conv3x3-BN-ReLU at full resolution."""
    widths = [in_channels] + [channels] * layers
    return nn.Sequential(*[m for cin in widths[:-1] for m in conv_bn_relu(cin, channels)])


def build_bev_encoder(name: str, in_channels: int, channels: int, layers: int) -> nn.Module:
    """The encoder called ``name`` (``"convs"`` uses ``layers``; a ResNet ignores it)."""
    return (
        conv_encoder(in_channels, channels, layers) if name == CONVS else ResNetBEVEncoder(name, in_channels, channels)
    )
