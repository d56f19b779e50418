"""User ``torch.autograd.Function``s on shards: forward and backward both see SpatialTensors, saved tensors too.

``Function.apply`` enters C++ without ``__torch_function__``: a Function's forward sees shards (its torch ops go to
their handlers), but autograd hands its backward plain local gradients and plain saved outputs, which must not
meet shards. ``install`` wraps ``Function.apply``. A call with a SpatialTensor argument runs the Function's *twin*,
a subclass made once per Function class, which

- records the layouts of the forward's inputs and outputs and of the tensors saved for backward;
- gives backward its gradients and saved tensors as SpatialTensors again. Gradients keep the split convention
  (docs/design.md): an output's gradient is summed over the axes the output is replicated on, so backward sees
  the true gradient, as on one device;
- hands autograd back local gradients: a sharded input's local part, and along the axes an input is replicated
  on, its share (the true gradient divided by their size).

A Function written in torch ops is therefore exact: element-wise ones stay local, the others reach their ops'
handlers or the gather fallback (announced as usual). Code outside torch's dispatch (a C++/CUDA extension) sees
only the local shards: a plain output or gradient that no torch function returned raises rather than being taken
for a replicated value (a ``TorchFunctionMode`` records what torch functions return while the Function runs);
register a handler for such a Function class (``register_handler``).
Calls without a SpatialTensor argument run torch's ``apply`` unchanged, and so do torch's own Functions (a compiled
graph's runtime runs on the stored shards by design); under ``torch.compile`` dynamo traces a Function's forward
and backward itself.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch.autograd.function import Function, _is_setup_context_defined
from torch.overrides import TorchFunctionMode

from ..collectives import across
from ..layout import Layout, LayoutError
from ..registry import _HANDLERS
from ..tensor import _GRAPH_OPS, SpatialTensor, gather, settled, unwrap, wrap

_APPLY = Function.__dict__["apply"]  # torch's own (a C++ classmethod in 2.14, Python in 2.11)
_SAVED = torch._C._FunctionBase.saved_tensors.__get__
_TWINS: dict[type, type] = {}
_OUTPUTS: list[Any] = []  # the output layouts of the twins' forwards in flight, innermost last
_NOT_A_TENSOR = object()


def install() -> None:
    """Route ``Function.apply`` through ``apply`` (idempotent)."""
    if Function.__dict__["apply"] is _APPLY:
        Function.apply = classmethod(apply)


def apply(cls: type[Function], *args: Any, **kwargs: Any) -> Any:
    """``cls.apply``: torch's own unless an argument is a SpatialTensor; then a handler registered for ``cls``,
    else ``cls``'s twin, its outputs sharded as its forward returned them."""
    for a in args:
        if isinstance(a, SpatialTensor):
            break
    else:
        if not any(isinstance(v, SpatialTensor) for v in kwargs.values()):
            return _APPLY.__get__(None, cls)(*args, **kwargs)
    return _on_shards(cls, args, kwargs)


# Code dynamo traces sees ``cls.apply`` as torch's (it traces the Function's forward and backward itself). Where it
# breaks the graph there, compiled code calls ``apply`` at run time: dynamo must not compile that frame (skipped, the
# frames it calls are not), and the twin runs eagerly.
torch._dynamo.eval_frame.skip_code(apply.__code__)


@torch.compiler.disable
def _on_shards(cls: type[Function], args: tuple, kwargs: dict) -> Any:
    handler = _HANDLERS.get(cls)
    if handler is not None:
        return handler(*args, **kwargs)
    twin = _TWINS.get(cls) or _twin(cls)
    if twin is cls:  # torch's own, e.g. a compiled graph's runtime, which runs on the stored shards by design
        return _APPLY.__get__(None, cls)(*args, **kwargs)
    # a sum still pending (ops.pending) or a Selection enters as the shard or tensor it settles to: the twin's
    # gradient rules know shards and replicated tensors
    args = tuple(settled(a) for a in args)
    kwargs = {k: settled(v) for k, v in kwargs.items()}
    _OUTPUTS.append(())
    try:
        out = _APPLY.__get__(None, twin)(*args, **kwargs)
    finally:
        layouts = _OUTPUTS.pop()
    if isinstance(out, tuple):
        return tuple(_rewrapped(o, layout) for o, layout in zip(out, layouts))
    return _rewrapped(out, layouts[0])


