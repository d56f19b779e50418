"""The (data, spatial_h, spatial_w) decomposition of the world: validated here, built into a DeviceMesh once; and
``Axis``, one mesh axis as a rank sees it (its process group found by its ranks).

Ranks are laid out data-major, so each spatial group is a block of consecutive ranks: with one process
per device and ``spatial_size`` dividing the devices per node, a spatial group never leaves a node (fast
links carry the halos) and data parallelism runs across nodes. A node is taken to be one NVLink island (as
8-GPU NVSwitch nodes are); ``spatial_size="auto"`` only considers sizes dividing the devices per node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

SHARD_DIMS = ("width", "height")


# Process groups by their global ranks: an Axis pickles as plain ranks (DataLoader workers build
# layouts) and finds its group again in the process that communicates.
_GROUPS: dict[tuple[int, ...], Any] = {}


def group_of(ranks: Sequence[int]) -> dist.ProcessGroup:
    """The process group of an axis's global ranks, in this process."""
    try:
        return _GROUPS[tuple(ranks)]
    except KeyError:
        raise RuntimeError(
            f"no process group for ranks {tuple(ranks)} in this process; build it with Axis.from_group"
        ) from None


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

    @staticmethod
    def forget_groups() -> None:
        """After ``destroy_process_group``: its groups must not outlive it here. A process forked later would
        free one when an axis of the same ranks replaced it, and a gloo group's destructor there waited
        forever for threads that only existed in this process."""
        _GROUPS.clear()

    @property
    def group(self) -> dist.ProcessGroup:
        return group_of(self.ranks)

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class SpatialDims:
    """How ``world_size`` ranks split into ``data`` replicas of ``spatial_h x spatial_w`` tiles."""

    world_size: int
    spatial_h: int = 1
    spatial_w: int = 1

    def __post_init__(self) -> None:
        for name in ("spatial_h", "spatial_w", "world_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.world_size % self.spatial_size:
            raise ValueError(
                f"spatial_size {self.spatial_h}x{self.spatial_w}={self.spatial_size} does not divide the world size "
                f"{self.world_size}; choose a spatial size that divides it (data-parallel size = world / spatial)"
            )

    @classmethod
    def from_strategy_args(
        cls, world_size: int, spatial_size: int | tuple[int, int] | None, shard_dim: str, default: int
    ) -> SpatialDims:
        """``spatial_size`` int (along ``shard_dim``), (h, w) tiles, or None for ``default`` ranks."""
        return cls(world_size, *tiles(default if spatial_size is None else spatial_size, shard_dim))

    @property
    def spatial_size(self) -> int:
        return self.spatial_h * self.spatial_w

    @property
    def data(self) -> int:
        return self.world_size // self.spatial_size

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.spatial_h, self.spatial_w)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(data, h, w) index of a global rank."""
        data, rest = divmod(rank, self.spatial_size)
        return (data, *divmod(rest, self.spatial_w))

    def build(self, device_type: str, timeout: timedelta | None = None) -> DeviceMesh:
        """The DeviceMesh with axes ``("data", "spatial_h", "spatial_w")`` (collective: every rank calls it).

        Every axis group waits at most ``timeout`` for its peers, like the world group: ``init_device_mesh``
        would create them with the backend's default (30 min), so a stalled neighbour would hang a halo exchange.
        """
        ranks = torch.arange(self.world_size).view(self.shape)
        groups = []
        for axis in range(ranks.dim()):
            lines = ranks.movedim(axis, -1).reshape(-1, ranks.shape[axis]).tolist()
            groups.append(dist.new_subgroups_by_enumeration(lines, timeout=timeout)[0])
        return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=("data", "spatial_h", "spatial_w"))


def tiles(spatial_size: int | Sequence[int], shard_dim: str) -> tuple[int, int]:
    """(h, w) ranks of a spatial group from an int along ``shard_dim`` or an (h, w) pair; raises on anything else
    (a float, a bool, a triple), before any process starts."""
    if shard_dim not in SHARD_DIMS:
        raise ValueError(f"shard_dim must be one of {SHARD_DIMS}, got {shard_dim!r}")
    pair = isinstance(spatial_size, Sequence) and not isinstance(spatial_size, str)
    sizes = list(spatial_size) if pair else [spatial_size]
    if len(sizes) != (2 if pair else 1) or not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes):
        raise ValueError(
            "spatial_size must be a positive int (ranks along shard_dim) or a (height, width) pair of positive ints, "
            f"got {spatial_size!r}"
        )
    if pair:
        return sizes[0], sizes[1]
    return (1, sizes[0]) if shard_dim == "width" else (sizes[0], 1)


__all__ = ["SHARD_DIMS", "Axis", "SpatialDims", "group_of", "tiles"]
