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


def _loss(fn):
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
        layout = common_layout(fn, [params[n] for n in names])
        for n in names:  # per-element weights follow the prediction's rows, like the target
            params[n] = unwrap(localize(fn, params[n], layout))[0]
        x, target = params[first], params[second]
        per_element = fn(**{**params, "reduction": "none"})
        shards = list(layout.shards)
        if reduction == "none":
            return adopt(per_element, layout)
        total = across(per_element.sum(), shards)
        if reduction == "sum":
            return total
        if fn in (F.cross_entropy, F.nll_loss) and not target.is_floating_point():
            denominator = across(_weighted_count(target, params.get("weight"), params["ignore_index"], x), shards)
        elif fn in (F.mse_loss, F.l1_loss) and params.get("weight") is not None:  # torch: sum(w * e) / sum(w)
            denominator = across(params["weight"].sum(), shards)
        else:
            denominator = layout.global_shape(per_element).numel()
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

HANDLERS = {fn: bound(_loss(fn), fn)[fn] for fn in LOSSES}

__all__ = ["HANDLERS"]