def _rewrapped(out: Any, layout: Any) -> Any:
    """An output autograd returned as a plain alias (an input returned unchanged) gets its layout back."""
    if isinstance(layout, Layout) and type(out) is torch.Tensor:
        return wrap(out, layout)
    return out


class _ShardedCtx:
    """The twins' ctx: tensors saved for backward come back with their layouts."""

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
        self._saved_layouts = tuple(t._layout if isinstance(t, SpatialTensor) else None for t in tensors)
        super().save_for_backward(*tensors)

    @property
    def saved_tensors(self) -> tuple[torch.Tensor | None, ...]:
        saved = _SAVED(self)
        layouts = getattr(self, "_saved_layouts", None)
        return saved if layouts is None else tuple(_rewrapped(t, layout) for t, layout in zip(saved, layouts))


def _twin(cls: type[Function]) -> type[Function]:
    """``cls`` with forward, setup_context and backward wrapped as the module docstring says, made once; torch's
    own Functions stay as they are."""
    if cls.__module__.startswith("torch."):
        _TWINS[cls] = cls
        return cls
    setup_style = _is_setup_context_defined(cls.setup_context)
    by_vjp = cls.vjp is not Function.vjp
    boxed = getattr(cls, "boxed_grads_call", False)  # backward takes its gradients as one list (torch >= 2.14)

    def forward(*args: Any, **kwargs: Any) -> Any:
        inputs = args if setup_style else args[1:]
        with _Made() as made:
            out = cls.forward(*args, **kwargs)
        layouts = _output_layouts(cls, out, made, inputs)
        _OUTPUTS[-1] = layouts
        if not setup_style:
            _remember(args[0], inputs, layouts)
        return out

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> Any:
        _remember(ctx, inputs, _OUTPUTS[-1])
        return cls.setup_context(ctx, inputs, output)

    def backward(ctx: Any, *grads: Any) -> Any:
        axes = ctx._spatial_axes
        grads = [
            _true_gradient(g, layout, axes) for g, layout in zip(grads[0] if boxed else grads, ctx._output_layouts)
        ]
        with _Made() as made:
            result = (cls.vjp if by_vjp else cls.backward)(ctx, *([grads] if boxed else grads))
        single = not isinstance(result, tuple)
        result = (result,) if single else result
        for k, g in enumerate(result):
            if type(g) is torch.Tensor and not made.here(g) and not any(g is x for x in grads):
                _raise_outside(cls, f"the gradient of input {k}")
        local = (
            tuple(
                g if layout is _NOT_A_TENSOR else _local_gradient(cls, k, g, layout, axes)
                for k, (g, layout) in enumerate(zip(result, ctx._input_layouts))
            )
            + result[len(ctx._input_layouts) :]
        )
        return local[0] if single else local

    namespace = {"forward": staticmethod(forward), "vjp" if by_vjp else "backward": staticmethod(backward)}
    if setup_style:
        namespace["setup_context"] = staticmethod(setup_context)
    twin = type(cls)(
        cls.__name__, (cls,), {**namespace, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    )
    base = twin._backward_cls
    twin._backward_cls = type(base.__name__, (_ShardedCtx, base), {})
    _TWINS[cls] = twin
    return twin


def _remember(ctx: Any, inputs: tuple, output_layouts: tuple) -> None:
    ctx._input_layouts = tuple(_layout_or_marker(a) for a in inputs)
    ctx._output_layouts = output_layouts
    layouts = [x for x in (*ctx._input_layouts, *output_layouts) if isinstance(x, Layout)]
    ctx._spatial_axes = tuple(dict.fromkeys(s.axis for layout in layouts for s in layout.shards))


def _layout_or_marker(x: Any) -> Any:
    """A tensor's layout (``None``: replicated), or the marker of an argument that is not a tensor."""
    if isinstance(x, SpatialTensor):
        return x._layout
    return None if isinstance(x, torch.Tensor) else _NOT_A_TENSOR


class _Made(TorchFunctionMode):
    """Records the tensors torch functions return in a block: a plain result that is none of them was made outside
    torch's dispatch (an extension's kernel, which saw only the local shards). ``torch.ops`` calls on shards run on
    the local shards too (``SpatialTensor.__torch_function__``), so their results do not count."""

    def __enter__(self) -> _Made:
        self.made: dict[int, weakref.ref] = {}
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not isinstance(func, _GRAPH_OPS):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.made[id(t)] = weakref.ref(t)
        return out

    def here(self, t: torch.Tensor) -> bool:
        ref = self.made.get(id(t))
        return ref is not None and ref() is t


def _output_layouts(cls: type, out: Any, made: _Made, inputs: tuple) -> tuple:
    """Per output, its layout (``None``: replicated); a plain output made outside torch's dispatch raises."""
    outs = out if isinstance(out, tuple) else (out,)
    for k, o in enumerate(outs):
        if type(o) is torch.Tensor and not made.here(o) and not any(o is x for x in inputs):
            _raise_outside(cls, f"output {k}")
    return tuple(_layout_or_marker(o) for o in outs)


def _true_gradient(grad: torch.Tensor | None, layout: Any, axes: tuple) -> torch.Tensor | None:
    """The gradient backward sees: sharded like the output, summed over the axes the output is replicated on."""
    if grad is None or layout is _NOT_A_TENSOR:
        return grad
    replicated_on = _axes_off(layout, axes)
    if replicated_on:
        grad = across(grad, replicated_on)
    return wrap(grad, layout)


def _local_gradient(cls: type, k: int, grad: Any, layout: Layout | None, axes: tuple) -> Any:
    """Input ``k``'s gradient as autograd takes it: its local part, a share along the axes it is replicated on."""
    if grad is None:
        return None
    local, grad_layout = unwrap(grad)
    if grad_layout != layout:
        if grad_layout is not None:  # sharded otherwise than the input: the full gradient, then the input's part
            local = gather(grad)
        elif not all(local.dim() >= -s.dim and local.shape[s.dim] == s.extent for s in layout.shards):
            raise LayoutError(
                f"{cls.__qualname__}: backward returned a plain gradient of shape {tuple(local.shape)} for input {k}, "
                f"which is sharded [{layout.describe()}]: return the gradient with the input's global shape"
            )
        if layout is not None:
            local = layout.take_local(local)
    replicated_on = _axes_off(layout, axes)
    return local / math.prod(a.size for a in replicated_on) if replicated_on else local


def _axes_off(layout: Layout | None, axes: tuple) -> tuple:
    """The axes among ``axes`` that ``layout`` does not shard along."""
    on = () if layout is None else {s.axis for s in layout.shards}
    return tuple(a for a in axes if a not in on)


def _raise_outside(cls: type, what: str) -> None:
    raise LayoutError(
        f"{cls.__qualname__}: {what} was made outside torch's dispatch (a C++/CUDA extension's kernel, or a "
        "torch.ops call), which sees only this rank's shards of the sharded inputs: taken for a replicated result, it "
        "would be wrong. Register a handler for the Function "
        f"(lightning_spatial.register_handler({cls.__qualname__})) that runs it on x.to_local() and wraps the result, "
        "if it is element-wise, or on lightning_spatial.gather(x) otherwise"
    )


__all__ = ["apply", "install"]
