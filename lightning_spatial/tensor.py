"""The sharded activation: a ``torch.Tensor`` whose data is this rank's shard, plus its layout.

``SpatialTensor`` stores only the local shard, but answers shape queries (``x.shape``, ``x.size()``,
``x.numel()``) with the *global* shape, so unchanged model code that computes sizes from shapes (views,
``F.interpolate(size=skip.shape[-2:])``, timm's ``pad_same``, position embeddings from ``torch.arange(W)``)
means what it means on one device. ``x.to_local()`` is the shard; ``x.shard_layout`` says which dims are
sharded, over which process group, with which global sizes (``layout.Layout``).

Every torch function called on it goes through ``__torch_function__``: a handler registered in ``HANDLERS``
(filled by ``ops.install()``: spatial ops, element-wise ops, metadata queries), or else the exact fallback:
gather, run, reshard, announced by a ``SpatialFallbackWarning`` (or an error, or nothing: ``fallback_mode``).
Under ``torch.compile`` dynamo traces the handlers themselves (``_traced``; docs/design.md, "torch.compile through
shards").
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal

import torch
import torch.compiler as _compiler
from torch._guards import _TLS as _TRACING
from torch.multiprocessing.reductions import reduce_tensor
from torch.utils._pytree import tree_flatten, tree_map

from .collectives import all_gather
from .layout import Axis, DimShard, Layout, LayoutError

# read once: every op of eager code calls them, here and in ops.elementwise (``is_dynamo_compiling`` is the
# function dynamo knows by identity)
_dynamo_compiling = torch.compiler.is_dynamo_compiling
_Plain = torch._C.DisableTorchFunctionSubclass


class SpatialTensor(torch.Tensor):
    """This rank's shard of an activation; see the module docstring."""

    _layout: Layout

    @property
    def shard_layout(self) -> Layout:
        return self._layout

    def to_local(self) -> torch.Tensor:
        """The shard as a plain tensor, still attached to the autograd graph."""
        if _dynamo_compiling():  # an op of the graph (``as_subclass`` is not traceable)
            return torch.ops.aten.alias.default(self)
        with _Plain():
            return self.as_subclass(torch.Tensor)

    def __repr__(self, *, tensor_contents=None) -> str:  # local: printing must not communicate
        return f"SpatialTensor(layout=[{self._layout.describe()}], local={self.to_local()!r})"

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a SpatialTensor holds one rank's shard; a file of it (torch.save, pickle) could not be loaded without "
            "its process group. Save lightning_spatial.gather(x) (call it on every rank of the group), or "
            "x.to_local() for this rank's shard alone"
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _dynamo_compiling():
            return _traced(func, args, kwargs or {})
        # Eager code, the path every op of an uncompiled step takes, is checked first. Not eager: dynamo runs code
        # of its own on a shard while it builds a graph (fake tensors, guards); torch 2.14 calls us then with
        # ``is_compiling()`` true, torch 2.11 with it false but inside its tracing context. (Flags read directly.)
        if not (_compiler._is_compiling_flag or getattr(_TRACING, "tracing_context", None) is not None):
            handler = _EAGER.get(func)
            if handler is not None:
                return handler(*args, **kwargs) if kwargs else handler(*args)
            if not isinstance(func, _GRAPH_OPS):
                return fallback(func, args, kwargs or {})
        # dynamo's reads; the ``torch.ops`` a compiled graph runs (dynamo traced them from our handlers, on the shards)
        with _Plain():
            return func(*args, **(kwargs or {}))


def _traced(func, args, kwargs):
    """``__torch_function__`` as dynamo traces it: the handler is found outside the trace (torch 2.11's dynamo
    cannot hash every key of ``HANDLERS``), its code is traced."""
    if isinstance(func, _GRAPH_OPS):
        with _Plain():
            return func(*args, **kwargs)
    position = _position(func)
    if position >= 0:
        return _BY_POSITION[position](*args, **kwargs)
    return fallback(func, args, kwargs)


@torch._dynamo.assume_constant_result
def _position(func: Callable) -> int:
    return _POSITIONS.get(func, -1)


def index_handlers() -> None:
    """Number the handlers for traced code, and make eager code's table (``ops.install``)."""
    _POSITIONS.clear()
    _POSITIONS.update({func: i for i, func in enumerate(HANDLERS)})
    _BY_POSITION[:] = HANDLERS.values()
    _EAGER.clear()
    _EAGER.update({f: _unless_a_compiled_graph_writes(f, h) if f in _INPUT_WRITES else h for f, h in HANDLERS.items()})


