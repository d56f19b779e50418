"""The sharded activation: a ``torch.Tensor`` whose data is this rank's shard, plus its layout.

``SpatialTensor`` stores only the local shard, but answers shape queries (``x.shape``, ``x.size()``,
``x.numel()``) with the *global* shape, so unchanged model code that computes sizes from shapes (views,
``F.interpolate(size=skip.shape[-2:])``, timm's ``pad_same``, position embeddings from ``torch.arange(W)``)
means what it means on one device. ``x.to_local()`` is the shard; ``x.shard_layout`` says which dims are
sharded, over which process group, with which global sizes. Every torch function called on it goes
through ``__torch_function__``:

1. a registered spatial handler (``ops/``) if there is one;
2. element-wise ops run on the local shard and keep the layout; a replicated operand broadcasts along a
   sharded dim (size 1) or is sliced to this rank's rows (full global size);
3. metadata queries answer for the global tensor (shape) or the shard (device, dtype, autograd);
4. anything else falls back exactly: gather, run, reshard, with a one-time warning naming the op.

Sharded dims are stored as negative dims so that broadcasting (which aligns from the right) keeps them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

from .collectives import all_gather
from .layout import partition


class LayoutError(ValueError):
    """Raised before any communication when tensors or arguments cannot be sharded as asked."""


# Process groups by their global ranks: an Axis pickles as plain ranks (DataLoader workers build
# layouts) and finds its group again in the process that communicates.
_GROUPS: dict[tuple[int, ...], Any] = {}


@dataclass(frozen=True)
class Axis:
    """One mesh axis as seen from this rank: its global ranks (in group order) and our index among them."""

    ranks: tuple[int, ...]
    index: int

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None) -> Axis:
        group = group or dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(group))
        _GROUPS[ranks] = group
        return cls(ranks, dist.get_rank(group))

    @property
    def group(self) -> dist.ProcessGroup:
        try:
            return _GROUPS[self.ranks]
        except KeyError:
            raise RuntimeError(
                f"no process group for ranks {self.ranks} in this process; build it with Axis.from_group"
            ) from None

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class DimShard:
    """Tensor dim ``dim`` (negative) of global size ``size`` is split over ``axis`` by the partition rule."""

    dim: int
    axis: Axis
    size: int

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        return partition(self.size, self.axis.size)

    @property
    def start(self) -> int:
        return self.bounds[self.axis.index][0]

    @property
    def stop(self) -> int:
        return self.bounds[self.axis.index][1]


@dataclass(frozen=True)
class Layout:
    """Which dims of a tensor are sharded (sorted, negative dims), each over its own mesh axis."""

    shards: tuple[DimShard, ...]

    def __post_init__(self) -> None:
        dims = [s.dim for s in self.shards]
        if any(d >= 0 for d in dims) or len(set(dims)) != len(dims):
            raise LayoutError(f"sharded dims must be distinct negative dims, got {dims}")
        axes = [s.axis.ranks for s in self.shards]
        if len(set(axes)) != len(axes):
            raise LayoutError("two dims cannot be sharded over the same mesh axis")
        object.__setattr__(self, "shards", tuple(sorted(self.shards, key=lambda s: s.dim)))

    def get(self, dim: int) -> DimShard | None:
        for s in self.shards:
            if s.dim == dim:
                return s
        return None

    def global_shape(self, local: torch.Tensor | torch.Size) -> torch.Size:
        shape = list(local.shape if isinstance(local, torch.Tensor) else local)
        for s in self.shards:
            shape[s.dim] = s.size
        return torch.Size(shape)

    def with_sizes(self, sizes: Mapping[int, int]) -> Layout | None:
        """Same axes with new global sizes; a size of ``None`` drops that dim's sharding (replicated)."""
        return _with_sizes(self, tuple(sizes.items()))

    def local_slices(self, ndim: int) -> tuple[slice, ...]:
        index = [slice(None)] * ndim
        for s in self.shards:
            index[s.dim] = slice(s.start, s.stop)
        return tuple(index)

    def describe(self) -> str:
        return ", ".join(f"dim {s.dim} ({s.size} over {s.axis.size} ranks {s.axis.ranks})" for s in self.shards)


@lru_cache(maxsize=4096)
def _with_sizes(layout: Layout, sizes: tuple[tuple[int, int | None], ...]) -> Layout | None:
    """``Layout.with_sizes``, built once per layout and sizes: ops call it every step."""
    new = dict(sizes)
    shards = [DimShard(s.dim, s.axis, new.get(s.dim, s.size)) for s in layout.shards if new.get(s.dim, 0) is not None]
    return Layout(tuple(shards)) if shards else None


