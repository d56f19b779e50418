"""One rank of a larger run, alone in this process: its memory and step time on one device, through the Trainer.

``FakeRank(world_size, rank)`` is a Lightning cluster environment for one process that plays rank ``rank`` of a
``world_size``-rank run. Entering it starts PyTorch's ``fake`` process-group backend for that world: collectives
and halo messages return at once (received halos read as zeros: ``SpatialParallelStrategy`` says so to the op
layer), so the rank runs every kernel of the real run on the shard it would hold, with the same memory; only the
values differ. For sizing a run (spatial size, batch, precision) on one GPU before booking a cluster:

.. code-block:: python

    with FakeRank(world_size=8, rank=3) as rank:  # an interior rank of an 8-way width split
        trainer = L.Trainer(accelerator="gpu", devices=1, strategy=SpatialParallelStrategy(8), plugins=[rank])
        trainer.fit(model, data)  # torch.cuda.max_memory_allocated(): what rank 3 of 8 GPUs would need
"""

from __future__ import annotations

import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from typing_extensions import override


class FakeRank(ClusterEnvironment):
    """See the module docstring."""

    def __init__(self, world_size: int, rank: int) -> None:
        if not (isinstance(world_size, int) and isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"FakeRank needs 0 <= rank < world_size, got world_size={world_size!r}, rank={rank!r}")
        super().__init__()
        self._world_size, self._rank = world_size, rank

    def __enter__(self) -> FakeRank:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers torch's "fake" backend

        if dist.is_initialized():
            raise RuntimeError("FakeRank: a process group exists already in this process; destroy it first")
        dist.init_process_group("fake", rank=self._rank, world_size=self._world_size, store=FakeStore())
        return self

    def __exit__(self, *exc) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True  # the one process exists: Lightning starts no others

    @property
    @override
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    @override
    def main_port(self) -> int:
        return 0

    @staticmethod
    @override
    def detect() -> bool:
        return False

    @override
    def world_size(self) -> int:
        return self._world_size

    @override
    def set_world_size(self, size: int) -> None:
        pass  # fixed at construction

    @override
    def global_rank(self) -> int:
        return self._rank

    @override
    def set_global_rank(self, rank: int) -> None:
        pass

    @override
    def local_rank(self) -> int:
        return 0

    @override
    def node_rank(self) -> int:
        return 0

    @override
    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_devices * num_nodes != 1:
            raise ValueError(
                f"FakeRank plays one rank in one process: use Trainer(devices=1, num_nodes=1), got devices="
                f"{num_devices}, num_nodes={num_nodes}"
            )


__all__ = ["FakeRank"]
