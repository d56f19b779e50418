"""What ``torch.compile`` needs to trace code on shards.

Dynamo traces a ``SpatialTensor`` as the plain tensor it stores (its shard), and inlines our
``__torch_function__``: the op layer is Python, so the graph holds what the handlers do on the shards, with halo
exchanges and collectives as custom ops (``halo``, ``collectives``). While dynamo builds a graph, its own reads of
a shard (fakes, guards) see the stored tensor (``tensor.SpatialTensor.__torch_function__``).

Two behaviours of torch itself are adjusted here, for ``SpatialTensor`` only, each checked by
``tests/test_compile.py``:

- Dynamo runs a subclass's ``__torch_function__`` with subclass dispatch off (torch >= 2.14,
  ``is_subclass_dispatch``), as torch's default ``Tensor.__torch_function__`` does. Eager torch keeps it on for an
  override, and our handlers rely on it: a handler may call torch functions on shards (``topk`` takes values along
  global indices; ``multi_head_attention_forward`` runs torch's own Python on shards). Without it, those calls
  would be traced as plain ops on the shards.
- aot_autograd's first-call check of custom ops (``_AnalyzeCustomOpInputOutputMode``) declines tensors of any class
  but ``Tensor``, so a graph given a shard failed on its first call; at the dispatcher a shard is a plain tensor.

Our plans are not ``lru_cache``-wrapped (dynamo would warn for each it traces): ``plans.planned`` computes them
while dynamo traces, without a warning.
"""

from __future__ import annotations

import inspect

from .tensor import SpatialTensor


def _keep_subclass_dispatch() -> None:
    from torch._dynamo.variables import torch_function as tf

    if "is_subclass_dispatch" not in inspect.signature(tf.call_torch_function).parameters:
        return  # this torch traces __torch_function__ overrides as eager torch runs them
    original = tf.TensorWithTFOverrideVariable.call_torch_function

    def call_torch_function(self, tx, fn, types, args, kwargs):
        if not issubclass(self.class_type, SpatialTensor):
            return original(self, tx, fn, types, args, kwargs)
        if not hasattr(self, "torch_function_fn"):
            self.torch_function_fn = tf.get_torch_function_fn(tx, self)
        return tf.call_torch_function(tx, self.torch_function_fn, fn, types, args, kwargs)

    tf.TensorWithTFOverrideVariable.call_torch_function = call_torch_function


def _shards_are_tensors_at_the_dispatcher() -> None:
    from torch._functorch._aot_autograd import runtime_wrappers

    handled = getattr(runtime_wrappers, "HANDLED_TYPES", None)
    if handled is not None and SpatialTensor not in handled:
        runtime_wrappers.HANDLED_TYPES = (*handled, SpatialTensor)


def install() -> None:
    _keep_subclass_dispatch()
    _shards_are_tensors_at_the_dispatcher()


__all__ = ["install"]
