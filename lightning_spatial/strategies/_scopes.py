"""What ``SpatialParallelStrategy`` changes for the length of a run (``setup`` to ``teardown``), each undone after.

- ``metrics_sync_over``: torchmetrics sync over the data axis: every rank of a spatial group saw the same
  samples, so a world-wide sync would count each of them once per spatial rank.
- ``named_modules``: module paths by ``id(module)``, so a fallback or a layout error names the layer it
  happened in (``tensor.module_names``).
- ``naming_the_layer``: a ``LayoutError`` raised inside a module's ``forward`` says which module.
- ``graphed``: named submodules replay their training forward and backward as CUDA graphs (``CUDAGraphed``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType

import torch

from ..graphs import CUDAGraphed, forget_bucket_views
from ..layout import LayoutError
from ..tensor import module_names


@contextmanager
def metrics_sync_over(group) -> Iterator[None]:
    """Every ``torchmetrics.Metric`` syncs over ``group`` unless the call or the metric names a process group.

    Patching ``Metric.sync`` reaches metrics created at any time (in ``setup``, in a step, on epoch start)
    and kept anywhere (a plain dict, a list), which a walk over ``named_modules`` at setup would miss; every
    sync path (``compute``, ``forward`` with ``dist_sync_on_step``, Lightning's logging, metrics that override
    ``_sync_dist`` such as ``MeanAveragePrecision``) goes through it.
    """
    from torchmetrics import Metric

    original = Metric.sync

    @functools.wraps(original)
    def sync(self, dist_sync_fn=None, process_group=None, *args, **kwargs):
        return original(self, dist_sync_fn, process_group or self.process_group or group, *args, **kwargs)

    Metric.sync = sync
    try:
        yield
    finally:
        Metric.sync = original


@contextmanager
def named_modules(root: torch.nn.Module) -> Iterator[None]:
    """Register the paths of ``root``'s submodules (``model.stem.conv``) for messages; the root itself is unnamed."""
    names = {id(module): name for name, module in root.named_modules() if name}
    module_names.update(names)
    try:
        yield
    finally:
        for key in names:
            module_names.pop(key, None)


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
        if isinstance(owner, torch.nn.Module) and id(owner) in module_names:
            found = (module_names[id(owner)], type(owner).__name__)
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
            forget_bucket_views(module)


__all__ = ["graphed", "metrics_sync_over", "named_modules", "naming_the_layer"]
