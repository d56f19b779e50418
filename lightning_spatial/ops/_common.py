"""What the spatial op handlers share: argument normalisation, checks, output rows, and the window fetch."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ..fallback import fallback, name_of
from ..halo import fetch_windows
from ..layout import DimShard, Layout, LayoutError, partition
from ..plans import planned
from ..tensor import SpatialTensor, _Plain
from ._meta import raise_torch_error


def ntuple(value: int | Sequence[int], n: int, name: str) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * n
    value = tuple(int(v) for v in value)
    if len(value) == 1:
        return value * n
    if len(value) != n:
        raise ValueError(f"{name} must be an int or {n} ints, got {value}")
    return value


def require_replicated(op: str, weight: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    """Weights and biases are replicated (plain tensors); a sharded one is an error naming it."""
    if isinstance(weight, SpatialTensor) or isinstance(bias, SpatialTensor):
        name = "weight" if isinstance(weight, SpatialTensor) else "bias"
        raise LayoutError(f"{op}: {name} is sharded; weights and biases must be replicated (plain tensors)")


@planned
def spatial_shards(op: str, layout: Layout, nd: int) -> Mapping[int, DimShard]:
    """Sharded dims as spatial index (0 = first of the op's ``nd`` spatial dims) -> shard (read-only)."""
    out = {}
    for s in layout.shards:
        i = s.dim + nd
        if s.merged:
            raise LayoutError(
                f"{op}: dim {s.dim} of the input holds tokens merged from a sharded dim ({s.outer} x {s.size} x "
                f"{s.inner}); {op} needs spatial neighbours: view the tokens as the spatial map again (e.g. "
                "x.view(B, C, h, w)) before it"
            )
        if i < 0:
            raise LayoutError(
                f"{op}: the input [{layout.describe()}] is sharded along dim {s.dim}, which is not one of its {nd} "
                "spatial dims; shard only the trailing spatial dims (height, width)"
            )
        out[i] = s
    return MappingProxyType(out)


def check_output_size(op: str, shard: DimShard, out_size: int) -> None:
    if out_size < shard.axis.size:
        raise LayoutError(
            f"{op}: output size {out_size} along dim {shard.dim} (input {shard.size}) is smaller than its "
            f"{shard.axis.size} ranks; every rank needs at least one output row. Use fewer ranks along this dim, "
            f"a larger input, or gather before this layer"
        )


def output_sizes(op: str, shards: dict[int, DimShard], size: Callable[[int, DimShard], int]) -> dict[int, int]:
    """Every sharded spatial dim's global output size ``size(i, shard)``, checked before any communication."""
    out = {i: size(i, s) for i, s in shards.items()}
    for i, s in shards.items():
        check_output_size(op, s, out[i])
    return out


def output_rows(shard: DimShard, out_size: int) -> tuple[int, int]:
    """This rank's rows ``[lo, hi)`` of an output dim of global size ``out_size`` (the partition rule)."""
    return partition(out_size, shard.axis.size)[shard.axis.index]


def local_padding(padding: Sequence[int], shards: dict[int, DimShard]) -> list[int]:
    """The padding the local op applies: none along sharded dims, whose fetched windows already hold it."""
    return [0 if i in shards else p for i, p in enumerate(padding)]


@dataclass(frozen=True)
class Windows:
    """Every rank's input window ``[a, b)`` along each sharded spatial dim of one op call: the rows that
    produce its output rows (outputs partitioned by the rule). Ops that call often cache it."""

    dims: tuple[tuple[int, DimShard, tuple[tuple[int, int], ...]], ...]  # (spatial index, shard, every rank's)

    @classmethod
    def plan(
        cls,
        shards: dict[int, DimShard],
        out_sizes: dict[int, int],
        window: Callable[[int, int, int], tuple[int, int]],
    ) -> Windows:
        """``window(i, lo, hi)``: the input rows along spatial dim ``i`` that produce output rows ``[lo, hi)``."""
        return cls(
            tuple(
                (i, s, tuple(window(i, lo, hi) for lo, hi in partition(out_sizes[i], s.axis.size)))
                for i, s in shards.items()
            )
        )

    def start(self, i: int) -> int:
        """Where this rank's window along spatial dim ``i`` starts (global row)."""
        s, windows = next((s, w) for j, s, w in self.dims if j == i)
        return windows[s.axis.index][0]

    def fetch(self, x: torch.Tensor, mode: str = "zeros", fill: float = 0.0, own_grad: bool = False) -> torch.Tensor:
        """This rank's windows, one dim after the other, so 2-D tiles receive their corners from the
        already widened tensor. ``own_grad``: see ``fetch_window`` (a widened tensor's gradient is then the next
        fetch's own too)."""
        return fetch_windows(x, [(s, windows) for _, s, windows in self.dims], mode, fill, own_grad)


def eager_backward(backward: Callable) -> Callable:
    """An autograd Function's backward that refuses a second derivative (its messages carry no graph) and that
    compiled code runs as it is: torch 2.11's dynamo traced BatchNorm's into wrong gradients, so there it is a
    graph break; torch 2.14 keeps such a backward out of the graph by itself (and the Function in it)."""
    if _DYNAMO_TRACES_ONCE_DIFFERENTIABLE:
        backward = torch.compiler.disable(backward)
    return once_differentiable(backward)


_DYNAMO_TRACES_ONCE_DIFFERENTIABLE = torch.torch_version.TorchVersion(torch.__version__) < "2.14"


def output_layout(layout: Layout, shards: dict[int, DimShard], out_sizes: dict[int, int]) -> Layout | None:
    return layout.with_sizes({s.dim: out_sizes[i] for i, s in shards.items()})


def negative_dim(dim: int, ndim: int) -> int:
    return dim - ndim if dim >= 0 else dim


def layout_of(shards) -> Layout | None:
    """A layout of these shards; ``None`` (replicated) when there are none."""
    shards = tuple(shards)
    return Layout(shards) if shards else None


def split_shards(layout: Layout | None, dim: int) -> tuple[tuple[DimShard, ...], tuple[DimShard, ...]]:
    """(the shards of ``dim``, the other shards) of a layout (a merged dim has several)."""
    shards = layout.shards if layout else ()
    return tuple(s for s in shards if s.dim == dim), tuple(s for s in shards if s.dim != dim)


def moved_shards(shards, dim: int) -> tuple[DimShard, ...]:
    """The same shards on tensor dim ``dim`` (e.g. the keys' token dim as a mask's last dim)."""
    return tuple(replace(s, dim=dim) for s in shards)


def common_layout(func: Callable, operands) -> Layout:
    """The layout of an element-wise result: the sharded operands' widest layout, which the others must match or
    broadcast against (each of their shards is one of its, and they have size 1 along its other sharded dims,
    e.g. ``x - x.mean(-1, keepdim=True)`` on 2-D tiles); raises otherwise."""
    sharded = [t for t in operands if isinstance(t, SpatialTensor)]
    widest = sharded[0]._layout
    for t in sharded:  # a loop, not max(key=): torch 2.11's dynamo breaks the graph on max's key
        if len(t._layout.shards) > len(widest.shards):
            widest = t._layout
    for t in sharded:
        if t._layout is not widest and t._layout != widest and not _broadcasts(t, widest):
            raise LayoutError(
                f"{name_of(func)}: operands have different layouts [{widest.describe()}] and "
                f"[{t._layout.describe()}], and one does not broadcast against the other; reshard one (gather + "
                "shard) so both match"
            )
    return widest


def _broadcasts(t: SpatialTensor, layout: Layout) -> bool:
    own = set(t._layout.shards)
    with _Plain():
        shape = t.shape
    return own <= set(layout.shards) and all(
        len(shape) < -s.dim or shape[s.dim] == 1 for s in layout.shards if s not in own
    )


def bad_or_fallback(func: Callable, args: tuple, kwargs: dict) -> Any:
    """torch's own error for a call it rejects (before any communication); else the exact fallback."""
    raise_torch_error(func, args, kwargs)
    return fallback(func, args, kwargs)


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
