"""The 10-d box code that heads regress: (x, y, z, log w, log l, log h, sin yaw, cos yaw, vx, vy).

Boxes follow the batch contract's 9 values (x, y, z, w, l, h, yaw, vx, vy): log sizes keep sizes positive and
sin/cos keep yaw continuous across +-pi.
"""

from __future__ import annotations

import torch

from .geometry import on_device

CODE_SIZE = 10
# Velocity errors count less than geometry, as in PETR and CenterPoint.
CODE_WEIGHTS = (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.2, 0.2)


def code_weights(like: torch.Tensor) -> torch.Tensor:
    """``CODE_WEIGHTS`` on ``like``'s device, in its dtype, without a copy from the host (``on_device``)."""
    return on_device(CODE_WEIGHTS, like)


def encode(boxes: torch.Tensor) -> torch.Tensor:
    centre, size, yaw, velocity = boxes.split([3, 3, 1, 2], -1)
    return torch.cat([centre, size.clamp(min=1e-3).log(), yaw.sin(), yaw.cos(), velocity], -1)


def decode(code: torch.Tensor) -> torch.Tensor:
    centre, log_size, sin, cos, velocity = code.split([3, 3, 1, 1, 2], -1)
    return torch.cat([centre, log_size.clamp(max=10).exp(), torch.atan2(sin, cos), velocity], -1)
