"""Lightning callbacks: ``SpatialSummary`` says what a run did; ``LatestCheckpoint`` keeps last.ckpt the latest.

``SpatialSummary`` is printed by rank 0.
At the first training batch: the mesh (data x spatial ranks) and every batch tensor with its global shape
and, for sharded ones, each rank's shard shape. At the end of training: throughput, peak memory per rank
next to an estimate of what one device would need for the same samples, and where the checkpoint and the
logs went. It reads the strategy defensively, so it works (data parallel only) under any strategy.
At the end of every training epoch the run's throughput so far and the largest peak memory of a rank go to the
Trainer's loggers (TensorBoard, CSV): ``train/images``, ``train/time``, ``train/images_per_sec`` and
``train/peak_memory_mib``. Lightning's ``ThroughputMonitor`` would count each image once per spatial rank and
synchronise the GPU at every batch; this counts an image once per spatial group and synchronises once per epoch.

The one-device figure is an *estimate*: model state (parameters, gradients, optimizer state) plus the
activations that spatial group 0's ranks saved for backward in the first training step, added up (their
shards tile the full image). Transient buffers are not counted; halo windows and any tensor a spatial op
saves where the plain op would not are, so it overstates one device by our own per-rank overhead.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from .saved import SavedActivations
from .tensor import SpatialTensor

MIB = 2**20


class LatestCheckpoint(ModelCheckpoint):
    """last.ckpt (what ``ckpt_path=`` resumes from) as the latest state: rewritten at every validation, whatever
    the loss did (Lightning's ``save_last`` follows the monitored best), and when ``max_steps`` stops training
    between validations (``max_time`` and early stopping validate as they stop), so a resume loses no steps."""

    def __init__(self, dirpath: str | None = None, **kwargs: Any):
        super().__init__(dirpath=dirpath, filename="last", monitor=None, **kwargs)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, *args, **kwargs)
        # saved here, not at on_train_end: by then the loops count the epoch as done, and a resume would not train
        stopping = trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step
        if stopping and self._last_global_step_saved != trainer.global_step:
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))


class SpatialSummary(L.Callback):
    """Prints the mesh and batch shards at the start and throughput, memory and output paths at the end."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._val_seconds = 0.0
        self._val_start = 0.0
        self._images = 0
        self._saved_bytes = 0
        self._hooks = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _reset_peak(pl_module.device)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._start is None:
            self._print_start(trainer, batch)
            self._hooks = SavedActivations(pl_module)
            self._hooks.__enter__()
            _sync(pl_module.device)
            self._start = time.perf_counter()
        self._images += _images(batch)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._saved_bytes, self._hooks = self._hooks.nbytes, None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._start is not None:  # not the sanity check
            _sync(pl_module.device)
            self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._start is not None:
            _sync(pl_module.device)
            self._val_seconds += time.perf_counter() - self._val_start

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._start is None:
            return
        ranks = self._gather_progress(pl_module)
        if trainer.is_global_zero:
            images, seconds = _images_and_seconds(trainer, ranks)
            metrics = {
                "train/images": images,
                "train/time": seconds,
                "train/images_per_sec": images / seconds,
                "train/peak_memory_mib": max(r["peak"] for r in ranks) / MIB,
            }
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._start is None:
            return
        ranks = self._gather_progress(pl_module)
        if trainer.is_global_zero:
            self._print_end(trainer, pl_module, ranks)

    def _gather_progress(self, pl_module: L.LightningModule) -> list[dict]:
        """Every rank's training images, seconds (validation excluded), peak memory and saved activations so far."""
        _sync(pl_module.device)
        mine = {
            "images": self._images,
            "seconds": time.perf_counter() - self._start - self._val_seconds,
            "peak": _peak_bytes(pl_module.device),
            "saved": self._saved_bytes,
        }
        return _gather(mine)

    def _print_start(self, trainer: L.Trainer, batch: Any) -> None:
        leaves = [(keystr(path), leaf) for path, leaf in tree_flatten_with_path(batch)[0]]
        local = {path: _local_shape(leaf) for path, leaf in leaves if isinstance(leaf, torch.Tensor)}
        per_rank = _gather(local)
        if not trainer.is_global_zero:
            return
        lines = [f"mesh: {_mesh(trainer)}", *_comm_hook(trainer), "batch (first training batch):"]
        for path, leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                continue
            shards = [rank[path] for rank in per_rank]
            if shards[0] is None:
                lines.append(f"  batch{path} {_shape(leaf.shape)} not sharded")
            else:
                lines.append(f"  batch{path} {_shape(leaf.shape)} sharded: {_by_rank(shards)}")
        if len(per_rank) < trainer.world_size:
            lines.append("  (shards of rank 0 only: torch.distributed is not initialised under this strategy)")
        _print(trainer, "\n".join(lines))

    def _print_end(self, trainer: L.Trainer, pl_module: L.LightningModule, ranks: list[dict]) -> None:
        spatial = _spatial_size(trainer)
        images, seconds = _images_and_seconds(trainer, ranks)
        state = _model_state_bytes(trainer, pl_module)
        saved = [r["saved"] for r in ranks]
        one_device = state + sum(saved[:spatial])
        kind = "max_memory_allocated" if pl_module.device.type == "cuda" else "peak RSS of the process"
        lines = [
            f"throughput: {images / seconds:.1f} images/s ({images:.0f} training images in {seconds:.1f} s, "
            "validation excluded)",
            f"peak memory per rank ({kind}): " + ", ".join(f"r{i} {_mib(r['peak'])}" for i, r in enumerate(ranks)),
            f"  rank 0: model state {_mib(state)} + activations saved for backward {_mib(saved[0])}",
            f"  one device, same images (estimate: model state + the activations the {spatial} rank(s) of spatial "
            "group 0 saved; transient buffers not counted; overstated where the spatial ops save more per pixel "
            f"than the plain ones): {_mib(one_device)}",
        ]
        lines += _paths(trainer)
        _print(trainer, "\n".join(lines))


def _spatial_size(trainer: L.Trainer) -> int:
    dims = getattr(trainer.strategy, "dims", None)
    return dims.spatial_size if dims is not None else 1


def _images_and_seconds(trainer: L.Trainer, ranks: list[dict]) -> tuple[float, float]:
    """Training images of the run so far, each once (a spatial group's ranks see the same images), and the
    slowest rank's training seconds."""
    return sum(r["images"] for r in ranks) / _spatial_size(trainer), max(r["seconds"] for r in ranks)


def _mesh(trainer: L.Trainer) -> str:
    strategy = trainer.strategy
    dims = getattr(strategy, "dims", None)
    name = type(strategy).__name__
    if dims is None:
        return f"{trainer.world_size} rank(s) = data {trainer.world_size} x spatial 1 ({name}: data parallel only)"
    sharded = [name for dim, name in ((-2, "height"), (-1, "width")) if dim in getattr(strategy, "axes", {})]
    return (
        f"{dims.world_size} rank(s) = data {dims.data} x spatial {dims.spatial_size} "
        f"(tiles {dims.spatial_h}x{dims.spatial_w}, height x width; sharded dims: {', '.join(sharded) or 'none'}; "
        f"{name})"
    )


def _comm_hook(trainer: L.Trainer) -> list[str]:
    """A requested DDP comm hook (gradient compression) and whether it runs: SpatialParallelStrategy registers it
    on CPU and GPU, Lightning's DDP on CUDA only."""
    ours = getattr(trainer.strategy, "_user_comm_hook", None)
    hook = ours[1] if ours is not None else getattr(trainer.strategy, "_ddp_comm_hook", None)
    if hook is None:
        return []
    name = getattr(hook, "__name__", repr(hook))
    if ours is not None or trainer.strategy.root_device.type == "cuda":
        return [f"gradient all-reduce: DDP comm hook {name}"]
    return [f"gradient all-reduce: DDP comm hook {name} NOT registered (Lightning registers comm hooks on CUDA only)"]


def _paths(trainer: L.Trainer) -> list[str]:
    lines = []
    for ckpt in trainer.checkpoint_callbacks:
        kind = f"best {ckpt.monitor}" if getattr(ckpt, "monitor", None) else "latest"
        if getattr(ckpt, "best_model_path", ""):
            lines.append(f"checkpoint ({kind}): {ckpt.best_model_path}")
        if getattr(ckpt, "last_model_path", "") and ckpt.last_model_path != ckpt.best_model_path:
            lines.append(f"checkpoint (last): {ckpt.last_model_path}")
    for logger in trainer.loggers:
        kind = type(logger).__name__
        if kind == "CSVLogger":
            lines.append(f"logs (CSV): {logger.experiment.metrics_file_path}")
        elif kind == "TensorBoardLogger":
            lines.append(f"logs (TensorBoard): {logger.log_dir}  (tensorboard --logdir {logger.log_dir})")
        elif getattr(logger, "log_dir", None):
            lines.append(f"logs ({kind}): {logger.log_dir}")
    return lines


def _model_state_bytes(trainer: L.Trainer, module: torch.nn.Module) -> int:
    params = [p for p in module.parameters()]
    total = sum(_nbytes(p) for p in params) + sum(_nbytes(p) for p in params if p.requires_grad)
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            total += sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def _gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (collective on the world group), or ``[obj]`` without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _images(batch: Any) -> int:
    """Images in the batch: the leading dims of the largest image-like tensor, (B, C, H, W) or (B, N, C, H, W)
    (the largest: camera matrices (B, N, 4, 4) are 4-d too)."""
    images = [
        t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 4
    ]
    return math.prod(max(images, key=torch.Tensor.numel).shape[:-3]) if images else 0


def _local_shape(t: torch.Tensor) -> tuple[int, ...] | None:
    return tuple(t.to_local().shape) if isinstance(t, SpatialTensor) else None


def _by_rank(shapes: list[tuple[int, ...]]) -> str:
    """``(8, 3, 64, 128) on ranks 0,1`` for each distinct shard shape."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, shape in enumerate(shapes):
        groups.setdefault(shape, []).append(rank)
    return "; ".join(f"{_shape(s)} on rank{'s' * (len(r) > 1)} {','.join(map(str, r))}" for s, r in groups.items())


def _shape(shape) -> str:
    return str(tuple(int(n) for n in shape))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.1f} MiB"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: reset the peak RSS (VmHWM) so it covers training, not what the process held before
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _print(trainer: L.Trainer, text: str) -> None:
    """Through the progress bar when there is one, so the bar is not torn."""
    bar = trainer.progress_bar_callback
    if bar is None:
        print(text)
    else:
        bar.print(text)
    sys.stdout.flush()  # the main process may print next (fork launcher): keep the order


__all__ = ["SpatialSummary"]
