"""Packed records under multi-process launchers: written once, before the ranks read them, however the ranks
were started. Each run is killed after a hard timeout, so that a hang fails instead of blocking the suite.
Horovod: tests/horovod/test_horovod.py."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from lightning_spatial import SpatialParallelStrategy
from tests.data.records_trainer import fit
from tests.spmd import as_torchrun, children_killed_after, run_spmd

STRATEGIES = {"spatial_tp": lambda **kwargs: SpatialParallelStrategy(2, **kwargs), "ddp": DDPStrategy}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_two_forked_ranks_train_from_records_they_write(tmp_path, name):
    with children_killed_after(120):
        fit(STRATEGIES[name](start_method="fork", timeout=timedelta(seconds=60)), 2, tmp_path)


def _torchrun_rank(strategy: str, records_dir, seeds: tuple[int, ...]) -> None:
    as_torchrun()  # the strategy's default start method, "popen", then starts no processes
    fit(STRATEGIES[strategy](timeout=timedelta(seconds=3)), 2, records_dir, seed=seeds[dist.get_rank()])


def test_ranks_started_outside_lightning_train_from_records(tmp_path):
    run_spmd(_torchrun_rank, 2, "spatial_tp", tmp_path, (0, 0), timeout=120)


def _two_node_rank(records_dir) -> None:
    as_torchrun()
    rank = dist.get_rank()
    os.environ.update(LOCAL_RANK=str(rank % 2), GROUP_RANK=str(rank // 2), LOCAL_WORLD_SIZE="2")
    fit(DDPStrategy(timeout=timedelta(seconds=60)), 2, records_dir, num_nodes=2)


def test_two_nodes_sharing_a_filesystem_write_at_once_and_train_from_records(tmp_path):
    """Lightning runs prepare_data on each node's local rank 0 (global ranks 0 and 2): two writers at once."""
    run_spmd(_two_node_rank, 4, tmp_path, timeout=120)


def test_a_rank_waiting_for_records_nobody_writes_fails_naming_them(tmp_path):
    """Rank 1 asks for other samples (seed 1) than rank 0 writes (seed 0): it gives up after the strategy's
    timeout (3 s here) with the folder and the differing setting."""
    with pytest.raises(AssertionError, match=r"(?s)rank 1:.*TimeoutError: records at .*train were written for "
                       r"other settings: seed \(records: 0, asked: 1\).*waited 3 s"):  # fmt: skip
        run_spmd(_torchrun_rank, 2, "ddp", tmp_path, (0, 1), timeout=120)
