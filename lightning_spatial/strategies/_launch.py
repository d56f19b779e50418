"""Which launcher a spatial strategy takes, and the names it is registered under, for the Trainer and Fabric alike.

Under torchrun or SLURM the processes exist already: each would otherwise fork ``devices`` more (start_method "fork"
or "spawn"), and their process groups could not form; the script launcher then starts nothing. One process runs in
this process: a forked child whose parent ran OpenMP threads (GNU libgomp) can hang in its first parallel op.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry


def register(registry: _StrategyRegistry, strategy: type) -> None:
    """``"spatial_tp"`` and ``"spatial_tp_fork"`` (the fork start method: CPU runs, notebooks) for ``strategy``."""
    registry.register("spatial_tp", strategy, description="Spatial (height/width) x data parallel training")
    fork = "spatial_tp with the fork start method"
    registry.register("spatial_tp_fork", strategy, description=fork, start_method="fork")


def launch_kind(
    environment: ClusterEnvironment | None, num_processes: int, num_nodes: int
) -> Literal["external", "in_process", "start_method"]:
    """``"external"``: the processes exist (the script launcher); ``"in_process"``: one process, this one; else the
    strategy's ``start_method`` decides."""
    if environment is not None and environment.creates_processes_externally:
        return "external"
    return "in_process" if num_processes * num_nodes == 1 else "start_method"


@contextmanager
def environment_kept() -> Iterator[None]:
    """``os.environ`` as it was, after the block. Lightning's script launcher exports LOCAL_RANK, MASTER_PORT, ...
    for the child scripts it would start; left behind after one rank ran in this process, they made the next
    Trainer or Fabric here (a notebook, a test) believe torchrun had started its ranks, and it waited for ranks
    nobody started."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


__all__ = ["environment_kept", "launch_kind", "register"]
