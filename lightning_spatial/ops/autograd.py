"""Gradients with respect to sharded tensors (saliency maps, adversarial inputs) are sharded like them.

Under the split-gradient convention (docs/design.md) a replicated value's gradient is held as shares across
the spatial group that sum to it. ``torch.autograd.grad`` therefore seeds a replicated output (a loss) with
``1/S`` of its gradient on each of the ``S`` ranks, as the strategy's ``backward`` does, so the gradient of a
sharded input is exactly its part of the true gradient, returned sharded like the input; ``x.grad`` of a
sharded leaf is returned sharded like ``x`` too. A replicated input's (a weight's) gradient is this rank's
share: sum it over the spatial group for the true gradient. ``torch.autograd.backward`` and ``y.backward(g)`` on
sharded outputs (reentrant checkpointing calls them) seed the same way.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.graph import get_gradient_edge

from ..tensor import SpatialTensor, unwrap, wrap
from ._common import localize

_GRAD = torch.Tensor.grad.__get__


def grad_of(x: SpatialTensor):
    """``x.grad``, sharded like ``x``."""
    with torch._C.DisableTorchFunctionSubclass():
        g = _GRAD(x)
    return wrap(g, x.shard_layout) if g is not None and type(g) is torch.Tensor else g


def autograd_grad(outputs, inputs, grad_outputs=None, **kwargs):
    single = isinstance(inputs, torch.Tensor)
    inputs = (inputs,) if single else tuple(inputs)
    outputs, seeds = _seeded(outputs, grad_outputs, inputs)
    grads = torch.autograd.grad(_plain(outputs), _edges(inputs), seeds, **kwargs)
    return tuple(
        wrap(unwrap(g)[0], x.shard_layout) if isinstance(x, SpatialTensor) and g is not None else g
        for x, g in zip(inputs, grads)
    )


def autograd_backward(
    tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None, inputs=None
):
    """``torch.autograd.backward`` (``y.backward(g)``, reentrant checkpointing) seeded as ``autograd_grad``; the
    gradients of sharded leaves accumulate sharded like them (``x.grad``)."""
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs or ())
    tensors, seeds = _seeded(tensors, grad_variables if grad_tensors is None else grad_tensors, inputs)  # legacy name
    torch.autograd.backward(_plain(tensors), seeds, retain_graph, create_graph, inputs=_edges(inputs) or None)


def tensor_backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    autograd_backward(self, gradient, retain_graph, create_graph, inputs=inputs)


def _plain(outputs: tuple) -> tuple:
    """Outputs as plain aliases (still in the graph), so that torch runs the engine itself instead of asking our
    handler again. The engine runs with torch function on: code that runs inside the backward (the forward that
    ``torch.utils.checkpoint`` recomputes, a user's autograd Function) dispatches on shards as in the forward."""
    return tuple(o.to_local() if isinstance(o, SpatialTensor) else o for o in outputs)


def _edges(inputs: tuple) -> tuple:
    """Inputs as the graph's edges to them (a plain alias would be a new node that no output depends on)."""
    with torch._C.DisableTorchFunctionSubclass():
        return tuple(get_gradient_edge(x) if isinstance(x, SpatialTensor) else x for x in inputs)


def _seeded(outputs, grad_outputs, inputs) -> tuple[tuple, list]:
    """The outputs and their seeds: local parts of sharded outputs' gradients, shares of replicated ones'."""
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    if grad_outputs is None or isinstance(grad_outputs, torch.Tensor):
        grad_outputs = (grad_outputs,) * len(outputs) if grad_outputs is None else (grad_outputs,)
    axes = {s.axis for t in (*outputs, *inputs) if isinstance(t, SpatialTensor) for s in t.shard_layout.shards}
    spatial = math.prod([a.size for a in axes])
    return outputs, [_seed(o, g, spatial) for o, g in zip(outputs, grad_outputs)]


def _seed(output: torch.Tensor, grad, spatial: int):
    """A sharded output's gradient is its local part; a replicated output's is split over the group."""
    if isinstance(output, SpatialTensor):
        return None if grad is None else unwrap(localize(torch.autograd.grad, grad, output.shard_layout))[0]
    if grad is None:  # torch makes the implicit gradient of a scalar only (and raises for others itself)
        return torch.ones_like(output) / spatial if output.numel() == 1 else None
    return unwrap(grad)[0] / spatial


HANDLERS = {
    _GRAD: grad_of,
    torch.autograd.grad: autograd_grad,
    torch.autograd.backward: autograd_backward,
    torch.Tensor.backward: tensor_backward,
}

__all__ = ["HANDLERS", "autograd_backward", "autograd_grad", "grad_of", "tensor_backward"]
