"""What a spatial strategy changes for the length of a run (Trainer: ``setup`` to ``teardown``; Fabric: from
``setup_environment`` on), each undone after.

- ``RunScope``: the op layer's ``Run`` entered, the run's metrics synced over the data axis, and what else the
  strategy enters for the run, all left at ``close``.
- ``MetricsOverData``: the run's torchmetrics sync over the data axis: every rank of a spatial group saw the same
  samples, so a world-wide sync would count each of them once per spatial rank.
- ``module_paths``: module paths by ``id(module)`` for the run (``Run.module_names``), so a fallback or a layout
  error names the layer it happened in.
- ``naming_the_layer``: a ``LayoutError`` raised inside a module's ``forward`` says which module.
- ``graphed``: named submodules replay their training forward and backward as CUDA graphs (``CUDAGraphed``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from types import TracebackType
from typing import Any

import torch
from torchmetrics import Metric

from ..graphs import CUDAGraphed
from ..layout import LayoutError
from ..run import FallbackMode, Run, current, entered


class RunScope(ExitStack):
    """One run of a strategy: its ``Run`` (``state``: the fallback mode, BatchNorm's ``data_axis``, module paths) is
    current, and the module's metrics sync over ``data_group``, until ``close``; the strategy enters the rest of
    the run's changes (CUDA graphs, dynamo settings) on it, to be undone with them. ``zero_undelivered``: one rank
    with PyTorch's fake backend (benchmarks), whose received halos read as zeros. ``bev_shard``: ``Run.bev_shard``."""

    def __init__(
        self,
        fallback: FallbackMode,
        data_axis: Any,
        data_group: Any,
        zero_undelivered: bool = False,
        bev_shard: str | None = None,
    ):
        super().__init__()
        run = Run(fallback=fallback, data_axis=data_axis, zero_undelivered=zero_undelivered, bev_shard=bev_shard)
        self.state = self.enter_context(entered(run))
        self.metrics = MetricsOverData(data_group)
        self.callback(self.metrics.release)

    def adopt(self, root: torch.nn.Module) -> None:
        """``root``'s module paths for messages, and its metrics for the data axis (again for metrics made since)."""
        self.state.module_names.update(module_paths(root))
        self.metrics.claim(root)


class MetricsOverData:
    """Every ``torchmetrics.Metric`` of a LightningModule syncs over ``group`` for the run, through the metric's own
    ``process_group`` (torchmetrics' documented setting), unless the metric names one itself.

    ``claim`` finds the module's metrics wherever a user keeps them (submodules, plain dicts, lists and tuples of
    any module's attributes) and is called at setup and at the first step of every epoch of every stage, so
    metrics created in ``setup``, ``on_*_start`` or a first step are claimed too; a metric created later (after an
    epoch's first step) syncs over the world unless created with ``process_group=trainer.strategy.data_group``.
    ``release`` gives every claimed metric its own setting back.
    """

    def __init__(self, group) -> None:
        self.group = group
        self.claimed: dict[int, tuple[Metric, object]] = {}  # id -> (metric, its own process_group)

    def claim(self, root: torch.nn.Module) -> None:
        for metric in _metrics(root):
            if id(metric) not in self.claimed and metric.process_group is None:
                self.claimed[id(metric)] = (metric, metric.process_group)
                metric.process_group = self.group

    def release(self) -> None:
        for metric, own in self.claimed.values():
            metric.process_group = own
        self.claimed.clear()


def _metrics(root: torch.nn.Module) -> Iterator[Metric]:
    """The metrics among ``root``'s submodules and in the containers its modules hold as attributes."""
    seen: set[int] = set()
    stack: list = [root]
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, Metric):
            yield value
        if isinstance(value, torch.nn.Module):
            stack.extend(value._modules.values())
            stack.extend(v for v in vars(value).values() if isinstance(v, (dict, list, tuple)))
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)


def module_paths(root: torch.nn.Module) -> dict[int, str]:
    """The paths of ``root``'s submodules (``model.stem.conv``) by ``id``; the root itself is unnamed."""
    return {id(module): name for name, module in root.named_modules() if name}


@contextmanager
def naming_the_layer() -> Iterator[None]:
    """Re-raise a ``LayoutError`` from inside a registered module's ``forward`` with that module's path (the
    first forward is where a layer output smaller than its ranks is found: before any optimizer step)."""
    try:
        yield
    except LayoutError as error:
        where = _innermost_module(error.__traceback__)
        if where is None or f"'{where[0]}'" in str(error):
            raise
        raise LayoutError(f"{error} [in module '{where[0]}' ({where[1]})]") from error


def _innermost_module(tb: TracebackType | None) -> tuple[str, str] | None:
    found = None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        names = current().module_names
        if isinstance(owner, torch.nn.Module) and id(owner) in names:
            found = (names[id(owner)], type(owner).__name__)
        tb = tb.tb_next
    return found


@contextmanager
def graphed(root: torch.nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Each submodule of ``root`` named in ``names`` (``"backbone"``, ``"model.encoder"``) wrapped in ``CUDAGraphed``
    for the run, and put back after; a name that is not a submodule raises before training."""
    swapped = []
    try:
        for name in names:
            parent_name, _, attr = name.rpartition(".")
            try:
                parent = root.get_submodule(parent_name)
                module = getattr(parent, attr) if attr else None
            except AttributeError:
                module = None
            if not attr or not isinstance(module, torch.nn.Module):
                have = ", ".join(n for n, _ in root.named_children())
                raise ValueError(
                    f"cuda_graphs names {name!r}, which is not a submodule of {type(root).__name__} (its children: "
                    f"{have}); name the module whose forward to replay, as in LightningModule.get_submodule"
                )
            setattr(parent, attr, CUDAGraphed(module))
            swapped.append((parent, attr, module))
        yield
    finally:
        for parent, attr, module in reversed(swapped):
            setattr(parent, attr, module)


__all__ = ["MetricsOverData", "RunScope", "graphed", "module_paths", "naming_the_layer"]
