"""``HorovodStrategy``: data parallel training on real Horovod, launched with ``horovodrun``.

    horovodrun -np 8 -H host1:4,host2:4 python train.py      # one process per device; NCCL on GPU
    horovodrun --gloo -np 2 -H localhost:2 python train.py   # CPU, gloo

Lightning 1.x's behaviour, made explicit: parameters and optimizer state are broadcast from rank 0;
optimizers are wrapped in ``hvd.DistributedOptimizer`` with ``backward_passes_per_step`` equal to
``accumulate_grad_batches`` and synchronised after the last backward of each accumulation window;
``reduce``/``all_gather``/``broadcast``/``barrier`` go through Horovod; rank 0 writes checkpoints. With
``bucket_mb``, gradients travel as DDP's do instead: in buckets, one grouped all-reduce each (``GradientBuckets``). The
learning rate is scaled by the world size only when asked (``scale_lr_by_world_size=True``, logged). Validation
and test see each sample once (unpadded sampling), as under ``spatial_tp`` (``_loaders``).
Install Horovod with ``python -m lightning_spatial.install_horovod``.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from functools import partial
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch.distributed import ReduceOp
from typing_extensions import override

from ._loaders import exact_mean, prepare_loader

INSTALL_HINT = "install it with `python -m lightning_spatial.install_horovod`"
LAUNCH_HINT = "launch with `horovodrun -np N -H localhost:N python train.py` (add --gloo on CPU)"


def import_horovod():
    """``horovod.torch``, or an error that says how to install, build or launch it."""
    try:
        import horovod  # noqa: F401
    except ImportError as err:
        raise ImportError(f"HorovodStrategy needs Horovod, which is not installed: {INSTALL_HINT}") from err
    try:
        import horovod.torch as hvd
    except ImportError as err:
        raise ImportError(f"Horovod is installed without PyTorch support ({err}); rebuild it: {INSTALL_HINT}") from err
    return hvd


def launched_by_horovodrun() -> bool:
    return "HOROVOD_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_RANK" in os.environ


class HorovodStrategy(ParallelStrategy):
    """Data parallel training with Horovod (see the module docstring).

    Args:
        scale_lr_by_world_size: multiply every learning rate (and schedulers' base rates) by the world size.
        compression: ``"none"`` or ``"fp16"`` gradient compression for the all-reduce.
        fusion_threshold_bytes: Horovod's tensor fusion buffer (``HOROVOD_FUSION_THRESHOLD``).
        cycle_time_ms: Horovod's cycle time (``HOROVOD_CYCLE_TIME``).
        groups: reduce the gradients in this many explicit groups (Horovod's grouped all-reduce: one
            negotiation per group instead of per tensor, each group sent once all its gradients are ready).
        bucket_mb: reduce the gradients in buckets of about this many MiB, filled in backward order, each sent
            as one grouped all-reduce as soon as its last gradient is accumulated (DDP's ``bucket_cap_mb``; 25
            is DDP's default) instead of through ``hvd.DistributedOptimizer``, whose Python hook per parameter
            and per-cycle fusion of whatever is ready cost a host-bound step time (docs/benchmarks.md).
        timeline: write a Horovod timeline (``HOROVOD_TIMELINE``) to this path.
        async_completion: on GPUs, a finished all-reduce is ordered on the CUDA stream instead of waited for
            by the host (``HOROVOD_ENABLE_ASYNC_COMPLETION``): the host keeps queueing kernels, as DDP does.
    """

    strategy_name = "horovod"

    def __init__(
        self,
        accelerator=None,
        parallel_devices=None,
        checkpoint_io=None,
        precision_plugin=None,
        scale_lr_by_world_size: bool = False,
        compression: Literal["none", "fp16"] = "none",
        fusion_threshold_bytes: int | None = None,
        cycle_time_ms: float | None = None,
        groups: int | None = None,
        bucket_mb: float | None = None,
        timeline: str | None = None,
        async_completion: bool = False,
    ) -> None:
        if compression not in ("none", "fp16"):
            raise ValueError(f"compression must be 'none' or 'fp16', got {compression!r}")
        if groups is not None and groups < 1:
            raise ValueError(f"groups must be a positive number of gradient groups or None, got {groups!r}")
        if bucket_mb is not None and not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be a positive bucket size in MiB or None, got {bucket_mb!r}")
        if bucket_mb is not None and groups is not None:
            raise ValueError("groups and bucket_mb are two ways to group gradients: set one of them")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.scale_lr_by_world_size = scale_lr_by_world_size
        self.compression = compression
        self.groups = groups
        self.bucket_mb = bucket_mb
        self._buckets: GradientBuckets | None = None
        self._env = {
            "HOROVOD_FUSION_THRESHOLD": fusion_threshold_bytes,
            "HOROVOD_CYCLE_TIME": cycle_time_ms,
            "HOROVOD_TIMELINE": timeline,
            "HOROVOD_ENABLE_ASYNC_COMPLETION": 1 if async_completion else None,
        }
        self._exit_stack: ExitStack | None = None
        self._hvd = None

    @property
    def hvd(self):
        if self._hvd is None:
            self._hvd = import_horovod()
        return self._hvd

    @property
    @override
    def global_rank(self) -> int:
        return self.hvd.rank()

    @property
    @override
    def local_rank(self) -> int:
        return self.hvd.local_rank()

    @property
    @override
    def world_size(self) -> int:
        return self.hvd.size()

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        device = self.parallel_devices[0]
        return torch.device("cuda", self.local_rank) if device.type == "cuda" else device

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning's connector to inject the DistributedSampler (custom strategies must say so)."""
        return True

    @override
    def _configure_launcher(self) -> None:
        self._launcher = None  # horovodrun starts the processes

    @override
    def setup_environment(self) -> None:
        hvd = self.hvd
        if not launched_by_horovodrun():
            raise RuntimeError(f"HorovodStrategy was started without horovodrun: {LAUNCH_HINT}")
        for key, value in self._env.items():
            if value is not None:
                os.environ[key] = str(value)
        hvd.init()
        # horovodrun sets no RANK that Lightning reads at import: without this every rank would act as rank zero
        # (loggers writing one file from two processes, messages printed twice)
        rank_zero_only.rank = self.global_rank
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        super().setup_environment()

    def _gather_for_metrics(self, tensor: torch.Tensor, group: Any | None = None) -> list[torch.Tensor]:
        """torchmetrics' ``dist_sync_fn`` through Horovod: every rank's tensor, in rank order. Outside inference mode,
        which Lightning's evaluation loops enter without torch.distributed: Horovod resizes its outputs in its own
        thread, and an output made in inference mode may not be resized there."""
        with torch.inference_mode(False):
            if tensor.dim() == 0:
                return list(self.hvd.allgather(tensor.reshape(1)).unbind(0))
            sizes = self.hvd.allgather(torch.tensor([tensor.shape[0]]))
            return list(self.hvd.allgather(tensor).split(sizes.tolist()))

    def _sync_metrics_through_horovod(self) -> None:
        """torchmetrics syncs through torch.distributed, which Horovod does not initialise: route it here."""
        from torchmetrics import Metric

        for module in self.lightning_module.modules():
            if isinstance(module, Metric):
                module.dist_sync_fn = self._gather_for_metrics
                module.distributed_available_fn = lambda: self.world_size > 1

    @override
    def setup(self, trainer: L.Trainer) -> None:
        self.model_to_device()
        super().setup(trainer)
        self._sync_metrics_through_horovod()
        self._exit_stack = ExitStack()
        self._exit_stack.__enter__()
        if not trainer.training:
            return
        hvd = self.hvd
        optimizers = [getattr(opt, "_optimizer", opt) for opt in self.optimizers]
        if self.scale_lr_by_world_size:
            rank_zero_info(f"HorovodStrategy: scaling learning rates by the world size {self.world_size}")
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    group["lr"] *= self.world_size
            for config in self.lr_scheduler_configs:
                config.scheduler.base_lrs = [lr * self.world_size for lr in config.scheduler.base_lrs]
        hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
        for optimizer in optimizers:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        self._accumulate = trainer.accumulate_grad_batches
        compression = hvd.Compression.fp16 if self.compression == "fp16" else hvd.Compression.none
        if self.bucket_mb is not None:
            trained = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
            params = [p for p in self.lightning_module.parameters() if id(p) in trained and p.requires_grad]
            self._buckets = GradientBuckets(hvd, params, int(self.bucket_mb * 2**20), compression)
            return
        params = dict(self.lightning_module.named_parameters())
        self.optimizers = [
            hvd.DistributedOptimizer(
                opt,
                named_parameters=[
                    (n, p) for n, p in params.items() if any(p is q for g in opt.param_groups for q in g["params"])
                ],
                compression=compression,
                groups=self.groups,
                backward_passes_per_step=self._accumulate,
            )
            for opt in optimizers
        ]
        for optimizer in self.optimizers:  # we synchronise explicitly after the window's last backward
            self._exit_stack.enter_context(optimizer.skip_synchronize())

    def _last_backward_of_window(self) -> bool:
        trainer = self.lightning_module.trainer
        return trainer.training and not trainer.fit_loop.epoch_loop._should_accumulate()

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self._buckets is not None:
            self._buckets.armed = self._last_backward_of_window()

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if not self._last_backward_of_window():
            return
        if self._buckets is not None:
            self._buckets.synchronize()
            return
        for optimizer in self.optimizers:
            optimizer.synchronize()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Unpadded sampling for validation and test; a resumed epoch's saved order (``_loaders``)."""
        return prepare_loader(dataloader, self.lightning_module.trainer)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.hvd.join()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return self.hvd.broadcast_object(obj, root_rank=src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if group is not None:
            raise ValueError(
                "HorovodStrategy reduces over all processes; Horovod has no sub-groups here. Unset `group`."
            )
        if reduce_op in (None, "avg", "mean"):
            op = self.hvd.Average
        elif reduce_op in ("sum", ReduceOp.SUM):
            op = self.hvd.Sum
        else:
            raise ValueError(f"HorovodStrategy: unsupported reduce_op {reduce_op!r}; use 'mean' or 'sum'")
        return self.hvd.allreduce(exact_mean(tensor, reduce_op), op=op)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        if group is not None:
            raise ValueError("HorovodStrategy gathers over all processes. Unset `group`.")
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
        return self.hvd.allgather(tensor).view(self.world_size, *tensor.shape)

    @override
    def teardown(self) -> None:
        super().teardown()
        if self._exit_stack is not None:
            self._exit_stack.__exit__(None, None, None)
            self._exit_stack = None
        if self._buckets is not None:
            self._buckets.remove()
            self._buckets = None
        if self._hvd is not None and self._hvd.is_initialized():
            self._hvd.join()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Data parallel training on Horovod")


class GradientBuckets:
    """DDP's gradient buckets on Horovod: parameters in reverse order (backward's, roughly) fill buckets of
    ``cap_bytes`` (one dtype each); a light hook per parameter counts accumulated gradients, and a bucket's
    last one sends the bucket as one grouped all-reduce (average over ranks) while backward goes on.

    Hooks count only while ``armed`` (the last backward of an accumulation window). ``synchronize`` sends
    the buckets whose gradients did not all arrive, a parameter without a gradient contributing zeros (as
    ``hvd.DistributedOptimizer`` does: ranks must send the same tensors), then waits for every bucket."""

    def __init__(self, hvd, params: list[torch.Tensor], cap_bytes: int, compression) -> None:
        self.hvd, self.compression, self.armed = hvd, compression, False
        self.buckets: list[list[torch.Tensor]] = []
        size = 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            last = self.buckets[-1] if self.buckets else None
            if last is None or size + nbytes > cap_bytes or p.dtype != last[0].dtype or p.device != last[0].device:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self._left = [len(b) for b in self.buckets]
        self._sent: dict[int, tuple] = {}
        self._hooks = [
            p.register_post_accumulate_grad_hook(partial(self._accumulated, i))
            for i, bucket in enumerate(self.buckets)
            for p in bucket
        ]

    def _accumulated(self, index: int, _param: torch.Tensor) -> None:
        if self.armed:
            self._left[index] -= 1
            if self._left[index] == 0:
                self._send(index)

    def _send(self, index: int) -> None:
        grads = []
        for p in self.buckets[index]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        name = f"lightning_spatial.bucket.{index}"
        if self.compression is self.hvd.Compression.none:  # in place: no copy of the gradients
            self._sent[index] = (self.hvd.grouped_allreduce_async_(grads, op=self.hvd.Average, name=name), None, None)
            return
        packed, contexts = zip(*(self.compression.compress(g) for g in grads))
        handle = self.hvd.grouped_allreduce_async(list(packed), op=self.hvd.Average, name=name)
        self._sent[index] = (handle, grads, contexts)

    def synchronize(self) -> None:
        for index in range(len(self.buckets)):
            if index not in self._sent:
                self._send(index)
        for handle, grads, contexts in self._sent.values():
            reduced = self.hvd.synchronize(handle)
            if grads is not None:
                for grad, out, context in zip(grads, reduced, contexts):
                    grad.copy_(self.compression.decompress(out, context))
        self._sent.clear()
        self._left = [len(b) for b in self.buckets]
        self.armed = False

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


__all__ = ["HorovodStrategy", "import_horovod"]
