"""``SpatialParallelStrategy(spatial_size="auto")``: the smallest spatial group whose per-rank memory fits a budget.

In the strategy's ``setup`` (after the LightningModule's ``setup`` and ``configure_model``, before DDP), rank 0
takes the first batch of the training dataloader and runs one training step (forward, backward, optimizer step)
of a copy of the module as **rank 0 of each candidate layout, alone**: the layout's spatial axes are PyTorch's
``fake`` process groups, whose collectives and halo messages return at once. Every op then takes the path it
takes in the real run (the same windows, the same gathers and replication decisions; a layer too thin for its
ranks raises) on the shard rank 0 would hold, the largest one, so the memory measured is that of rank 0 of the
real run; only the values differ (halos never arrive). The module, its optimizer state, BatchNorm statistics and
the random streams are left as they were.

Candidates: every spatial size dividing the processes of a node (a spatial group never leaves a node, see
``mesh.py``), as width, height and 2-D tiles, tried from the largest size down; the first size at which a layout
runs but none fits ends the search. The plan is the smallest size that fits, then its layout with the fewest halo
bytes, and every rank receives it from rank 0.

What one rank is estimated to need: parameters and buffers, optimizer state, and what a forward and backward hold
above them. On CUDA that is the caching allocator's peak (gradients, activations, workspaces); on CPU, which has no
allocator peak, the gradients and the tensors autograd saves for backward (transient buffers not counted: the
quantity ``SpatialSummary`` reports). Halo bytes per rank and step are a heuristic: for every conv and pooling
module, the rows its kernel reaches across a cut between shards (dilation x (kernel - 1), stride ignored) times
the cut's length and channels, forward and backward, averaged over the ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import os
import random
import re
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.compile import to_uncompiled
from torch import nn
from torch.nn.modules.utils import _ntuple
from torch.utils._pytree import tree_leaves

from .fallback import size_text as _size
from .mesh import Axis, SpatialDims
from .run import Run, entered
from .saved import SavedActivations
from .sharding import Select, shard_batch
from .tensor import SpatialTensor

_OOM = "out of memory in the probe"
MARGIN = 0.9  # of the free memory: the CUDA context, NCCL buffers and fragmentation are not in the estimate
_UNITS = {"": 1, "b": 1, **{f"{p}b": 1000**i for i, p in enumerate("kmgt", 1)}}
_UNITS |= {f"{p}ib": 1024**i for i, p in enumerate("kmgt", 1)}


def parse_budget(value: int | str | None) -> int | None:
    """``None`` (the default budget), a number of bytes, or a string such as ``"70GiB"`` or ``"500 MB"``."""
    number: Any = value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        number = float(match[1]) * _UNITS[match[2].lower()] if match and match[2].lower() in _UNITS else None
    if value is not None and (isinstance(number, bool) or not isinstance(number, (int, float)) or number < 1):
        raise ValueError(
            f"memory_budget must be a positive number of bytes or a string such as '70GiB' or '500MB', got {value!r}"
        )
    return None if value is None else int(number)


def layouts(processes_per_node: int) -> list[tuple[int, int]]:
    """(h, w) tiles of every spatial size dividing the processes of a node, largest size first; per size: width,
    height, then 2-D tiles."""
    sizes = [s for s in range(processes_per_node, 0, -1) if processes_per_node % s == 0]
    out = []
    for s in sizes:
        out += [(1, s)] + ([(s, 1)] if s > 1 else []) + [(h, s // h) for h in range(2, s // 2 + 1) if s % h == 0]
    return out


def _axis_ranks(tiles: tuple[int, int]) -> dict[int, tuple[int, ...]]:
    """Tensor dim -> global ranks of rank 0's spatial axis along it (the mesh is data-major, then h, then w)."""
    h, w = tiles
    return {dim: ranks for dim, ranks in ((-2, tuple(range(0, h * w, w))), (-1, tuple(range(w)))) if len(ranks) > 1}


