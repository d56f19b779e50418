"""Per-pixel losses on sharded predictions and targets: torch's own loss per element, reduced globally.

``reduction='none'`` stays sharded; ``'sum'`` all-reduces the local sum; ``'mean'`` divides the global sum
by the global denominator torch would use: the element count; for ``cross_entropy``/``nll_loss`` the summed
class weights of the non-ignored targets; for weighted ``mse_loss``/``l1_loss`` the summed weights. The
deprecated ``size_average``/``reduce`` choose the reduction as in torch. Losses built from element-wise ops
and ``mean``/``sum`` (torchvision's ``sigmoid_focal_loss``) need no handler: the reduction handlers make them
exact.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn._reduction import get_enum, legacy_get_string

from ..collectives import across
from ..layout import LayoutError
from ..tensor import SpatialTensor, adopt, unwrap
from ._binding import bound
from ._common import common_layout, localize


def _weighted_count(target: torch.Tensor, weight, ignore_index: int, logits: torch.Tensor) -> torch.Tensor:
    """torch's 'mean' denominator for class-index targets: sum of weight[target] over non-ignored targets."""
    keep = target != ignore_index
    if weight is None:
        return keep.sum().to(logits.dtype)
    return (weight[target.clamp(0, weight.numel() - 1)] * keep).sum()


def _l1_weight() -> torch.Tensor | None:
    """torch 2.14's ``F.l1_loss`` leaves ``weight`` out when it hands the call to ``__torch_function__``; its
    frame, a few calls up, is the only place the weight still exists."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is F.l1_loss.__code__:
            return frame.f_locals["weight"]
        frame = frame.f_back
    return None


@dataclass(frozen=True)
class Placed:
    """A loss's operands as this rank holds them, and what its per-element terms are part of: the ``axes`` a sum
    of them is all-reduced over, their global ``count`` (the 'mean' denominator) and ``keep``, the terms as
    ``reduction='none'`` returns them. Shards (``on_layout``) and selected rows (``ops.selection``) differ only
    here."""

    operands: list
    axes: tuple
    count: Callable[[torch.Tensor], int]
    keep: Callable[[torch.Tensor], torch.Tensor]


def on_layout(fn, operands) -> Placed:
    """Operands sharded alike, replicated ones cut to this rank's part (``localize``); all replicated: as they are."""
    if not any(isinstance(t, SpatialTensor) for t in operands):
        return Placed(list(operands), (), torch.Tensor.numel, lambda t: t)
    layout = common_layout(fn, operands)
    return Placed(
        [unwrap(localize(fn, t, layout))[0] for t in operands],
        layout.shards,
        lambda t: layout.global_shape(t).numel(),
        lambda t: adopt(t, layout),
    )


def _loss(fn, place: Callable[..., Placed]):
    first, second = list(inspect.signature(fn).parameters)[:2]  # prediction and target
    elementwise = _ELEMENTWISE_WEIGHTS.get(fn, ())

    def loss(**params):
        if fn is F.l1_loss and params.get("weight") is None:
            params["weight"] = _l1_weight()
        size_average, reduce = params.pop("size_average", None), params.pop("reduce", None)
        reduction = params.get("reduction", "mean")
        if size_average is not None or reduce is not None:  # the deprecated spelling, as torch reads it
            reduction = legacy_get_string(size_average, reduce)
        get_enum(reduction)  # torch's error for an unknown reduction, before any communication
        if isinstance(params.get("weight"), SpatialTensor) and "weight" not in elementwise:
            raise LayoutError(f"{fn.__name__}: weight (per class) is sharded; pass it replicated")
        names = [first, second, *(n for n in elementwise if params.get(n) is not None)]
        placed = place(fn, [params[n] for n in names])  # per-element weights follow the prediction, like the target
        params.update(zip(names, placed.operands))
        x, target = params[first], params[second]
        per_element = fn(**{**params, "reduction": "none"})
        if reduction == "none":
            return placed.keep(per_element)
        total = across(per_element.sum(), placed.axes)
        if reduction == "sum":
            return total
        if fn in CLASS_TARGETS and not target.is_floating_point():
            denominator = across(_weighted_count(target, params.get("weight"), params["ignore_index"], x), placed.axes)
        elif fn in (F.mse_loss, F.l1_loss) and params.get("weight") is not None:  # torch: sum(w * e) / sum(w)
            denominator = across(params["weight"].sum(), placed.axes)
        else:
            denominator = placed.count(per_element)
        return total / denominator

    loss.__name__ = fn.__name__
    return loss


# Weights that multiply the loss element by element (unlike cross_entropy's per-class weight).
_ELEMENTWISE_WEIGHTS = {
    F.binary_cross_entropy: ("weight",),
    F.binary_cross_entropy_with_logits: ("weight", "pos_weight"),
    F.mse_loss: ("weight",),
    F.l1_loss: ("weight",),
    F.huber_loss: ("weight",),
}

LOSSES = (
    F.cross_entropy,
    F.nll_loss,
    F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits,
    F.mse_loss,
    F.l1_loss,
    F.smooth_l1_loss,
    F.huber_loss,
)

CLASS_TARGETS = (F.cross_entropy, F.nll_loss)  # a target of class indices: one dim fewer than the prediction


def losses(place: Callable[..., Placed]) -> dict:
    """Handlers of every loss in ``LOSSES`` whose operands ``place`` puts where this rank computes its terms."""
    return {fn: bound(_loss(fn, place), fn)[fn] for fn in LOSSES}


HANDLERS = losses(on_layout)

__all__ = ["CLASS_TARGETS", "HANDLERS", "LOSSES", "Placed", "losses", "on_layout"]
