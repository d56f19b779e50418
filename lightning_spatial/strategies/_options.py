"""The options both spatial strategies take beyond DDP's, checked at construction: in the process that builds the
strategy, before any rank starts, and with the same messages under the Trainer and Fabric."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from ..mesh import SpatialDims, tiles
from ..run import check_bev_shard, check_fallback_mode

CudaGraphs = Sequence[str] | Literal["auto"] | bool
BevPlanes = Mapping[str, Sequence[int]]  # a parameter's name -> the dims of its BEV plane's X and Y


def check_options(
    spatial_size: int | tuple[int, int] | Literal["auto"] | None,
    shard_dim: str,
    fallback: str,
    cuda_graphs: CudaGraphs,
    bev_shard: str | None = None,
    bev_planes: BevPlanes | None = None,
) -> None:
    """Raise ``ValueError`` naming a bad option; whether the spatial size divides the world waits for the world."""
    h, w = tiles(1 if spatial_size is None or spatial_size == "auto" else spatial_size, shard_dim)
    SpatialDims(h * w, h, w)
    if (isinstance(cuda_graphs, str) and cuda_graphs != "auto") or cuda_graphs is True:
        raise ValueError(
            f"cuda_graphs must be 'auto' (the default), False, or a list of submodule names, got {cuda_graphs!r}"
        )
    check_fallback_mode(fallback)
    check_bev_shard(bev_shard)
    if bev_planes and bev_shard is None:
        raise ValueError(
            f"bev_planes={bev_planes!r} cuts those parameters to the rank's cells of a sharded BEV grid: set "
            "bev_shard ('x', 'y' or 'xy') too, or leave bev_planes out"
        )
    if bev_planes and not (isinstance(bev_planes, Mapping) and all(_is_plane(n, d) for n, d in bev_planes.items())):
        raise ValueError(
            "bev_planes maps a parameter's name to the dims of its BEV plane's X and Y, e.g. "
            f"{{'bev_queries': (0, 1)}} for an (X, Y, C) parameter; got {bev_planes!r}"
        )


def _is_plane(name: object, dims: object) -> bool:
    """A parameter's name and two ints (a list from a config too)."""
    pair = tuple(dims) if isinstance(dims, Iterable) and not isinstance(dims, str) else ()
    return isinstance(name, str) and len(pair) == 2 and all(isinstance(d, int) for d in pair)


def graph_names(cuda_graphs: CudaGraphs) -> tuple[str, ...]:
    """The submodules ``cuda_graphs`` names; none for ``"auto"`` (chosen after watching the first step) or off."""
    return () if cuda_graphs == "auto" or not cuda_graphs else tuple(cuda_graphs)


__all__ = ["BevPlanes", "CudaGraphs", "check_options", "graph_names"]
