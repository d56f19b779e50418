"""The state one run gives the op layer, in one object that the run owns.

A ``Run`` holds what handlers and halos read besides their arguments: what an op without a handler does
(``fallback``), module paths for messages, the data axis that BatchNorm statistics also span (SyncBatchNorm), where
DDP keeps the gradients that a replayed backward writes into, the memory pool CUDA graph captures share, halo byte
counters, the planner's probe switch, and
the rows each boolean mask or index tensor selects (``x[mask]`` and ``y[mask]`` share them: counting them
communicates).
``SpatialParallelStrategy`` creates one at ``setup`` and enters it until ``teardown``; code outside any strategy
(a test, a notebook calling ``shard`` by hand) reads the process's default run. Runs nest: the innermost entered
one is current, and leaving it restores the one before, so two strategies in one process never see each other's
state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from torch.utils.weak import WeakIdKeyDictionary

FallbackMode = Literal["warn", "error", "silent"]
FALLBACK_MODES = ("warn", "error", "silent")
BEV_SHARDS = (None, "x", "y", "xy")
# which of a BEV plane's (X, Y) dims each bev_shard shards, paired in this order with the spatial axes (height's first)
BEV_PLANE_DIMS = {"x": (0,), "y": (1,), "xy": (0, 1)}


@dataclass(eq=False)
class Run:
    """See the module docstring; every field has the value a run outside any strategy needs."""

    fallback: FallbackMode = "warn"
    module_names: dict[int, str] = field(default_factory=dict)  # id(module) -> its path in the LightningModule
    data_axis: Any = None  # a mesh ``Axis`` BatchNorm statistics also span, or None (within the spatial group)
    bucket_views: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)  # parameter -> DDP's view
    halo_counters: list[HaloBytes] = field(default_factory=list)  # entered ``counting_halo_bytes`` blocks
    zero_undelivered: bool = False  # the planner's probe: fake groups deliver nothing, receive zeros instead
    bev_shard: str | None = None  # sums into a BEV grid end sharded along "x", "y" or "xy" (ops.pending), or replicated
    warned: set[tuple[str, str]] = field(default_factory=set)  # (op, module) fallbacks announced in "warn" mode
    # a mask or index tensor -> the rows it selects, by kind (ops.selection)
    index_rows: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    # CUDA device index -> the memory pool that CUDA graph captures share until a backward replays (graphs._Pool)
    graph_pools: dict[int, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fallback_mode(self.fallback)
        check_bev_shard(self.bev_shard)


def current() -> Run:
    """The innermost entered run (the process's default outside any)."""
    return _RUNS[-1]


@contextmanager
def entered(run: Run) -> Iterator[Run]:
    """Make ``run`` current for the block."""
    _RUNS.append(run)
    try:
        yield run
    finally:
        _RUNS.remove(run)


def check_fallback_mode(mode: str) -> None:
    if mode not in FALLBACK_MODES:
        raise ValueError(f"fallback must be 'warn', 'error' or 'silent', got {mode!r}")


def check_bev_shard(bev_shard: str | None) -> None:
    if bev_shard not in BEV_SHARDS:
        raise ValueError(f"bev_shard must be None, 'x', 'y' or 'xy', got {bev_shard!r}")


_RUNS: list[Run] = [Run()]  # the process's default run first, the innermost entered run last


@contextmanager
def fallback_mode(mode: FallbackMode) -> Iterator[None]:
    """What an op without a spatial handler does in the block, in the current run: ``"warn"``: gather and warn
    once per op and module (a ``SpatialFallbackWarning``); ``"error"``: raise before any communication;
    ``"silent"``: gather quietly."""
    check_fallback_mode(mode)
    run = current()
    previous, run.fallback = run.fallback, mode
    try:
        yield
    finally:
        run.fallback = previous


@dataclass
class HaloBytes:
    """Bytes this rank sent in halo exchanges (forward and backward) while a ``counting_halo_bytes`` block ran."""

    sent: int = 0


@contextmanager
def counting_halo_bytes() -> Iterator[HaloBytes]:
    """Count the halo bytes this rank sends in the block (host-side counts of the messages, no synchronisation)."""
    counter = HaloBytes()
    counters = current().halo_counters
    counters.append(counter)
    try:
        yield counter
    finally:
        counters.remove(counter)


__all__ = ["FallbackMode", "HaloBytes", "Run", "counting_halo_bytes", "current", "entered", "fallback_mode"]
