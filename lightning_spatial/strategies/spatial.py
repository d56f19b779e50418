"""``SpatialParallelStrategy``: spatial x data parallel training with no change to the LightningModule.

The hooks, each small:

- ``setup_environment``: the (data, spatial_h, spatial_w) DeviceMesh; every rank of a spatial group gets
  the same random stream (dropout masks must agree across a group).
- ``process_dataloader``: the collate hook cuts image-sized tensors to this rank's rows; the sampler
  splits samples over the data axis only (``distributed_sampler_kwargs``).
- the model needs no preparation: its inputs are ``SpatialTensor`` shards, so every conv, pool, norm,
  loss (functional calls included) dispatches to the exact spatial ops.
- gradients: weights stay replicated; DDP over the whole world averages gradients over ``world`` ranks.
  Under the split-gradient convention each spatial rank holds ``S x`` its share of the true gradient (the
  replicated loss back-propagates with gradient 1 on every rank), so the world average is exactly the
  data-parallel mean of true gradients: DDP's bucketing and overlap come for free, on CPU and GPU.
- ``reduce``/``all_gather`` and torchmetrics sync over the data axis (spatial ranks hold the same values).
- ``predict_step`` returns full tensors (sharded outputs gathered), one copy per spatial rank.
- checkpoints: parameters and buffers are plain replicated tensors; rank 0 saves a standard checkpoint.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.ddp import default_pg_timeout
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader
from typing_extensions import override

from ..layout import Axis
from ..mesh import SHARD_DIMS, SpatialDims
from ..ops import norm
from ..sharding import Select, ShardingCollate
from ..tensor import SpatialTensor, gather


class SpatialParallelStrategy(DDPStrategy):
    """Shard activations along height, width or both over a spatial group; data parallel across groups.

    Args:
        spatial_size: ranks per spatial group: an int along ``shard_dim``, or ``(h, w)`` tiles. Default: all
            processes of a node.
        shard_dim: ``"width"`` or ``"height"`` (for an int ``spatial_size``).
        shard_select: ``(path, tensor) -> bool`` choosing the batch tensors to shard; default: every tensor
            whose trailing two dims equal the image's (H, W).
        start_method, timeout, process_group_backend: as for ``DDPStrategy``; other keyword arguments go
            to ``DistributedDataParallel`` (e.g. ``bucket_cap_mb``, ``gradient_as_bucket_view``).
    """

    strategy_name = "spatial_tp"

    def __init__(
        self,
        spatial_size: int | tuple[int, int] | None = None,
        shard_dim: Literal["width", "height"] = "width",
        shard_select: Select | None = None,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        if shard_dim not in SHARD_DIMS:
            raise ValueError(f"shard_dim must be one of {SHARD_DIMS}, got {shard_dim!r}")
        if spatial_size is not None:  # validated fully once the world size is known
            SpatialDims.from_strategy_args(_product(spatial_size), spatial_size, shard_dim, 1)
        ddp_kwargs.setdefault("gradient_as_bucket_view", True)  # no second copy of the gradients
        super().__init__(
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
        self._shard_dim = shard_dim
        self._shard_select = shard_select
        self.dims: SpatialDims | None = None
        self.mesh = None
        self.axes: dict[int, Axis] = {}
        self._sync_batchnorm = False
        self._batch_norm_sync = None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.dims = SpatialDims.from_strategy_args(
            self.world_size, self._spatial_size, self._shard_dim, default=self.num_processes
        )
        self.mesh = self.dims.build(self.root_device.type)
        names = {-2: ("spatial_h", self.dims.spatial_h), -1: ("spatial_w", self.dims.spatial_w)}
        self.axes = {dim: Axis.from_group(self.mesh.get_group(name)) for dim, (name, n) in names.items() if n > 1}
        self._data_axis = Axis.from_group(self.mesh.get_group("data"))
        self._connect_axes()
        self._share_random_stream()

    def _connect_axes(self) -> None:
        """One collective per spatial axis group, with all its ranks: NCCL creates a group's communicator at
        its first call, and a first ``batch_isend_irecv`` must include every rank of the group, while a halo
        exchange may leave out ranks whose window is their own rows."""
        for axis in self.axes.values():
            dist.all_reduce(torch.zeros(1, device=self.root_device), group=axis.group)

    def _share_random_stream(self) -> None:
        """Give every rank its spatial group leader's RNG state (CPU and current CUDA device)."""
        states = [torch.get_rng_state()]
        if self.root_device.type == "cuda":
            states.append(torch.cuda.get_rng_state(self.root_device))
        leader = self.global_rank - self.global_rank % self.dims.spatial_size
        for k, state in enumerate(states):
            state = state.to(self.root_device) if self.root_device.type == "cuda" else state
            gathered = [torch.empty_like(state) for _ in range(self.world_size)]
            dist.all_gather(gathered, state)
            chosen = gathered[leader].cpu()
            torch.set_rng_state(chosen) if k == 0 else torch.cuda.set_rng_state(chosen, self.root_device)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        assert self.dims is not None
        return {"num_replicas": self.dims.data, "rank": self.dims.coordinates(self.global_rank)[0]}

    @property
    def data_group(self):
        return self._data_axis.group

    @override
    def setup(self, trainer) -> None:
        if self._layer_sync is not None and self.axes:  # SyncBatchNorm: our batch_norm also spans the data axis
            self._layer_sync, self._sync_batchnorm = None, True
        self._batch_norm_sync = norm.batch_norm_over(
            self._data_axis if self._sync_batchnorm and self.dims.data > 1 else None
        )
        self._batch_norm_sync.__enter__()
        super().setup(trainer)
        self._sync_metrics_over_data_axis()

    def _sync_metrics_over_data_axis(self) -> None:
        try:
            from torchmetrics import Metric
        except ImportError:  # pragma: no cover - torchmetrics is a dependency
            return
        for module in self.lightning_module.modules():
            if isinstance(module, Metric):
                module.process_group = self.data_group

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if isinstance(dataloader, DataLoader) and self.axes and not isinstance(dataloader.collate_fn, ShardingCollate):
            dataloader.collate_fn = ShardingCollate(dataloader.collate_fn, self.axes, self._shard_select)
        return dataloader

    @override
    def reduce(self, tensor, group: Any | None = None, reduce_op: Any | None = "mean"):
        """Spatial ranks hold the same logged values: reduce over the data axis unless told otherwise."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        tensor = gather(tensor) if isinstance(tensor, SpatialTensor) else tensor
        return _sync_ddp_if_available(tensor, group if group is not None else self.data_group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        tensor = gather(tensor) if isinstance(tensor, SpatialTensor) else tensor
        return super().all_gather(tensor, group if group is not None else self.data_group, sync_grads)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Predictions as full tensors: sharded outputs are gathered (every spatial rank returns the same)."""
        out = super().predict_step(*args, **kwargs)
        return tree_map(lambda t: gather(t).detach() if isinstance(t, SpatialTensor) else t, out)

    @override
    def teardown(self) -> None:
        if self._batch_norm_sync is not None:
            self._batch_norm_sync.__exit__(None, None, None)
            self._batch_norm_sync = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Spatial (height/width) x data parallel training"
        )
        strategy_registry.register(
            "spatial_tp_fork", cls, description="spatial_tp with the fork start method", start_method="fork"
        )


def _product(size) -> int:
    return size[0] * size[1] if isinstance(size, (tuple, list)) and len(size) == 2 else int(size)


__all__ = ["SpatialParallelStrategy"]