_POSITIONS: dict[Callable, int] = {}
_BY_POSITION: list[Callable] = []
_EAGER: dict[Callable, Callable] = {}  # HANDLERS, those of in-place writes guarded

_GRAPH_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)
_INPUT_WRITES = frozenset({torch.Tensor.copy_, torch.Tensor.as_strided_, torch.Tensor.set_})
_AOT_RUNTIME = os.path.dirname(torch._functorch.__file__)


def _unless_a_compiled_graph_writes(func: Callable, handler: Callable) -> Callable:
    """aot_autograd's runtime copies a compiled graph's result into a shard it mutated in place: a write of the
    graph's local result, done as it is."""

    def write(*args, **kwargs):
        if sys._getframe(2).f_code.co_filename.startswith(_AOT_RUNTIME):  # this, __torch_function__, its caller
            with _Plain():
                return func(*args, **kwargs)
        return handler(*args, **kwargs)

    return write


def _rebuild(rebuild: Callable, args: tuple, layout: Layout) -> SpatialTensor:
    return wrap(rebuild(*args), layout)


def _reduce_for_worker(x: SpatialTensor):
    """DataLoader workers send batches of shards through shared memory, as torch sends any tensor; an ``Axis``
    finds its process group again by its ranks in the receiving process."""
    return _rebuild, (*reduce_tensor(x.to_local()), x._layout)


ForkingPickler.register(SpatialTensor, _reduce_for_worker)

# Handlers by torch function; filled explicitly by ``ops.install()``.
HANDLERS: dict[Callable, Callable] = {}


def wrap(local: torch.Tensor, layout: Layout | None) -> torch.Tensor:
    """Attach ``layout`` to a local shard (autograd-transparent); ``None`` means replicated (plain)."""
    if layout is None:
        return local
    if type(local) is torch.Tensor:  # no subclass to dispatch: skip the guard's context manager
        out = local.as_subclass(SpatialTensor)
    else:
        with _Plain():
            out = local.as_subclass(SpatialTensor)
    out._layout = layout
    return out


def adopt(out: torch.Tensor, layout: Layout | None) -> torch.Tensor:
    """``wrap`` for a tensor the caller has just computed and nothing else holds: it becomes the SpatialTensor
    itself instead of getting an alias (``as_subclass`` makes a new tensor: ~0.7 us per op on the host). Never
    pass a tensor that user code may hold (an operand returned unchanged, a parameter): use ``wrap``."""
    if layout is None:
        return out
    if type(out) is not torch.Tensor or _dynamo_compiling():
        return wrap(out, layout)
    out.__class__ = SpatialTensor
    out._layout = layout
    return out


def on_shard(func: Callable, *args: Any, **kwargs: Any) -> Any:
    """``func`` with every SpatialTensor argument read as its shard, without making plain aliases of them
    (``to_local``); the results are plain tensors, but an operand returned (in place) is returned as it is.

    Under dynamo the shards are read through plain aliases: dynamo types what an in-place op returns under
    disabled torch function as a plain tensor and puts it in place of every reference to the operand, which
    would lose the shard's layout in the code being traced."""
    if not _dynamo_compiling():
        with _Plain():
            return func(*args, **kwargs)
    local = [a.to_local() if isinstance(a, SpatialTensor) else a for a in args]
    named = {k: v.to_local() if isinstance(v, SpatialTensor) else v for k, v in kwargs.items()}
    out = func(*local, **named)
    for given, alias in (*zip(args, local), *((kwargs[k], named[k]) for k in kwargs)):
        if out is alias and alias is not given:
            return given
    return out


def unwrap(x: Any) -> tuple[Any, Layout | None]:
    if isinstance(x, SpatialTensor):
        return x.to_local(), x._layout
    return x, None


def shard(tensor: torch.Tensor, dims: Mapping[int, Axis]) -> SpatialTensor:
    """This rank's slice of a full (replicated) tensor, sharding each dim in ``dims`` over its axis."""
    shards = []
    for dim, axis in dims.items():
        neg = dim - tensor.dim() if dim >= 0 else dim
        if not -tensor.dim() <= neg < 0:
            raise LayoutError(f"cannot shard dim {dim} of a {tensor.dim()}-d tensor")
        if tensor.shape[neg] < axis.size:
            raise LayoutError(
                f"dim {dim} has size {tensor.shape[neg]}, smaller than its {axis.size} ranks: every rank needs "
                f"at least one row; use fewer ranks along this dim or a larger input"
            )
        shards.append(DimShard(neg, axis, tensor.shape[neg]))
    layout = Layout(tuple(shards))
    return wrap(layout.take_local(tensor), layout)


