"""The (data, spatial_h, spatial_w) decomposition of the world: validated here, built into a DeviceMesh once.

Ranks are laid out data-major, so each spatial group is a block of consecutive ranks: with one process
per device and ``spatial_size`` dividing the devices per node, a spatial group never leaves a node (fast
links carry the halos) and data parallelism runs across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

SHARD_DIMS = ("width", "height")


@dataclass(frozen=True)
class SpatialDims:
    """How ``world_size`` ranks split into ``data`` replicas of ``spatial_h x spatial_w`` tiles."""

    world_size: int
    spatial_h: int = 1
    spatial_w: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "spatial_h", "spatial_w"):
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
        if shard_dim not in SHARD_DIMS:
            raise ValueError(f"shard_dim must be one of {SHARD_DIMS}, got {shard_dim!r}")
        size = default if spatial_size is None else spatial_size
        if isinstance(size, (tuple, list)):
            if len(size) != 2:
                raise ValueError(f"spatial_size as tiles must be (height, width), got {size!r}")
            return cls(world_size, int(size[0]), int(size[1]))
        return cls(world_size, 1, int(size)) if shard_dim == "width" else cls(world_size, int(size), 1)

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

    def build(self, device_type: str):
        """The DeviceMesh with axes ``("data", "spatial_h", "spatial_w")`` (collective: every rank calls it)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=("data", "spatial_h", "spatial_w"))


__all__ = ["SHARD_DIMS", "SpatialDims"]
