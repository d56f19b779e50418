"""Which submodules replay as CUDA graphs when nobody names them: ``SpatialParallelStrategy(cuda_graphs="auto")``.

On CUDA, the strategy runs the first training step eagerly while ``Watch`` notes, for every submodule of the
LightningModule, how often it ran and whether its inputs held a sharded activation: a ``SpatialTensor`` sharded
along image height or width, camera tokens flattened from one, or a BEV grid that ends sharded (``bev_shard``).
``choose`` then takes the largest such submodules that hold trainable weights and ran once in the step: the image
encoders of camera models (backbone and neck), where the sharded work is, the decoder layers that attend to the
sharded camera tokens (PETR's), and with ``bev_shard`` the BEV encoders. Heads over replicated queries, matching and
losses stay eager, as does a module run twice a step (a capture replays one call: its outputs live in the graph's
memory, which a second call would overwrite).
Each chosen module is wrapped in ``CUDAGraphed``, which captures it after its own warm-up calls and runs eagerly
whatever it cannot capture; the run logs once what was captured and why the rest was not.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from .ops.pending import PendingSum, plane_dims
from .tensor import SpatialTensor, _Plain


@dataclass
class Seen:
    """What one training step showed of a module: its calls, and whether an input was a sharded activation."""

    calls: int = 0
    sharded: bool = False


def sharded(value: object) -> bool:
    """A ``SpatialTensor`` sharded along a spatial dim or a token dim merged from one, or a splat's sums that its
    first reader reduce-scatters over a BEV plane (``bev_shard``: a BEV encoder's input)."""
    if isinstance(value, PendingSum):
        with _Plain():
            return bool(plane_dims(value))
    return isinstance(value, SpatialTensor) and bool(value.shard_layout.shards)


class Watch:
    """Forward pre-hooks on every submodule of ``root`` (not ``root`` itself) while entered, noting ``Seen``."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.seen: dict[nn.Module, Seen] = {}
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> Watch:
        for name, module in self.root.named_modules():
            if name:
                self._handles.append(module.register_forward_pre_hook(self._note, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _note(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen = self.seen.setdefault(module, Seen())
        seen.calls += 1
        seen.sharded = seen.sharded or any(sharded(v) for v in tree_leaves((args, kwargs)))


def choose(root: nn.Module, seen: dict[nn.Module, Seen]) -> tuple[list[str], dict[str, str]]:
    """(the submodules to capture, by path; why each other child of ``root`` is not captured)."""
    chosen: list[str] = []
    for name, module in root.named_modules():  # parents come before their children
        if not name or any(name.startswith(c + ".") for c in chosen):
            continue
        s = seen.get(module)
        trainable = any(p.requires_grad for p in module.parameters())
        if s is not None and s.sharded and s.calls == 1 and trainable:
            chosen.append(name)
    left = {}
    for name, module in root.named_children():
        if name in chosen or any(c.startswith(name + ".") for c in chosen):
            continue
        left[name] = _why_not(module, seen)
    return chosen, left


def _why_not(module: nn.Module, seen: dict[nn.Module, Seen]) -> str:
    s = seen.get(module)
    if s is None:
        ran = [c for c in module.children() if any(m in seen for m in c.modules())]  # seen: called at least once
        if not ran:
            return "not run in a training step"
        why = dict.fromkeys(_why_not(c, seen) for c in ran)  # a ModuleList's layers, called by its owner
        return "a container whose modules run one by one: " + "; ".join(why)
    if not any(p.requires_grad for p in module.parameters()):
        return "no trainable weights"
    if not s.sharded:
        return "its inputs are replicated values, not sharded activations"
    return f"run {s.calls} times a step (a capture replays one call)"


def describe(chosen: list[str], left: dict[str, str]) -> str:
    captured = ", ".join(f"'{n}'" for n in chosen) or "nothing"
    eager = "; ".join(f"'{n}' ({why})" for n, why in left.items())
    return (
        f"lightning_spatial: cuda_graphs='auto' replays {captured} as CUDA graphs after their warm-up steps"
        + (f"; eager: {eager}" if eager else "")
        + ". Name modules with cuda_graphs=[...], or turn graphs off with cuda_graphs=False"
    )


__all__ = ["Seen", "Watch", "choose", "describe", "sharded"]