def gather(x: torch.Tensor) -> torch.Tensor:
    """The full tensor on every rank (differentiable; plain tensors are returned as they are)."""
    local, layout = unwrap(x)
    if layout is None:
        return local
    for dim in layout.dims:
        factors = layout.factors(dim)
        pos = local.dim() + dim
        if len(factors) > 1:  # a merged dim: gather each sharded factor, then merge again in global order
            local = local.unflatten(pos, [s.stop - s.start if s else n for n, s in factors])
        for k, (n, s) in enumerate(factors):
            if s is not None:
                local = all_gather(local, pos + k, s.axis, n)
        if len(factors) > 1:
            local = local.flatten(pos, pos + len(factors) - 1)
    return local


def common_layout(func: Callable, operands) -> Layout:
    """The one layout of the sharded operands (raises if two differ)."""
    layout = None
    for t in operands:
        if isinstance(t, SpatialTensor):
            if layout is None:
                layout = t._layout
            elif t._layout != layout:
                raise LayoutError(
                    f"{name_of(func)}: operands have different layouts [{layout.describe()}] and "
                    f"[{t._layout.describe()}]; reshard one (gather + shard) so both match"
                )
    assert layout is not None
    return layout


def localize(func: Callable, t: Any, layout: Layout) -> Any:
    """A replicated operand as this rank sees it next to ``layout``: size 1 along a sharded dim
    broadcasts; the full global size is cut to this rank's part; anything else is an error."""
    if not isinstance(t, torch.Tensor) or isinstance(t, SpatialTensor):
        return t
    try:
        cut = layout.cut_for(t.shape)
    except LayoutError as e:
        raise LayoutError(f"{name_of(func)}: {e}") from None
    return t if cut is None else cut.take_local(t)


# -- the fallback: exact, announced, controllable ---------------------------------------------------------


class SpatialFallbackWarning(UserWarning):
    """An op without a spatial handler gathered full tensors on every rank (exact, but costs memory and
    communication). Filter it, or turn it into an error, like any warning (``warnings.filterwarnings``)."""


FallbackMode = Literal["warn", "error", "silent"]
_mode: FallbackMode = "warn"
_warned: set[tuple[str, str]] = set()  # (op, module) pairs announced in "warn" mode
# Module paths by id(module), registered by the strategy: a fallback names the layer it happened in.
module_names: dict[int, str] = {}
_OURS = (__file__.rsplit("/", 1)[0], torch.__file__.rsplit("/", 1)[0])  # frames a warning should not point at


def set_fallback_mode(mode: FallbackMode) -> FallbackMode:
    """What an op without a spatial handler does from now on; returns the previous mode. ``"warn"``: gather
    and warn once per op and module (a ``SpatialFallbackWarning``); ``"error"``: raise before any
    communication; ``"silent"``: gather quietly. A process-wide setting, as the strategy's ``fallback=``."""
    global _mode
    if mode not in ("warn", "error", "silent"):
        raise ValueError(f"fallback must be 'warn', 'error' or 'silent', got {mode!r}")
    previous, _mode = _mode, mode
    return previous


@contextmanager
def fallback_mode(mode: FallbackMode) -> Iterator[None]:
    """``set_fallback_mode`` for a block of code."""
    previous = set_fallback_mode(mode)
    try:
        yield
    finally:
        set_fallback_mode(previous)


def _where() -> str:
    """The innermost registered module whose ``forward`` is on the stack (frames are only read here)."""
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in module_names:
            return f" in module '{module_names[id(owner)]}' ({type(owner).__name__})"
        frame = frame.f_back
    return ""