class SpatialTensor(torch.Tensor):
    """This rank's shard of an activation; see the module docstring."""

    _layout: Layout

    @property
    def shard_layout(self) -> Layout:
        return self._layout

    def to_local(self) -> torch.Tensor:
        """The shard as a plain tensor, still attached to the autograd graph."""
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor)

    def __repr__(self, *, tensor_contents=None) -> str:  # local: printing must not communicate
        return f"SpatialTensor(layout=[{self._layout.describe()}], local={self.to_local()!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if func in _LOCAL:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _GLOBAL_SHAPE:
            return _GLOBAL_SHAPE[func](args[0], *args[1:], **kwargs)
        if func in POINTWISE or (func in _LAYOUT_PRESERVING and not _is_nonzero_where(func, args, kwargs)):
            return _elementwise(func, args, kwargs)
        return fallback(func, args, kwargs)


# Op handlers by torch function; filled explicitly by ``ops.install()``.
HANDLERS: dict[Callable, Callable] = {}


def wrap(local: torch.Tensor, layout: Layout | None) -> torch.Tensor:
    """Attach ``layout`` to a local shard (autograd-transparent); ``None`` means replicated (plain)."""
    if layout is None:
        return local
    with torch._C.DisableTorchFunctionSubclass():
        out = local.as_subclass(SpatialTensor)
    out._layout = layout
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
    return wrap(tensor[layout.local_slices(tensor.dim())], layout)


def gather(x: torch.Tensor) -> torch.Tensor:
    """The full tensor on every rank (differentiable; plain tensors are returned as they are)."""
    local, layout = unwrap(x)
    if layout is None:
        return local
    for s in layout.shards:
        local = all_gather(local, s.dim, s.axis.group, s.size)
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
                    f"{_name(func)}: operands have different layouts [{layout.describe()}] and "
                    f"[{t._layout.describe()}]; reshard one (gather + shard) so both match"
                )
    assert layout is not None
    return layout


def localize(func: Callable, t: Any, layout: Layout) -> Any:
    """A replicated operand as this rank sees it next to ``layout``: size 1 along a sharded dim
    broadcasts; the full global size is sliced to this rank's rows; anything else is an error."""
    if not isinstance(t, torch.Tensor) or isinstance(t, SpatialTensor):
        return t
    for s in layout.shards:
        if t.dim() < -s.dim or t.shape[s.dim] == 1:
            continue
        if t.shape[s.dim] != s.size:
            raise LayoutError(
                f"{_name(func)}: a replicated tensor of shape {tuple(t.shape)} meets a tensor sharded along dim "
                f"{s.dim} of global size {s.size}; it must have size 1 (broadcast) or {s.size} there"
            )
        t = t.narrow(s.dim, s.start, s.stop - s.start)
    return t


def _elementwise(func, args, kwargs):
    layout = common_layout(func, [*args, *kwargs.values()])
    args = [localize(func, a, layout) for a in args]
    if kwargs:
        kwargs = {k: localize(func, v, layout) for k, v in kwargs.items()}
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    if args and out is args[0]:  # in-place: the operand already carries its layout
        return out
    if type(out) is torch.Tensor:  # the common case, without a pytree walk
        return wrap(out, layout)
    return tree_map(lambda o: wrap(o, layout) if isinstance(o, torch.Tensor) else o, out)


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def fallback(func, args, kwargs):
    """Exact but slow: gather every sharded operand, run ``func`` on full tensors, reshard the results.

    A result with the global shape of the first sharded operand is sharded like it; anything else is
    replicated (every rank computed the same value). In-place ops write the local slice back.
    """
    flat, _ = tree_flatten((args, kwargs))
    layout, shape = next((t._layout, t._layout.global_shape(t)) for t in flat if isinstance(t, SpatialTensor))
    name = _name(func)
    warn_once(
        name,
        f"lightning_spatial: {name} has no spatial handler; gathering the full tensor, running it on every rank "
        f"and resharding the result (exact, but costs memory and communication)",
    )
    full_args, full_kwargs = tree_map(lambda t: gather(t) if isinstance(t, SpatialTensor) else t, (args, kwargs))
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*full_args, **full_kwargs)
        if _is_inplace(func) and isinstance(args[0], SpatialTensor):
            target = args[0]
            target.copy_(full_args[0][target._layout.local_slices(full_args[0].dim())])
            return target

    def reshard(o):
        if isinstance(o, torch.Tensor) and o.shape == shape:
            return wrap(o[layout.local_slices(o.dim())], layout)
        return o

    return tree_map(reshard, out)


def _is_nonzero_where(func: Callable, args, kwargs) -> bool:
    """``torch.where(condition)`` returns global indices, not an element-wise result."""
    return func is torch.where and len(args) + len(kwargs) == 1


def _name(func: Callable) -> str:
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    module = getattr(func, "__module__", None) or ""
    if qual.startswith("_TensorBase.") or qual.startswith("TensorBase."):
        qual = "Tensor." + qual.split(".", 1)[1]
    return f"{module}.{qual}" if module and not qual.startswith("Tensor.") else qual


