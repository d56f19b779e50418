"""The options both spatial strategies take beyond DDP's, checked at construction: in the process that builds the
strategy, before any rank starts, and with the same messages under the Trainer and Fabric."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from ..mesh import SpatialDims, tiles
from ..run import check_bev_shard, check_fallback_mode

CudaGraphs = Sequence[str] | Literal["auto"] | bool


def check_options(
    spatial_size: int | tuple[int, int] | Literal["auto"] | None,
    shard_dim: str,
    fallback: str,
    cuda_graphs: CudaGraphs,
    bev_shard: str | None = None,
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


def graph_names(cuda_graphs: CudaGraphs) -> tuple[str, ...]:
    """The submodules ``cuda_graphs`` names; none for ``"auto"`` (chosen after watching the first step) or off."""
    return () if cuda_graphs == "auto" or not cuda_graphs else tuple(cuda_graphs)


__all__ = ["CudaGraphs", "check_options", "graph_names"]