def _caller_level() -> int:
    """``stacklevel`` of the first frame outside lightning_spatial and torch: the user's line that ran the op."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_OURS):
        frame, level = frame.f_back, level + 1
    return level


def _size(n: float) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}"


def _announce(func: Callable, operands: list[SpatialTensor]) -> None:
    """Name the op, the layer and the bytes a fallback gathers: a warning (once per op and layer) or, in
    ``"error"`` mode, an error raised before any communication."""
    if _mode == "silent":
        return
    name, where = name_of(func), _where()
    if _mode == "warn" and (name, where) in _warned:
        return
    gathered = _size(sum(_global_bytes(t) for t in operands))
    count = f"{len(operands)} sharded operand{'s' if len(operands) > 1 else ''}"
    avoid = (
        "Exact, but it costs memory and communication. To avoid it use an op with a spatial handler (docs/ops.md), "
        "or call lightning_spatial.gather(x) where the full tensor is meant"
    )
    if _mode == "error":
        raise LayoutError(
            f"lightning_spatial: {name}{where} has no spatial handler, and fallbacks are errors (fallback_mode "
            f"'error'): it would gather {gathered} ({count}) on every rank and run on the full tensors. {avoid}"
        )
    warnings.warn(
        f"lightning_spatial: {name}{where} has no spatial handler; gathering {gathered} ({count}) on every rank, "
        f"running it on the full tensors and resharding the result. {avoid}; fallback_mode('error') or "
        "warnings.filterwarnings('error', category=SpatialFallbackWarning) makes it an error",
        SpatialFallbackWarning,
        stacklevel=_caller_level(),
    )
    _warned.add((name, where))  # only once announced: a filter that raised leaves the next call to raise too


def _global_bytes(t: SpatialTensor) -> int:
    with _Plain():
        local = t.shape
    return t._layout.global_shape(local).numel() * t.element_size()


@torch.compiler.disable  # compiled code breaks its graph here and runs the fallback as eager code does
def fallback(func, args, kwargs):
    """Exact but slow: gather every sharded operand, run ``func`` on full tensors, reshard the results.

    A result with the global shape of the first sharded operand is sharded like it; anything else is
    replicated (every rank computed the same value). An op that writes into a tensor (in place, ``out=``)
    writes its local part back into a sharded target, and the whole of a replicated one.
    """
    flat, _ = tree_flatten((args, kwargs))
    operands = [t for t in flat if isinstance(t, SpatialTensor)]
    layout, shape = operands[0]._layout, operands[0]._layout.global_shape(operands[0].to_local())
    _announce(func, operands)
    full_args, full_kwargs = tree_map(lambda t: gather(t) if isinstance(t, SpatialTensor) else t, (args, kwargs))
    target, full_target = (args[0], full_args[0]) if is_inplace(func) else (kwargs.get("out"), full_kwargs.get("out"))
    with _Plain():
        out = func(*full_args, **full_kwargs)
    if isinstance(target, SpatialTensor):
        return on_shard(torch.Tensor.copy_, target, target._layout.take_local(full_target))
    if isinstance(target, torch.Tensor):  # a replicated target was written whole
        return target

    def reshard(o):
        if isinstance(o, torch.Tensor) and o.shape == shape:
            return wrap(layout.take_local(o), layout)
        return o

    return tree_map(reshard, out)


# Where torch's builtins live -> where users call them from.
_PUBLIC = {
    "torch._C._nn": "torch.nn.functional",
    "torch._C._linalg": "torch.linalg",
    "torch._C._special": "torch.special",
    "torch._C._fft": "torch.fft",
    "torch.functional": "torch",
}


def name_of(func: Callable) -> str:
    """The name a user calls ``func`` by: ``torch.flip``, ``Tensor.sum``, ``torch.linalg.vector_norm``, ``Tensor.T``."""
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor":  # a property's getter or setter
        return f"Tensor.{owner.__name__}" + (" (assignment)" if func.__name__ == "__set__" else "")
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    module = getattr(func, "__module__", None) or ""
    if qual.startswith(("_TensorBase.", "TensorBase.")):
        return "Tensor." + qual.split(".", 1)[1]
    if qual.startswith("_VariableFunctionsClass."):
        return "torch." + qual.split(".", 1)[1]
    if module in _PUBLIC:
        public = _PUBLIC[module]
        return f"{public}.{qual.removeprefix(public.rsplit('.', 1)[-1] + '_')}"
    return f"{module}.{qual}" if module else qual


def is_inplace(func: Callable) -> bool:
    name = getattr(func, "__name__", "")
    return (
        name == "__setitem__"
        or (name.startswith("__i") and name.endswith("__"))
        or (name.endswith("_") and not name.endswith("__"))
    )


__all__ = [
    "HANDLERS",
    "SpatialFallbackWarning",
    "SpatialTensor",
    "common_layout",
    "fallback",
    "fallback_mode",
    "gather",
    "localize",
    "set_fallback_mode",
    "shard",
    "unwrap",
    "wrap",
]