def _is_inplace(func: Callable) -> bool:
    name = getattr(func, "__name__", "")
    return (
        name == "__setitem__"
        or (name.startswith("__i") and name.endswith("__"))
        or (name.endswith("_") and not name.endswith("__"))
    )


def _pointwise_names() -> set[str]:
    """Names of aten ops tagged pointwise (binary ``max``/``min``/``where`` overloads excluded: they share
    a name with reductions or with index-returning forms)."""
    names = set()
    for name in dir(torch.ops.aten):
        if name.startswith("_"):
            continue
        try:
            packet = getattr(torch.ops.aten, name)
            overloads = [getattr(packet, o) for o in packet.overloads()]
        except (AttributeError, RuntimeError):
            continue
        if any(torch.Tag.pointwise in o.tags for o in overloads):
            names.add(name)
    return names - {"max", "min", "where"}


def _functions(names, namespaces) -> set[Callable]:
    return {getattr(ns, n) for n in names for ns in namespaces if hasattr(ns, n)}


_DUNDERS = [
    f"__{p}{op}__"
    for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift")
    for p in ("", "r", "i")
] + ["__neg__", "__pos__", "__abs__", "__invert__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"]

_ACTIVATIONS = [
    "relu",
    "relu_",
    "relu6",
    "gelu",
    "silu",
    "mish",
    "hardswish",
    "hardsigmoid",
    "hardtanh",
    "leaky_relu",
    "elu",
    "selu",
    "celu",
    "sigmoid",
    "tanh",
    "softplus",
    "softsign",
    "tanhshrink",
    "threshold",
    "logsigmoid",
    "glu_",
]

POINTWISE: frozenset[Callable] = frozenset(
    _functions(_pointwise_names(), (torch, torch.Tensor, torch.special))
    | _functions((n + "_" for n in _pointwise_names()), (torch.Tensor,))
    | _functions(_DUNDERS, (torch.Tensor,))
    | _functions(_ACTIVATIONS, (torch.nn.functional,))
)

# Results keep the operand's layout although aten does not tag these pointwise (``where`` only in its
# three-operand form: see ``_is_nonzero_where``).
_LAYOUT_PRESERVING: frozenset[Callable] = frozenset(
    _functions(
        [
            "contiguous",
            "detach",
            "detach_",
            "to",
            "type",
            "type_as",
            "float",
            "double",
            "half",
            "bfloat16",
            "cpu",
            "cuda",
            "pin_memory",
            "zero_",
            "fill_",
            "requires_grad_",
            "zeros_like",
            "ones_like",
            "full_like",
            "empty_like",
            "where",
            "masked_fill_",
        ],
        (torch, torch.Tensor),
    )
)


def _global_size(x: SpatialTensor, dim: int | None = None):
    with torch._C.DisableTorchFunctionSubclass():
        local = x.shape  # the shard's own sizes, without making a plain alias of it
    shape = x._layout.global_shape(local)
    return shape if dim is None else shape[dim]


_DESCRIPTORS = [n for n in dir(torch.Tensor) if type(getattr(torch.Tensor, n)).__name__ == "getset_descriptor"]

# Answered for the global tensor.
_GLOBAL_SHAPE: dict[Callable, Callable] = {
    torch.Tensor.shape.__get__: lambda x: _global_size(x),
    torch.Tensor.size: _global_size,
    torch.Tensor.numel: lambda x: _global_size(x).numel(),
    torch.Tensor.nelement: lambda x: _global_size(x).numel(),
    torch.numel: lambda x: _global_size(x).numel(),
    torch.Tensor.__len__: lambda x: _global_size(x, 0),
}

# Answered by the local shard: metadata, autograd plumbing, serialisation, new replicated tensors.
_LOCAL: frozenset[Callable] = frozenset(
    (
        {getattr(torch.Tensor, n).__get__ for n in _DESCRIPTORS}
        | {getattr(torch.Tensor, n).__set__ for n in _DESCRIPTORS}
        | _functions(
            [
                "dim",
                "ndimension",
                "stride",
                "is_contiguous",
                "data_ptr",
                "element_size",
                "storage_offset",
                "untyped_storage",
                "get_device",
                "is_floating_point",
                "is_complex",
                "backward",
                "register_hook",
                "retain_grad",
                "__reduce_ex__",
                "__setstate__",
                "_is_view",
                "is_pinned",
                "new_empty",
                "new_zeros",
                "new_ones",
                "new_full",
                "new_tensor",
            ],
            (torch.Tensor,),
        )
    )
    - set(_GLOBAL_SHAPE)
)


__all__ = [
    "Axis",
    "DimShard",
    "Layout",
    "LayoutError",
    "SpatialTensor",
    "gather",
    "localize",
    "shard",
    "unwrap",
    "wrap",
]
