"""``SpatialParallelStrategy`` for Lightning Fabric: spatial x data parallel training in a loop of your own.

The Trainer strategy's core (``lightning_spatial.strategies``: ``_options``, ``_groups``, ``_gradients``,
``_loaders``, ``_scopes``, ``_launch``) under Fabric's hooks:

- ``_configure_launcher``: a spatial size that does not divide the processes raises here, in the process that
  builds ``Fabric``, before any rank starts; one process runs in this process, processes that torchrun or SLURM
  started run where they are.
- ``setup_environment`` (``fabric.launch()``): the (data, spatial_h, spatial_w) mesh, every group with the strategy's
  ``timeout``, one random stream per spatial group; and the run's state for the op layer (``fallback``, BatchNorm
  over the data axis with ``sync_batchnorm``), entered until ``teardown``.
- ``setup_module`` (``fabric.setup``): named submodules replayed as CUDA graphs, DDP with the spatial comm hook
  (gradient shares summed over the world, divided by the data-parallel size), module paths for messages, the
  module's torchmetrics synced over the data axis; its forward names the layer a ``LayoutError`` came from.
- ``distributed_sampler_kwargs`` and ``process_dataloader`` (``fabric.setup_dataloaders``): a sampler over the data
  replicas only, and a collate that keeps this rank's rows of every image-sized tensor.
- ``backward`` (``fabric.backward``): each of the ``S`` ranks of a spatial group seeds ``1/S`` of the loss; with
  ``cuda_graphs="auto"`` on CUDA the first one also chooses the submodules to replay, from what the first training
  forward ran.
- ``all_reduce``, ``all_gather`` over the data axis (sharded tensors gathered first); ``barrier``, ``broadcast`` and
  ``reduce_boolean_decision`` over every rank; checkpoints: rank 0 writes the plain module's state dict.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from .. import capture
from ..capture import Watch
from ..mesh import Axis, SpatialDims
from ..run import FallbackMode
from ..sharding import Select
from ..strategies._gradients import before_ddp, ddp_options, register_comm_hook, share
from ..strategies._groups import SpatialGroups
from ..strategies._launch import environment_kept, launch_kind, register
from ..strategies._loaders import sharded
from ..strategies._options import BevPlanes, CudaGraphs, check_options, graph_names
from ..strategies._scopes import RunScope, cutting_bev_planes, graphed, naming_the_layer


class SpatialParallelStrategy(DDPStrategy):
    """Shard activations along height, width or both over a spatial group; data parallel across groups.

    Args:
        spatial_size: ranks per spatial group: an int along ``shard_dim``, or ``(h, w)`` tiles. Default: all
            processes of a node. (``"auto"`` probes a training step of the Trainer's loop: Trainer only.)
        shard_dim: ``"width"`` or ``"height"`` (for an int ``spatial_size``).
        shard_select: ``(path, tensor) -> bool`` choosing the batch tensors to shard; default: every tensor
            whose trailing two dims equal the image's (H, W) (``sharding.image_size`` says which is the image).
        fallback: an op without a spatial handler gathers its operands: ``"warn"`` once per op (default),
            ``"error"`` raises instead (naming the op, the module and the bytes), ``"silent"``.
        bev_shard: where sums into a BEV grid (a splat: ``index_add``/``scatter_add``/``index_put`` of sharded
            features, a ``grid_sample`` of sharded images) end: ``None`` (default): replicated on every rank of the
            spatial group (one all-reduce); ``"x"``, ``"y"``, ``"xy"``: sharded along the grid's X (second to last
            dim), Y (last dim) or both (2-D tiles, over the two axes of a 2-D group), by one reduce-scatter, so the
            BEV encoder and head after the splat run on 1/S of the grid (``ops.pending``). On a 2-D group ``"x"`` and
            ``"y"`` cut over its first axis (the rows of tiles) only, so each rank holds 1/S_h of the grid: use
            ``"xy"`` there. No change to the model.
        bev_planes: with ``bev_shard``, parameters that are themselves a BEV grid (BEVFormer's learned queries), by
            name (as ``named_parameters`` gives it) -> the dims of its X and Y, e.g. ``{"bev_queries": (0, 1)}``: read
            as this rank's cells whenever their module runs, so the layers before the first splat or sample run on
            1/S of the grid too. The parameters stay whole for checkpoints and the optimizer.
        cuda_graphs: which submodules' training forward and backward replay as CUDA graphs after two eager calls.
            ``"auto"`` (default): on CUDA, the largest submodules that ran once in the first training forward on
            sharded activations (image maps, their camera tokens), chosen at the first ``fabric.backward`` and
            logged; ``False``: none; a list of names (``["backbone"]``, as ``get_submodule`` names them). Eager
            off CUDA and without autograd.
        sync_batchnorm: BatchNorm statistics over the data replicas too, as ``Trainer(sync_batchnorm=True)``
            (Fabric has no such flag): within a spatial group they always span the whole image.
        ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper: a DDP communication hook (e.g. fp16 compression); it
            averages over the world, and its result is scaled to the data-parallel mean.
        start_method, timeout, process_group_backend: as for Fabric's ``DDPStrategy``; ``timeout`` holds for every
            process group (a stalled neighbour raises after it). Other keyword arguments go to
            ``DistributedDataParallel`` (e.g. ``bucket_cap_mb``, ``gradient_as_bucket_view``; ``broadcast_buffers``
            defaults to whether there are several data-parallel replicas: a spatial group's ranks compute the same
            buffers).
    """

    strategy_name = "spatial_tp"

    def __init__(
        self,
        spatial_size: int | tuple[int, int] | None = None,
        shard_dim: Literal["width", "height"] = "width",
        shard_select: Select | None = None,
        fallback: FallbackMode = "warn",
        cuda_graphs: CudaGraphs = "auto",
        bev_shard: Literal["x", "y", "xy"] | None = None,
        bev_planes: BevPlanes | None = None,
        sync_batchnorm: bool = False,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision=None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_wrapper: Callable | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        if spatial_size == "auto":
            raise ValueError(
                "spatial_size='auto' chooses the size from a probe of the Trainer's first training step; under Fabric "
                "give the ranks per spatial group: an int (along shard_dim) or an (h, w) pair"
            )
        check_options(spatial_size, shard_dim, fallback, cuda_graphs, bev_shard, bev_planes)
        ddp_kwargs.setdefault("gradient_as_bucket_view", True)  # no second copy of the gradients
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **ddp_kwargs,
        )
        self._spatial_size = spatial_size
        self._shard_dim = shard_dim
        self._shard_select = shard_select
        self._fallback = fallback
        self._bev_shard = bev_shard
        self._bev_planes = {name: tuple(dims) for name, dims in (bev_planes or {}).items()}
        self._auto_graphs = cuda_graphs == "auto"
        self._cuda_graphs = graph_names(cuda_graphs)
        self._sync_batchnorm = sync_batchnorm
        self._user_comm_hook = (ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper)
        self.dims: SpatialDims | None = None  # known when Fabric has counted the processes (_configure_launcher)
        self.groups: SpatialGroups | None = None
        self._run: RunScope | None = None  # what setup_environment entered, closed at teardown
        self._first_steps: list[_FirstTrainingStep] = []  # cuda_graphs="auto": watched until the first backward
        self._in_process = False
        self._group_to_close = False

    @property
    def axes(self) -> dict[int, Axis]:
        """This rank's spatial axes by tensor dim (-2 height, -1 width), those of more than one rank."""
        return self.groups.axes if self.groups is not None else {}

    @property
    def data_group(self) -> dist.ProcessGroup:
        """The data axis's process group: pass it to metrics created outside the set-up module."""
        return self.groups.data_axis.group

    @override
    def _configure_launcher(self) -> None:
        """The script launcher where the processes exist, this process for one rank (``_launch``)."""
        world = self.num_nodes * self.num_processes  # a size that does not divide it raises now, before any rank starts
        self.dims = SpatialDims.from_strategy_args(world, self._spatial_size, self._shard_dim, self.num_processes)
        kind = launch_kind(self.cluster_environment, self.num_processes, self.num_nodes)
        self._in_process = kind == "in_process"
        if kind == "external":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        elif self._in_process:
            self._launcher = _InProcessLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        if self._in_process and not dist.is_initialized():
            self._group_to_close = True
        super().setup_environment()
        if self.groups is not None:  # launched before
            return
        self.groups = SpatialGroups.build(self.dims, self.root_device, self._timeout)
        data = self.groups.data_axis if self._sync_batchnorm and self.axes and self.dims.data > 1 else None
        self._run = RunScope(self._fallback, data, self.data_group, bev_shard=self._bev_shard)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        assert self.groups is not None, "fabric.launch() builds the mesh"
        return self.groups.sampler_kwargs(self.global_rank)

    @override
    def setup_module(self, module: torch.nn.Module) -> DistributedDataParallel:
        if self._sync_batchnorm and not self.axes:  # no sharded BatchNorm to span the data axis: torch's does
            module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
        self._run.enter_context(cutting_bev_planes(module, self._bev_planes, self.axes, self._bev_shard))
        self._run.enter_context(graphed(module, self._cuda_graphs))  # after: a wrapper holds no parameter
        watch = self._auto_graphs and self.root_device.type == "cuda"
        if watch:
            self._first_steps.append(_FirstTrainingStep(module))
        before_ddp(module, self._run)
        kwargs = ddp_options(self.dims, self._ddp_kwargs)
        ddp = _NamingDistributedDataParallel(module, device_ids=self._determine_ddp_device_ids(), **kwargs)
        register_comm_hook(ddp, self.dims, self._user_comm_hook, replays=bool(self._cuda_graphs) or watch)
        self._run.adopt(module)
        return ddp

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return sharded(dataloader, self.axes, self._shard_select)

    @override
    def backward(self, tensor: torch.Tensor, module: torch.nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Each of the ``S`` ranks of a spatial group seeds ``1/S`` of the replicated loss's gradient."""
        super().backward(share(tensor, self.dims), module, *args, **kwargs)
        for step in [s for s in self._first_steps if s.ran]:
            self._first_steps.remove(step)
            chosen, left = step.choose()
            self._run.enter_context(graphed(step.module, chosen))
            rank_zero_info(capture.describe(chosen, left))

    @override
    def all_reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Over the data axis: spatial ranks hold the same values (``SpatialGroups.reduce``)."""
        return self.groups.reduce(tensor, group, reduce_op) if isinstance(tensor, torch.Tensor) else tensor

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        """One row per data replica."""
        return self.groups.all_gather(tensor, group, sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank votes, so count over the world, not the data axis."""
        return self.groups.all_true(decision, all, self.root_device)

    @override
    def teardown(self) -> None:
        """Fabric does not call it; a loop that builds another ``Fabric`` in this process may."""
        if self._run is not None:
            self._run.close()
            self._run = None
        super().teardown()
        if self._group_to_close:
            dist.destroy_process_group()
            Axis.forget_groups()
            self.groups = None
            self._group_to_close = False

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register(strategy_registry, cls)


class _NamingDistributedDataParallel(DistributedDataParallel):
    """DDP whose forward re-raises a ``LayoutError`` (a layer output smaller than its ranks) with the path of the
    layer it came from, as the Trainer strategy's steps do (``naming_the_layer``)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with naming_the_layer():
            return super().forward(*args, **kwargs)


class _FirstTrainingStep:
    """``cuda_graphs="auto"``: a ``Watch`` over ``module``'s submodules during its first forward in training mode
    with autograd on (a validation forward before it does not count), read at the following backward."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.watch = module, Watch(module)
        self.watching = self.ran = False
        self._hooks = [module.register_forward_pre_hook(self._enter), module.register_forward_hook(self._exit)]

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled() and not self.ran:
            self.watching = True
            self.watch.__enter__()

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.watching:
            self.watch.__exit__()
            self.watching, self.ran = False, True
            for hook in self._hooks:
                hook.remove()

    def choose(self) -> tuple[list[str], dict[str, str]]:
        return capture.choose(self.module, self.watch.seen)


class _InProcessLauncher(_SubprocessScriptLauncher):
    """One rank, run in this process, the environment kept (``_launch.environment_kept``)."""

    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        with environment_kept():
            return super().launch(function, *args, **kwargs)


__all__ = ["SpatialParallelStrategy"]
