"""What every spatial op handler shares: argument normalisation, checks, and the sliding-window fetch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch.utils._pytree import tree_map

from ..halo import fetch_window
from ..layout import DimShard, Layout, LayoutError, partition
from ..tensor import SpatialTensor


def ntuple(value: int | Sequence[int], n: int, name: str) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * n
    value = tuple(int(v) for v in value)
    if len(value) == 1:
        return value * n
    if len(value) != n:
        raise ValueError(f"{name} must be an int or {n} ints, got {value}")
    return value


def require_replicated(op: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if isinstance(t, SpatialTensor):
            raise LayoutError(f"{op}: {name} is sharded; weights and biases must be replicated (plain tensors)")


def spatial_shards(op: str, x: torch.Tensor, layout: Layout, nd: int) -> dict[int, DimShard]:
    """Sharded dims as spatial index (0 = first of the op's ``nd`` spatial dims) -> shard."""
    out = {}
    for s in layout.shards:
        i = s.dim + nd
        if s.merged:
            raise LayoutError(
                f"{op}: dim {s.dim} of the input {tuple(layout.global_shape(x))} holds tokens merged from a sharded "
                f"dim ({s.outer} x {s.size} x {s.inner}); {op} needs spatial neighbours: view the tokens as the "
                "spatial map again (e.g. x.view(B, C, h, w)) before it"
            )
        if i < 0:
            raise LayoutError(
                f"{op}: input of shape {tuple(layout.global_shape(x))} is sharded along dim {s.dim}, which is not one "
                f"of its {nd} spatial dims; shard only the trailing spatial dims (height, width)"
            )
        out[i] = s
    return out


def check_output_size(op: str, shard: DimShard, out_size: int) -> None:
    if out_size < shard.axis.size:
        raise LayoutError(
            f"{op}: output size {out_size} along dim {shard.dim} (input {shard.size}) is smaller than its "
            f"{shard.axis.size} ranks; every rank needs at least one output row. Use fewer ranks along this dim, "
            f"a larger input, or gather before this layer"
        )


Fetches = tuple[tuple[DimShard, tuple[tuple[int, int], ...]], ...]  # per sharded dim: every rank's window


def window_plan(
    shards: dict[int, DimShard], out_sizes: dict[int, int], window: Callable[[int, int, int], tuple[int, int]]
) -> Fetches:
    """For each sharded spatial dim ``i``, the input rows ``window(i, lo, hi)`` that produce every rank's
    output rows ``[lo, hi)`` (output partitioned by the rule)."""
    return tuple(
        (s, tuple(window(i, lo, hi) for lo, hi in partition(out_sizes[i], s.axis.size))) for i, s in shards.items()
    )


def fetch_planned(x: torch.Tensor, fetches: Fetches, mode: str = "zeros", fill: float = 0.0) -> torch.Tensor:
    """Fetch the windows of ``window_plan`` one dim after the other, so 2-D tiles receive their corners
    from the already widened tensor."""
    for s, windows in fetches:
        x = fetch_window(x, s, windows, mode, fill)
    return x


def fetch_windows(
    x: torch.Tensor,
    shards: dict[int, DimShard],
    out_sizes: dict[int, int],
    window: Callable[[int, int, int], tuple[int, int]],
    mode: str = "zeros",
    fill: float = 0.0,
) -> torch.Tensor:
    """``fetch_planned`` of ``window_plan``: the sliding-window fetch of one op call."""
    return fetch_planned(x, window_plan(shards, out_sizes, window), mode, fill)


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


def meta_check(func: Callable, *args, **kwargs) -> None:
    """Run ``func`` on meta tensors of the operands' global shapes: torch's own argument errors (shapes,
    dtypes, mask sizes) on every rank before any message, at no memory cost. A signature that passed once
    is not checked again (the meta call costs about a millisecond for attention)."""
    key = (func, _signature(args), _signature(kwargs))
    try:
        if key in _CHECKED:
            return
    except TypeError:  # an unhashable argument: check every time
        key = None
    func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
    if key is not None:
        if len(_CHECKED) > 4096:
            _CHECKED.clear()
        _CHECKED.add(key)


_CHECKED: set = set()


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t  # global shape


def _signature(value):
    """What a meta call's outcome depends on: tensors' global shapes and dtypes, and the other arguments."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in value.items())
    return value
