"""Per-pixel losses on sharded predictions and targets: torch's own loss per element, reduced globally.

``reduction='none'`` stays sharded; ``'sum'`` all-reduces the local sum; ``'mean'`` divides the global sum
by the global denominator torch would use (the element count, or for ``cross_entropy``/``nll_loss`` the
summed class weights of the non-ignored targets). Losses built from element-wise ops and ``mean``/``sum``
(torchvision's ``sigmoid_focal_loss``) need no handler: the reduction handlers make them exact.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from ..collectives import across
from ..layout import LayoutError
from ..tensor import common_layout, localize, unwrap, wrap


def _weighted_count(target: torch.Tensor, weight, ignore_index: int, logits: torch.Tensor) -> torch.Tensor:
    """torch's 'mean' denominator for class-index targets: sum of weight[target] over non-ignored targets."""
    keep = target != ignore_index
    if weight is None:
        return keep.sum().to(logits.dtype)
    return (weight[target.clamp(0, weight.numel() - 1)] * keep).sum()


def _loss(fn):
    signature = inspect.signature(fn)

    def loss(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        params = {k: v for k, v in bound.arguments.items() if k not in ("size_average", "reduce")}
        reduction = params.get("reduction", "mean")
        first, second = list(signature.parameters)[:2]
        layout = common_layout(fn, [params[first], params[second]])
        x, target = (unwrap(localize(fn, params[n], layout))[0] for n in (first, second))
        for name in ("weight", "pos_weight"):
            if isinstance(params.get(name), torch.Tensor) and unwrap(params[name])[1] is not None:
                raise LayoutError(f"{fn.__name__}: {name} is sharded; pass it replicated")
        for name in _ELEMENTWISE_WEIGHTS.get(fn, ()):  # per-element weights follow the prediction's rows
            params[name] = localize(fn, params[name], layout)
        params.update({first: x, second: target, "reduction": "none"})
        per_element = fn(**params)
        shards = list(layout.shards)
        if reduction == "none":
            return wrap(per_element, layout)
        total = across(per_element.sum(), shards)
        if reduction == "sum":
            return total
        if fn in (F.cross_entropy, F.nll_loss) and not target.is_floating_point():
            denominator = across(_weighted_count(target, params.get("weight"), params["ignore_index"], x), shards)
        else:
            denominator = layout.global_shape(per_element).numel()
        return total / denominator

    loss.__name__ = fn.__name__
    return loss


# Weights that broadcast against the prediction (unlike cross_entropy's per-class weight).
_ELEMENTWISE_WEIGHTS = {
    F.binary_cross_entropy: ("weight",),
    F.binary_cross_entropy_with_logits: ("weight", "pos_weight"),
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

HANDLERS = {fn: _loss(fn) for fn in LOSSES}

__all__ = ["HANDLERS"]