@dataclass(frozen=True)
class Estimate:
    """One candidate layout: rank 0's estimated peak bytes (``None`` when not measured, ``note`` says why) and
    its halo bytes per rank and step."""

    tiles: tuple[int, int]
    bytes: int | None = None
    halo_bytes: int = 0
    note: str = ""

    @property
    def spatial_size(self) -> int:
        return self.tiles[0] * self.tiles[1]

    def fits(self, budget: int) -> bool:
        return self.bytes is not None and self.bytes <= budget

    def describe(self, budget: int) -> str:
        h, w = self.tiles
        kind = "one device" if h == w == 1 else "width" if h == 1 else "height" if w == 1 else "tiles"
        if self.bytes is None:
            return f"{h}x{w} ({kind}): {self.note}"
        verdict = "fits" if self.fits(budget) else "over budget"
        return f"{h}x{w} ({kind}): {_size(self.bytes)}, halo {_size(self.halo_bytes)}/step, {verdict}"


@dataclass(frozen=True)
class Plan:
    """The chosen mesh, the budget it was chosen for, every candidate's estimate, and the batch size per replica of
    the training DataLoader it was probed on (``None`` when the DataLoader does not say)."""

    dims: SpatialDims
    budget: int
    estimates: tuple[Estimate, ...]
    basis: str
    batch_size: int | None = None

    @property
    def chosen(self) -> Estimate:
        return next(e for e in self.estimates if e.tiles == (self.dims.spatial_h, self.dims.spatial_w))

    def describe(self) -> str:
        d = self.dims
        lines = [
            f"lightning_spatial: plan: data {d.data} x spatial {d.spatial_size} (tiles {d.spatial_h}x{d.spatial_w}, "
            f"height x width) on {d.world_size} process(es); one rank needs about {_size(self.chosen.bytes)} of a "
            f"budget of {_size(self.budget)}. Estimates for rank 0 ({self.basis}):"
        ]
        lines += [f"  {e.describe(self.budget)}{'  <- chosen' if e is self.chosen else ''}" for e in self.estimates]
        return "\n".join(lines)


def choose(world_size: int, estimates: list[Estimate], budget: int, basis: str) -> Plan:
    """The smallest spatial size with a layout that fits, then its layout with the fewest halo bytes."""
    fitting = [e for e in estimates if e.fits(budget)]
    if not fitting:
        table = "\n".join(f"  {e.describe(budget)}" for e in estimates)
        raise RuntimeError(
            f"lightning_spatial: no spatial layout fits the memory budget of {_size(budget)} per rank. Estimates for "
            f"rank 0 ({basis}):\n{table}\nUse more processes per node, a smaller batch, lower precision or activation "
            "checkpointing, or pass memory_budget= (or a spatial_size) explicitly"
        )
    size = min(e.spatial_size for e in fitting)
    best = min((e for e in fitting if e.spatial_size == size), key=lambda e: e.halo_bytes)
    return Plan(SpatialDims(world_size, *best.tiles), budget, tuple(estimates), basis)


