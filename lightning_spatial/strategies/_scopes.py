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
- ``cutting_bev_planes``: parameters that hold a BEV plane are cut to this rank's cells whenever their module runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from types import TracebackType
from typing import Any

import torch
from torchmetrics import Metric

from ..graphs import CUDAGraphed
from ..layout import LayoutError
from ..mesh import Axis
from ..run import BEV_PLANE_DIMS, FallbackMode, Run, current, entered
from ..tensor import shard


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
        # compiled code keeps a shard's sizes static: where one frame meets a second size, dynamo's automatic
        # dynamic shapes would make them symbols, which the op layer's layouts (plain ints) cannot compare
        self.enter_context(torch._dynamo.config.patch(automatic_dynamic_shapes=False))

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


@contextmanager
def cutting_bev_planes(
    root: torch.nn.Module, planes: Mapping[str, Sequence[int]], axes: Mapping[int, Axis], bev_shard: str | None
) -> Iterator[None]:
    """Each parameter of ``root`` named in ``planes`` (name -> the dims of its X and Y) read as this rank's cells of
    that BEV plane, sharded as ``bev_shard`` shards a splat's grid (``ops.pending``), for the run.

    A grid a model holds from the start (BEVFormer's learned queries) is a parameter, replicated: without this, every
    layer before the first one that meets a sharded grid runs on the whole grid on every rank. While the parameter's
    module runs, an attribute of the same name holds the cut (a slice: its gradient is this rank's cells, made whole
    by the spatial group's gradient sum, as every replicated parameter's); the parameter itself stays in place for
    checkpoints, the optimizer and DDP. A name that is no parameter, or a plane smaller than its ranks, raises before
    training."""
    ordered = [axes[dim] for dim in sorted(axes)]  # height's axis first, as a splat's sums take them
    handles = []
    try:
        for name, dims in planes.items():  # checked on one rank too: the name is wrong on S ranks as well
            owner, attr, parameter = _parameter(root, name)
            plane = [d % parameter.dim() if -parameter.dim() <= d < parameter.dim() else None for d in dims]
            if None in plane or plane[0] == plane[1]:
                raise ValueError(
                    f"bev_planes gives {name!r} (shape {tuple(parameter.shape)}) the X, Y dims {tuple(dims)}: name "
                    "two different dims of it"
                )
            cut = {plane[i]: axis for i, axis in zip(BEV_PLANE_DIMS.get(bev_shard, ()), ordered)}
            for dim, axis in cut.items():
                if parameter.shape[dim] < axis.size:
                    raise ValueError(
                        f"bev_planes: {name!r} has {parameter.shape[dim]} cells along dim {dim} (shape "
                        f"{tuple(parameter.shape)}), fewer than its {axis.size} ranks (bev_shard={bev_shard!r}): use "
                        "a finer grid, fewer spatial ranks, or leave it out of bev_planes"
                    )
            handles += _read_as_cut(owner, attr, parameter, cut) if cut else []
        yield
    finally:
        for handle in handles:
            handle.remove()


def _parameter(root: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str, torch.nn.Parameter]:
    """The module that holds parameter ``name``, its attribute name there and the parameter; else a ``ValueError``
    naming the parameters of two dims or more beside where the name points."""
    path, _, attr = name.rpartition(".")
    try:
        owner = root.get_submodule(path)
    except AttributeError:
        owner = None
    parameter = owner._parameters.get(attr) if owner is not None else None
    if parameter is None:
        near, prefix = (owner, f"{path}.") if owner is not None and path else (root, "")
        have = ", ".join(prefix + n for n, p in near.named_parameters(recurse=False) if p.dim() >= 2) or "none"
        raise ValueError(
            f"bev_planes names {name!r}, which is not a parameter of {type(root).__name__} (parameters of two dims "
            f"or more there: {have}); name it as named_parameters() does"
        )
    return owner, attr, parameter


def _read_as_cut(owner: torch.nn.Module, attr: str, parameter: torch.nn.Parameter, cut: dict[int, Axis]) -> list:
    """Hooks that shadow ``owner.<attr>`` with the cut while ``owner`` runs: an instance attribute is found before
    ``Module.__getattr__`` looks in the parameters."""

    def before(module, args):
        module.__dict__[attr] = shard(parameter, cut)

    def after(module, args, out):
        module.__dict__.pop(attr, None)

    return [owner.register_forward_pre_hook(before), owner.register_forward_hook(after, always_call=True)]


__all__ = ["MetricsOverData", "RunScope", "cutting_bev_planes", "graphed", "module_paths", "naming_the_layer"]
