"""``HostRoundTrips``: the ops of a step that need the host. On CUDA each is a copy between host and device that
waits for the device's queue (the GPU then idles while Python catches up) and that a graph's capture refuses: tensors
made from host data (``torch.tensor``, ``new_tensor``: ``aten.lift_fresh``), values read back (``.item()``,
``bool(t)``: ``aten._local_scalar_dense``) and shapes that depend on values (``nonzero``, ``unique``,
``masked_select``, indexing by a boolean mask). On the CPU the same ops run, so a CPU test finds them."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
OPS = (
    aten.lift_fresh,
    aten.lift_fresh_copy,
    aten._local_scalar_dense,
    aten.nonzero,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.masked_select,
)


def _needs_host(func, args) -> bool:
    if func.overloadpacket in OPS:
        return True
    masks = args[1] if func.overloadpacket in (aten.index, aten.index_put, aten.index_put_) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in masks)


class HostRoundTrips(TorchDispatchMode):
    """Notes each op that needs the host as (where, op, culprit). With ``modules`` (by name), only ops inside them:
    where is ``(the innermost running module,)`` and the culprit that module. Without, every op: where is the stack
    as ``file stem.function`` names (``query_head.match``), the culprit its innermost function outside torch."""

    def __init__(self, modules: dict[str, nn.Module] | None = None):
        super().__init__()
        self.modules = modules
        self.running: list[str] = []
        self.made: set[tuple] = set()
        self._hooks = []
        for name, module in (modules or {}).items():
            self._hooks.append(module.register_forward_pre_hook(lambda *_, name=name: self._enter(name)))
            self._hooks.append(module.register_forward_hook(lambda *_: self._leave()))

    def _enter(self, name: str) -> None:
        self.running.append(name)

    def _leave(self) -> None:  # a forward hook returning something would replace the module's output
        self.running.pop()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _needs_host(func, args):
            op = func.overloadpacket.__name__
            if self.modules is None:
                stack = traceback.extract_stack()[:-1]
                where = tuple(f"{Path(f.filename).stem}.{f.name}" for f in stack)
                ours = [w for w, f in zip(where, stack) if f"{os.sep}torch{os.sep}" not in f.filename]
                self.made.add((where, op, ours[-1] if ours else where[-1]))
            elif self.running:
                self.made.add(((self.running[-1],), op, self.running[-1]))
        return func(*args, **(kwargs or {}))


def waits(made: set[tuple], by_design: set[str]) -> list[tuple[str, str]]:
    """(the innermost function outside torch, op) of each noted stack that has no function of ``by_design``."""
    return sorted((culprit, op) for where, op, culprit in made if not by_design & set(where))
