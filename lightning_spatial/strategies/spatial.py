"""``SpatialParallelStrategy``: spatial x data parallel training with no change to the LightningModule.

The hooks, each small, on the core that the Fabric strategy (``lightning_spatial.fabric``) shares: ``_options``,
``_groups``, ``_gradients``, ``_loaders``, ``_scopes``, ``_launch``.

- ``setup_environment``: the (data, spatial_h, spatial_w) DeviceMesh, every group with the strategy's
  ``timeout``; every rank of a spatial group gets the same random stream (dropout masks must agree). With
  ``spatial_size="auto"`` the mesh waits for ``setup``, where ``plan.make_plan`` chooses it from a probe of the
  model on the first training batch (other stages reuse this process's last plan, or probe the training data too);
  ``global_batch_size`` then sets the gradient accumulation that keeps the global batch.
- ``process_dataloader``: the collate hook cuts image-sized tensors to this rank's rows; the sampler
  splits samples over the data axis only (``distributed_sampler_kwargs``), unpadded for validation and test (each
  sample counted once), and a resumed training epoch draws its saved order (``_loaders``).
- the model needs no preparation: its inputs are ``SpatialTensor`` shards, so every conv, pool, norm,
  loss (functional calls included) dispatches to the exact spatial ops.
- gradients (the split-gradient convention, docs/design.md; ``_gradients``): ``backward`` seeds the replicated
  loss with ``1/S`` on each of the ``S`` ranks of a spatial group; DDP sums the gradient shares over the world and
  the comm hook divides by the data-parallel size only.
- ``reduce``/``all_gather`` and torchmetrics sync over the data axis (spatial ranks hold the same values;
  ``_groups``).
- ``predict_step`` returns full tensors (sharded outputs gathered), one copy per spatial rank.
- checkpoints: parameters and buffers are plain replicated tensors; rank 0 saves a standard checkpoint.
- for the run (``setup`` to ``teardown``), one ``run.Run`` the op layer reads: the ``fallback`` mode, BatchNorm's
  data axis, module paths for messages, DDP's bucket views for replays; and the run's torchmetrics sync group and
  CUDA graphs of named submodules (``_scopes.RunScope``); all undone at ``teardown``, dynamo's ``optimize_ddp``
  included.
- ``torch.compile``d modules compile through the shards (``compiling``): halo exchanges and collectives are
  graph ops.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.ddp import default_pg_timeout
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map
from typing_extensions import override

from .. import capture
from .._arguments import integers
from ..capture import Watch
from ..mesh import Axis, SpatialDims
from ..plan import Plan, accumulation, describe_batches, make_plan, parse_budget
from ..run import FallbackMode
from ..sharding import Select, describe
from ..tensor import SpatialTensor, gather
from ._gradients import before_ddp, ddp_options, register_comm_hook, share
from ._groups import SpatialGroups
from ._launch import environment_kept, launch_kind, register
from ._loaders import prepare_loader, sharded
from ._options import BevPlanes, CudaGraphs, check_options, graph_names
from ._scopes import RunScope, cutting_bev_planes, graphed, naming_the_layer


class SpatialParallelStrategy(DDPStrategy):
    """Shard activations along height, width or both over a spatial group; data parallel across groups.

    Args:
        spatial_size: ranks per spatial group: an int along ``shard_dim``, or ``(h, w)`` tiles. Default: all
            processes of a node. ``"auto"``: the smallest size (dividing the processes of a node) whose estimated
            per-rank memory fits ``memory_budget``, as width, height or tiles, whichever exchanges the fewest halo
            bytes; chosen in ``setup`` from one probe step of the model on the first training batch and logged
            (``lightning_spatial/plan.py``, docs/recipes.md).
        shard_dim: ``"width"`` or ``"height"`` (for an int ``spatial_size``; ``"auto"`` considers both).
        memory_budget: bytes one rank may use (an int, or a string such as ``"70GiB"``), for ``"auto"`` only.
            Default: 90% of the free memory of each device (of the host, split over a node's processes, on
            CPU), the smallest over ranks.
        global_batch_size: samples per optimizer step, for ``"auto"`` only. The plan's spatial size sets the
            data-parallel size (processes / spatial size), so with a fixed DataLoader batch size the global batch
            and the steps per epoch would follow the free memory; this keeps the global batch by gradient
            accumulation (``trainer.accumulate_grad_batches``, set before the optimizers are configured), and the
            batch the probe measured stays the batch of each replica. Unreachable (not a multiple of replicas x
            batch size) raises naming the sizes. Either way the plan logs the data-parallel size, the batch per
            replica, the global batch and the optimizer steps per epoch when training starts.
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
        cuda_graphs: which submodules' training forward and backward replay as CUDA graphs after two eager calls
            (``graphs.CUDAGraphed``): no per-op Python in the step. ``"auto"`` (default): on CUDA, the largest
            submodules that run once a training step on sharded activations, found in the first step
            (``capture``; the image encoders of camera models, decoder layers over their camera tokens) and logged
            with the reasons for the rest; ``False`` (or ``[]``): none; a list of names (``["backbone"]``, as
            ``get_submodule`` names them). Eager off CUDA, in validation and wherever a capture fails (with a
            warning); each new input shape is captured after its own two calls (up to 4). Checkpoints keep the
            module's own names.
        ddp_comm_hook, ddp_comm_state, ddp_comm_wrapper: as for ``DDPStrategy`` (e.g. fp16 compression),
            registered on CPU and GPU; the hook averages over the world, and its result is scaled to the
            data-parallel mean (see the module docstring).
        start_method, timeout, process_group_backend: as for ``DDPStrategy``; ``timeout`` holds for every
            process group (a stalled neighbour raises after it). Other keyword arguments go to
            ``DistributedDataParallel`` (e.g. ``bucket_cap_mb``, ``gradient_as_bucket_view``; ``broadcast_buffers``
            defaults to whether there are several data-parallel replicas: a spatial group's ranks compute the same
            buffers).
    """

    strategy_name = "spatial_tp"

    def __init__(
        self,
        spatial_size: int | tuple[int, int] | Literal["auto"] | None = None,
        shard_dim: Literal["width", "height"] = "width",
        memory_budget: int | str | None = None,
        global_batch_size: int | None = None,
        shard_select: Select | None = None,
        fallback: FallbackMode = "warn",
        cuda_graphs: CudaGraphs = "auto",
        bev_shard: Literal["x", "y", "xy"] | None = None,
        bev_planes: BevPlanes | None = None,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_wrapper: Callable | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        check_options(spatial_size, shard_dim, fallback, cuda_graphs, bev_shard, bev_planes)  # now, not in the ranks
        auto = spatial_size == "auto"
        if memory_budget is not None and not auto:
            raise ValueError(f"memory_budget is for spatial_size='auto', got spatial_size={spatial_size!r}")
        if global_batch_size is not None and not auto:
            raise ValueError(
                f"global_batch_size is for spatial_size='auto', got spatial_size={spatial_size!r}: a fixed spatial "
                "size fixes the data-parallel size, and Trainer(accumulate_grad_batches=...) the global batch"
            )
        if global_batch_size is not None:
            integers(1, global_batch_size=global_batch_size)
        ddp_kwargs.setdefault("gradient_as_bucket_view", True)  # no second copy of the gradients
        super().__init__(  # the comm hook is ours to register (DDPStrategy would do it on CUDA only, unscaled)
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **ddp_kwargs,
        )
        self._spatial_size = spatial_size
        self._memory_budget = parse_budget(memory_budget)
        self._global_batch_size = global_batch_size
        self._accumulation = 1  # what global_batch_size set trainer.accumulate_grad_batches to
        self._shard_dim = shard_dim
        self._shard_select = shard_select
        self._fallback = fallback
        self._bev_shard = bev_shard
        self._bev_planes = {name: tuple(dims) for name, dims in (bev_planes or {}).items()}
        # "auto": chosen after watching the first training step (lightning_spatial.capture); names: wrapped at setup
        self._auto_graphs = cuda_graphs == "auto"
        self._cache_released: weakref.WeakSet = weakref.WeakSet()  # optimizers whose first step gave it back
        self._cuda_graphs = graph_names(cuda_graphs)
        self._user_comm_hook = (ddp_comm_state, ddp_comm_hook, ddp_comm_wrapper)
        self.dims: SpatialDims | None = None
        self.plan: Plan | None = None  # spatial_size="auto": the chosen layout with every candidate's estimate
        self.groups: SpatialGroups | None = None
        self._sync_batchnorm = False
        self._run: RunScope | None = None  # what setup entered, closed at teardown
        self._watch: Watch | None = None  # cuda_graphs="auto": what the first training step shows
        self._metrics_claimed_at: set[tuple] = set()  # (stage, epoch, before/after the first step) claimed
        self._in_process = False  # one rank, run in this process (no launcher): its process group ends with it
        self._group_to_close = False
        self._described = False

    @override
    def _configure_launcher(self) -> None:
        """The script launcher where the processes exist, this process for one rank (``_launch``)."""
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
            self._group_to_close = True  # (Lightning calls this twice: the second time the group exists)
        super().setup_environment()
        if self._spatial_size != "auto":
            self._build(
                SpatialDims.from_strategy_args(self.world_size, self._spatial_size, self._shard_dim, self.num_processes)
            )

    def _build(self, dims: SpatialDims) -> None:
        """The mesh, the axes of this rank and the shared random stream (collective)."""
        self.dims = dims
        self.groups = SpatialGroups.build(dims, self.root_device, self._timeout)

    @property
    def mesh(self):
        return self.groups.mesh if self.groups is not None else None

    @property
    def axes(self) -> dict[int, Axis]:
        """This rank's spatial axes by tensor dim (-2 height, -1 width), those of more than one rank."""
        return self.groups.axes if self.groups is not None else {}

    @property
    def data_group(self):
        return self.groups.data_axis.group

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        assert self.groups is not None
        return self.groups.sampler_kwargs(self.global_rank)

    @override
    def setup(self, trainer: L.Trainer) -> None:
        if self._spatial_size == "auto":
            self._build(self._planned(trainer).dims)
        if self._layer_sync is not None and self.axes:  # SyncBatchNorm: our batch_norm also spans the data axis
            self._layer_sync, self._sync_batchnorm = None, True
        data_axis = self.groups.data_axis if self._sync_batchnorm and self.dims.data > 1 else None
        # one rank with PyTorch's fake backend (benchmarks): messages never arrive, and received halos read as zeros
        fake = dist.get_backend() == "fake"
        self._run = RunScope(self._fallback, data_axis, self.data_group, fake, self._bev_shard)
        # the planes' owners found before named submodules are wrapped for graphs (a wrapper holds no parameter)
        self._run.enter_context(cutting_bev_planes(self.lightning_module, self._bev_planes, self.axes, self._bev_shard))
        self._run.enter_context(graphed(self.lightning_module, self._cuda_graphs))
        self._watch = Watch(self.lightning_module) if self._auto_graphs and self.root_device.type == "cuda" else None
        super().setup(trainer)
        self._run.adopt(self.lightning_module)

    def _planned(self, trainer) -> Plan:
        """A plan from the first training batch; ``validate``/``test``/``predict`` reuse this process's last one."""
        if trainer.state.fn == TrainerFn.FITTING or self.plan is None:
            gradient_copy = not self._ddp_kwargs.get("gradient_as_bucket_view", False)
            self.plan = make_plan(self, trainer, self._memory_budget, self._shard_select, gradient_copy)
            rank_zero_info(self.plan.describe())
            if self._global_batch_size is not None and trainer.state.fn == TrainerFn.FITTING:
                self._keep_global_batch(trainer)
        return self.plan

    def _keep_global_batch(self, trainer) -> None:
        """Gradient accumulation that makes ``global_batch_size`` from the plan's replicas and batch size."""
        scheduled = any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks)
        if trainer.accumulate_grad_batches not in (1, self._accumulation) or scheduled:
            raise ValueError(
                f"global_batch_size={self._global_batch_size} sets the gradient accumulation itself: remove "
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) or the "
                "GradientAccumulationScheduler, or leave global_batch_size out"
            )
        self._accumulation = trainer.accumulate_grad_batches = accumulation(self._global_batch_size, self.plan)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.plan is not None:  # spatial_size="auto": what the plan made of the batches
            trainer = self.lightning_module.trainer
            rank_zero_info(describe_batches(self.plan, trainer.accumulate_grad_batches, trainer.num_training_batches))

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        """DDP built on the current stream. Lightning 2.6 builds it on a side stream, for capturing the whole
        network as a CUDA graph; then the gradient accumulators DDP keeps belong to that stream, and every backward
        on the default one warns of the mismatch and may synchronize (Lightning #21567). Our graphs read aliases
        of the parameters (lightning_spatial.graphs) and do not need it."""
        kwargs = ddp_options(self.dims, self._ddp_kwargs)
        return DistributedDataParallel(model, device_ids=self.determine_ddp_device_ids(), **kwargs)

    @override
    def configure_ddp(self) -> None:
        before_ddp(self.model, self._run)
        super().configure_ddp()
        replays = bool(self._cuda_graphs) or self._watch is not None  # replays write into DDP's buckets
        register_comm_hook(self.model, self.dims, self._user_comm_hook, replays)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """With CUDA graphs, the caching allocator gives back what the step's activations left free before each
        optimizer's first step allocates its state (AdamW: two tensors per parameter): the state then takes segments
        of its own instead of pinning the activations' ones, which the eager allocator would keep reserved, mostly
        free, once the activations live in the graphs' pool."""
        graphs = self._cuda_graphs or self._auto_graphs
        if self.root_device.type == "cuda" and graphs and optimizer not in self._cache_released:
            self._cache_released.add(optimizer)  # once: a stateless optimizer (plain SGD) would sync every step
            closure = _releasing_cache_after(closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: torch.optim.Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Each of the ``S`` ranks of a spatial group seeds ``1/S`` of the replicated loss's gradient."""
        return super().backward(share(closure_loss, self.dims), optimizer, *args, **kwargs)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return sharded(prepare_loader(dataloader, self.lightning_module.trainer), self.axes, self._shard_select)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if self.axes and not self._described:  # once per run: which tensors the collate hook sharded
            self._described = True
            rank_zero_info(f"lightning_spatial: {describe(batch)}")
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """Over the data axis (``SpatialGroups.reduce``)."""
        return self.groups.reduce(tensor, group, reduce_op) if isinstance(tensor, torch.Tensor) else tensor

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        """One rank with PyTorch's fake backend (``FakeRank``) receives nothing: its own object stands for rank 0's."""
        return obj if dist.get_backend() == "fake" else super().broadcast(obj, src)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank votes (ModelCheckpoint, EarlyStopping), so count over the world, not the data axis."""
        return self.groups.all_true(decision, all, self.root_device)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        return self.groups.all_gather(tensor, group, sync_grads)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._claim_metrics("before")
        watch, self._watch = self._watch, None  # the first training step only (cuda_graphs="auto")
        with naming_the_layer(), watch or nullcontext():
            out = super().training_step(*args, **kwargs)
        if watch is not None:
            self._capture(capture.choose(self.lightning_module, watch.seen))
        self._claim_metrics("after")
        return out

    def _capture(self, plan: tuple[list[str], dict[str, str]]) -> None:
        """Wrap what ``cuda_graphs="auto"`` chose for the rest of the run, and say so once."""
        chosen, left = plan
        self._run.enter_context(graphed(self.lightning_module, chosen))
        rank_zero_info(capture.describe(chosen, left))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._claim_metrics("before")
        with naming_the_layer():
            out = super().validation_step(*args, **kwargs)
        self._claim_metrics("after")
        return out

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        self._claim_metrics("before")
        with naming_the_layer():
            out = super().test_step(*args, **kwargs)
        self._claim_metrics("after")
        return out

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Predictions as full tensors: sharded outputs are gathered (every spatial rank returns the same)."""
        self._claim_metrics("before")
        with naming_the_layer():
            out = super().predict_step(*args, **kwargs)
        self._claim_metrics("after")
        return tree_map(lambda t: gather(t).detach() if isinstance(t, SpatialTensor) else t, out)

    def _claim_metrics(self, moment: str) -> None:
        """Before and after the first step of every epoch of every stage: the metrics created since then."""
        trainer = self.lightning_module.trainer
        when = (trainer.state.stage, trainer.current_epoch, moment)
        if self._run is not None and when not in self._metrics_claimed_at:
            self._metrics_claimed_at.add(when)
            self._run.metrics.claim(self.lightning_module)

    @override
    def teardown(self) -> None:
        if self._run is not None:
            self._run.close()
            self._run = None
            self._metrics_claimed_at.clear()
        super().teardown()
        if self._group_to_close:  # a later Trainer in this process may fork ranks of a larger world
            dist.destroy_process_group()
            Axis.forget_groups()
            self.groups = None
            self._group_to_close = False

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register(strategy_registry, cls)


class _InProcessLauncher(_SubprocessScriptLauncher):
    """One rank, run in this process, the environment kept (``_launch.environment_kept``)."""

    @override
    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        with environment_kept():
            return super().launch(function, *args, trainer=trainer, **kwargs)


__all__ = ["SpatialParallelStrategy"]


def _releasing_cache_after(closure: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        out = closure()
        torch.cuda.empty_cache()
        return out

    return run