def accumulation(global_batch_size: int, plan: Plan) -> int:
    """The gradient-accumulation steps that make ``global_batch_size`` samples per optimizer step from the plan's
    data-parallel replicas, each a batch of the probed size: the probed memory holds for every step."""
    replicas, batch = plan.dims.data, plan.batch_size
    if batch is None:
        raise ValueError(
            f"lightning_spatial: global_batch_size={global_batch_size} needs the batch size per replica, and the "
            "training DataLoader has none (batch_size=None or a batch_sampler): give the DataLoader a batch_size"
        )
    per_step = replicas * batch
    if global_batch_size % per_step:
        multiple = max(global_batch_size // per_step, 1) * per_step
        raise ValueError(
            f"lightning_spatial: global_batch_size={global_batch_size} is not reachable: the plan has {replicas} "
            f"data-parallel replica(s) (spatial size {plan.dims.spatial_size} on {plan.dims.world_size} processes) "
            f"of {batch} samples per batch, so gradients accumulated over whole batches make multiples of "
            f"{per_step}. Use a multiple of {per_step} (say global_batch_size={multiple}), a DataLoader batch_size "
            f"whose {replicas} x batch_size divides {global_batch_size}, or pass the spatial size"
        )
    return global_batch_size // per_step


def describe_batches(plan: Plan, accumulated: int, batches_per_epoch: float) -> str:
    """What the plan's data-parallel size makes of the training batches: the global batch and the steps per epoch."""
    d, batch = plan.dims, plan.batch_size
    per_replica = "? (the DataLoader has no batch_size)" if batch is None else str(batch)
    total = "?" if batch is None else str(d.data * batch * accumulated)
    steps = "?" if math.isinf(batches_per_epoch) else str(math.ceil(batches_per_epoch / accumulated))
    return (
        f"lightning_spatial: plan: {d.data} data-parallel replica(s) x {per_replica} samples per batch x "
        f"{accumulated} accumulated batch(es) = a global batch of {total} samples per optimizer step; {steps} "
        f"optimizer step(s) per epoch ({batches_per_epoch:g} batches per replica)"
    )


def default_budget(device: torch.device, processes_per_node: int) -> int:
    """This rank's share of the free memory: its device's, or the host's split over the node's processes."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * MARGIN)
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(free * MARGIN / processes_per_node)


def make_plan(strategy, trainer, budget: int | None, select: Select | None, gradient_copy: bool) -> Plan:
    """Collective (every rank calls it in the strategy's ``setup``): rank 0 probes, every rank gets its plan.

    ``gradient_copy``: DDP keeps a second copy of the gradients (``gradient_as_bucket_view=False``)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers torch's "fake" backend

    device = strategy.root_device
    candidates = layouts(strategy.num_processes)
    if budget is None:  # the smallest over ranks: every rank must choose the same plan
        smallest = torch.tensor([default_budget(device, strategy.num_processes)], device=device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        budget = int(smallest.item())
    # Every rank creates the same groups in the same order: torch numbers process groups by creation, so a group
    # made on rank 0 alone would shift the names of the mesh's groups and their rendezvous would never meet.
    fakes = {
        ranks: dist.new_group(list(ranks), backend="fake")
        for tiles in candidates
        for ranks in _axis_ranks(tiles).values()
    }
    outcome: Plan | str | None = None
    error: BaseException | None = None
    try:
        if strategy.global_rank == 0:
            try:
                with _restored_random_state(device):
                    outcome = _probe_all(strategy, trainer, candidates, fakes, budget, select, gradient_copy)
            except Exception as raised:  # noqa: BLE001 - every rank must hear of it, or they would wait forever
                error, outcome = raised, str(raised)
                if not outcome.startswith("lightning_spatial"):
                    outcome = f"lightning_spatial: rank 0 could not plan: {type(raised).__name__}: {raised}"
        outcome = strategy.broadcast(outcome, 0)
    finally:
        for group in fakes.values():
            if group is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
    if error is not None:
        raise error
    if isinstance(outcome, str):
        raise RuntimeError(outcome)
    return outcome


@contextmanager
def _restored_random_state(device: torch.device):
    """torch (CPU and this device), Python and NumPy random streams as they were: the first batch and dropout in
    the probe draw from them."""
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def _probe_all(strategy, trainer, candidates, fakes, budget, select, gradient_copy) -> Plan:
    module = trainer.lightning_module
    if not module.automatic_optimization:
        raise ValueError(
            "spatial_size='auto' probes one training step with automatic optimization; with manual optimization "
            "pass the spatial size explicitly"
        )
    loader = _training_loader(trainer)
    probe = _Probe(strategy, _first_batch(loader), select, gradient_copy)
    estimates: list[Estimate] = []
    for size in sorted({h * w for h, w in candidates}, reverse=True):
        level = [probe(tiles, fakes) for tiles in candidates if tiles[0] * tiles[1] == size]
        estimates += level
        if not any(e.fits(budget) for e in level) and any(e.bytes is not None or e.note == _OOM for e in level):
            skipped = candidates[len(estimates) :]  # smaller sizes hold larger shards
            estimates += [Estimate(t, note="not probed: a larger spatial size did not fit") for t in skipped]
            break
    probe.release()
    plan = choose(strategy.world_size, estimates, budget, probe.basis)
    return dataclasses.replace(plan, batch_size=getattr(loader, "batch_size", None))


def _training_loader(trainer) -> Any:
    """The training dataloader(s), as the fit loop would request them (before any sampler or sharding)."""
    from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader

    source = trainer.fit_loop._data_source
    if not source.is_defined():
        raise ValueError(
            "spatial_size='auto' plans from the first training batch, and this Trainer has no training data; pass "
            "the spatial size that training chose (its log line 'lightning_spatial: plan: ...')"
        )
    return _request_dataloader(source)


def _first_batch(loader: Any) -> Any:
    from lightning.pytorch.utilities import CombinedLoader

    batch, _, _ = next(iter(CombinedLoader(loader, "max_size_cycle")))
    return batch


class _Probe:
    """One training step of a copy of the module, per layout, on rank 0's shard of the first batch."""

    def __init__(self, strategy, batch: Any, select: Select | None, gradient_copy: bool) -> None:
        original = strategy.lightning_module
        self.device, self.precision = strategy.root_device, strategy.precision_plugin
        self.batch, self.select, self.gradient_copy = batch, select, gradient_copy
        self.to_device = lambda b: original._apply_batch_transfer_handler(
            original._on_before_batch_transfer(self.precision.convert_input(b)), self.device
        )
        # A copy without the Trainer (LightningModule.__getstate__ leaves it out): whatever it would reach (the
        # data, other ranks) is out of bounds here. It logs nothing.
        self.model = copy.deepcopy(original)
        if self.model._compiler_ctx is not None:  # Trainer.fit(torch.compile(m)) set steps bound to m on m
            to_uncompiled(self.model)  # the copy's own steps again (the probe runs compiled code eagerly anyway)
        self.model.log = self.model.log_dict = lambda *args, **kwargs: None
        self.precision.convert_module(self.model)
        self.model.to(self.device).train()
        self.optimizers, self.optimizer_state = _optimizers(self.model), None
        self.model_bytes = sum(_nbytes(t) for t in (*self.model.parameters(), *self.model.buffers()))
        self.grad_bytes = sum(_nbytes(p) for p in self.model.parameters() if p.requires_grad)
        cuda = self.device.type == "cuda"
        step = "the allocator's peak in forward and backward" if cuda else "gradients, tensors saved for backward"
        self.basis = f"parameters, buffers, optimizer state, the batch shard, {step}"
        if self.optimizers is None:
            self.basis += "; optimizer state assumed 2 x parameters: configure_optimizers needs the Trainer"

    def __call__(self, tiles: tuple[int, int], fakes: dict) -> Estimate:
        axes = {dim: Axis.from_group(fakes[ranks]) for dim, ranks in _axis_ranks(tiles).items()}
        try:
            batch = self.to_device(shard_batch(self.batch, axes, self.select))
            inputs = sum(_nbytes(t) for t in tree_leaves(batch) if isinstance(t, torch.Tensor))
            step, halo = self._step(batch)
        except torch.OutOfMemoryError:
            step, note = None, _OOM
        except Exception as error:  # noqa: BLE001 - a layout this model cannot run is no candidate; the note says why
            step, note = None, f"does not run: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        batch = None
        self.model.zero_grad(set_to_none=True)
        _free(self.device)
        if step is None:
            return Estimate(tiles, note=note)
        state = self.model_bytes + self.optimizer_state + (self.grad_bytes if self.gradient_copy else 0)
        return Estimate(tiles, state + inputs + step, halo)

    def _step(self, batch: Any) -> tuple[int, int]:
        """(bytes a forward and backward hold above the model state and the batch; halo bytes). Compiled code runs
        eagerly: compiling every candidate would cost more than the probe measures."""
        saved, halo, cuda = SavedActivations(self.model), _HaloBytes(self.model), self.device.type == "cuda"
        if cuda:  # the allocator's statistics are kept on the host: no synchronisation needed
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        probe = Run(fallback="silent", zero_undelivered=True)  # the fake groups deliver no halos: zeros arrive
        with entered(probe), halo, torch.compiler.set_stance("force_eager"):
            with saved, self.precision.train_step_context():
                loss = _loss(self.model.training_step(batch, 0))
            loss.backward()
        step = torch.cuda.max_memory_allocated(self.device) - base if cuda else self.grad_bytes + saved.nbytes
        del loss
        if self.optimizer_state is None:
            self.optimizer_state = self._optimizer_step()
        return step, halo.nbytes

    def _optimizer_step(self) -> int:
        """The optimizer state after a first step (optimizers create it lazily)."""
        if self.optimizers is None:
            return 2 * self.grad_bytes
        for optimizer in self.optimizers:
            optimizer.step()
        states = [s for opt in self.optimizers for s in opt.state.values()]
        return sum(_nbytes(t) for s in states for t in s.values() if isinstance(t, torch.Tensor))

    def release(self) -> None:
        self.model = self.optimizers = None
        _free(self.device)


def _optimizers(model: nn.Module) -> list | None:
    """The module's optimizers over the copy's parameters; ``None`` when ``configure_optimizers`` needs the
    Trainer (e.g. ``estimated_stepping_batches``), which the copy has not."""
    from lightning.pytorch.core.optimizer import _configure_optimizers

    try:
        conf = model.configure_optimizers()
    except Exception:  # noqa: BLE001 - anything it needs beyond its own parameters
        return None
    return [] if conf is None else _configure_optimizers(conf)[0]


def _loss(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"training_step returned no loss on the first batch (got {type(output).__name__})")
    return loss


_WINDOWED = {
    nd: tuple(getattr(nn, f"{kind}{nd}d") for kind in ("Conv", "ConvTranspose", "MaxPool", "AvgPool"))
    for nd in (1, 2, 3)
}


class _HaloBytes:
    """Halo bytes per rank and step from conv and pooling modules (the heuristic of the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.nbytes, self._handles = model, 0, []

    def __enter__(self) -> _HaloBytes:
        for module in self.model.modules():
            nd = next((nd for nd, kinds in _WINDOWED.items() if isinstance(module, kinds)), None)
            if nd is not None:
                self._handles.append(module.register_forward_pre_hook(self._counter(module, nd)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _counter(self, module: nn.Module, nd: int) -> Callable:
        kernel, dilation = _ntuple(nd)(module.kernel_size), _ntuple(nd)(getattr(module, "dilation", 1))

        def count(module, args) -> None:
            if not args or not isinstance(args[0], SpatialTensor):
                return
            local = args[0].to_local()
            for s in args[0].shard_layout.shards:
                i = nd + s.dim
                if 0 <= i < nd and not s.merged and local.shape[s.dim]:
                    reach = dilation[i] * (kernel[i] - 1)
                    row = local.numel() // local.shape[s.dim] * local.element_size()
                    self.nbytes += 2 * reach * row * (s.axis.size - 1) // s.axis.size  # forward + backward

        return count


def _nbytes(t: torch.Tensor) -> int:
    """Bytes this rank holds (a shard's, not its global shape's)."""
    t = t.to_local() if isinstance(t, SpatialTensor) else t
    return t.numel() * t.element_size()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


__all__ = [
    "Estimate",
    "Plan",
    "accumulation",
    "choose",
    "default_budget",
    "describe_batches",
    "layouts",
    "make_plan",
    "parse_budget",
]
