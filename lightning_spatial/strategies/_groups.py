"""The process groups a spatial strategy trains over, built once per world, and the collectives a training loop
calls through them. Both strategies (``spatial.py`` for the Trainer, ``lightning_spatial.fabric`` for Fabric) hold
one ``SpatialGroups``.

A loop's reductions (logged values, ``all_gather``, metrics) run over the data axis: every rank of a spatial group
holds the same replicated values, so a world-wide sum would count each of them once per spatial rank. Votes
(``all_true``) count every rank, as each rank decides for itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp_if_available
from torch.distributed.device_mesh import DeviceMesh

from ..mesh import Axis, SpatialDims
from ..tensor import SpatialTensor, gather
from ._loaders import exact_mean


@dataclass(frozen=True)
class SpatialGroups:
    """The (data, spatial_h, spatial_w) mesh as this rank sees it: its spatial axes by tensor dim (those of more
    than one rank) and its data axis."""

    dims: SpatialDims
    mesh: DeviceMesh
    axes: dict[int, Axis]
    data_axis: Axis

    @classmethod
    def build(cls, dims: SpatialDims, device: torch.device, timeout: timedelta | None) -> SpatialGroups:
        """The mesh with every group waiting at most ``timeout``, and every rank given its spatial group leader's
        random stream: dropout masks and per-sample draws must agree across a group (collective)."""
        mesh = dims.build(device.type, timeout)
        names = {-2: ("spatial_h", dims.spatial_h), -1: ("spatial_w", dims.spatial_w)}
        axes = {dim: Axis.from_group(mesh.get_group(name)) for dim, (name, n) in names.items() if n > 1}
        groups = cls(dims, mesh, axes, Axis.from_group(mesh.get_group("data")))
        groups._connect(device)
        groups._share_random_stream(device)
        return groups

    def _connect(self, device: torch.device) -> None:
        """One collective per spatial axis group, with all its ranks: NCCL creates a group's communicator at
        its first call, and a first ``batch_isend_irecv`` must include every rank of the group, while a halo
        exchange may leave out ranks whose window is their own rows."""
        for axis in self.axes.values():
            dist.all_reduce(torch.zeros(1, device=device), group=axis.group)

    def _share_random_stream(self, device: torch.device) -> None:
        """Give every rank its spatial group leader's RNG state (CPU and current CUDA device)."""
        states = [torch.get_rng_state()]
        if device.type == "cuda":
            states.append(torch.cuda.get_rng_state(device))
        rank = dist.get_rank()
        leader = rank - rank % self.dims.spatial_size
        for k, state in enumerate(states):
            state = state.to(device) if device.type == "cuda" else state
            gathered = [torch.empty_like(state) for _ in range(self.dims.world_size)]
            dist.all_gather(gathered, state)
            chosen = gathered[leader].cpu()
            torch.set_rng_state(chosen) if k == 0 else torch.cuda.set_rng_state(chosen, device)

    def sampler_kwargs(self, rank: int) -> dict[str, int]:
        """A distributed sampler's replicas and rank: the data axis only, so a spatial group sees the same samples."""
        return {"num_replicas": self.dims.data, "rank": self.dims.coordinates(rank)[0]}

    def over_data(self, group: Any | None) -> Any:
        """The default group (``None``, or ``WORLD``, which ``LightningModule.all_gather`` passes) means the data
        axis; a group the caller names stays."""
        return self.data_axis.group if group is None or group is dist.group.WORLD else group

    def reduce(self, tensor: torch.Tensor, group: Any | None = None, reduce_op: Any | None = "mean") -> torch.Tensor:
        """``tensor`` (gathered whole if sharded) reduced over the data axis; integers averaged in float64."""
        tensor = gather(tensor) if isinstance(tensor, SpatialTensor) else tensor
        return _sync_ddp_if_available(exact_mean(tensor, reduce_op), self.over_data(group), reduce_op=reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        """One row per data replica (gathered whole if sharded)."""
        tensor = gather(tensor) if isinstance(tensor, SpatialTensor) else tensor
        return _all_gather_ddp_if_available(tensor, group=self.over_data(group), sync_grads=sync_grads)

    def all_true(self, decision: bool, all: bool, device: torch.device) -> bool:
        """Every rank's vote counted over the world (ModelCheckpoint, EarlyStopping, a loop's stop flag)."""
        votes = torch.tensor(int(decision), device=device)
        dist.all_reduce(votes)
        return bool(votes == self.dims.world_size) if all else bool(votes)


__all__ = ["SpatialGroups"]
