"""What the strategies do to each DataLoader Lightning hands them (``process_dataloader``), beyond Lightning's own
sampler injection: spatial ranks load only their slices (``sharded``, Trainer and Fabric), evaluation counts each
sample once, and a resumed epoch draws the order it was saved in (Trainer).

Validation and test loaders get an unpadded sampler (``ContiguousShard``): Lightning's ``DistributedSampler`` pads
each replica's share to the same length with repeats of the first samples, so a set that the data replicas do not
divide evenly would count those samples twice in every metric. Unpadded, replicas run one batch more or fewer than
each other: any collective per validation step over the data axis would wait forever (docs/design.md, "Each sample
counted once"), and the strategies' ``reduce`` averages integer tensors in float64 (``exact_mean``).

Training loaders get the sampler's epoch before Lightning first iterates them: Lightning 2.6 creates the training
iterator before ``set_epoch`` (Lightning #21938), so a resumed run would draw epoch 0's order for its first epoch
(a restored ``StatefulDataLoader`` skips into that order at once, and so does a loader with workers).
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from lightning.fabric.utilities.data import _set_sampler_epoch, sized_len
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from ..mesh import Axis
from ..sharding import Select, ShardingCollate

EVALUATION = (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING, RunningStage.TESTING)


def prepare_loader(dataloader: object, trainer) -> object:
    """``dataloader`` as the current stage needs it (see the module docstring)."""
    if not isinstance(dataloader, DataLoader):
        return dataloader
    stage = trainer.state.stage
    if stage in EVALUATION:
        return unpadded(dataloader, stage)
    if stage == RunningStage.TRAINING:
        _set_sampler_epoch(dataloader, trainer.fit_loop.epoch_progress.current.processed)
        warn_if_restarting_mid_epoch(dataloader, trainer)
    return dataloader


def sharded(dataloader: object, axes: dict[int, Axis], select: Select | None) -> object:
    """``dataloader`` collating this rank's slices of the batch's image-sized tensors (``ShardingCollate``), cut
    before pinning and the host-to-device copy; any other iterable as it is."""
    if isinstance(dataloader, DataLoader) and axes and not isinstance(dataloader.collate_fn, ShardingCollate):
        dataloader.collate_fn = ShardingCollate(dataloader.collate_fn, axes, select)
    return dataloader


def unpadded(dataloader: DataLoader, stage: RunningStage) -> DataLoader:
    """``dataloader`` with its padded ``DistributedSampler`` replaced by ``ContiguousShard``."""
    sampler = dataloader.sampler
    if not isinstance(sampler, DistributedSampler) or isinstance(sampler, ContiguousShard):
        return dataloader
    size, replicas = len(sampler.dataset), sampler.num_replicas
    if replicas == 1:
        return dataloader
    if size < replicas:  # a replica without a batch would wait in the others' epoch-end reductions
        raise ValueError(
            f"the {stage.dataloader_prefix} set has {size} samples, fewer than the {replicas} data-parallel "
            f"replicas: each replica needs at least one. Evaluate on at least {replicas} samples, or on fewer "
            f"devices (trainer.devices), or with more ranks per spatial group (spatial_size)"
        )
    # Lightning wraps a loader's own sampler (not a Random/SequentialSampler) as the dataset of its wrapper
    own = sampler.dataset._sampler if isinstance(sampler, DistributedSamplerWrapper) else None
    shard = ContiguousShard(sampler.dataset, replicas, sampler.rank, sampler.shuffle, sampler.seed, own)
    return _update_dataloader(dataloader, shard, mode=stage)


class ContiguousShard(DistributedSampler):
    """Replica ``r`` of ``R`` takes the ``r``-th of ``R`` contiguous blocks of the order, the first ``N % R`` blocks
    one longer (``torch.tensor_split``): no sample is repeated, and states gathered rank by rank (torchmetrics'
    concatenated lists) come back in the order one process sees, which an order-dependent score needs (the
    nuScenes AP ranks equal scores by their order). The order: ``sampler``'s, else shuffled by ``seed + epoch`` if
    ``shuffle``, else the dataset's."""

    def __init__(
        self, dataset: Sized, num_replicas: int, rank: int, shuffle: bool, seed: int, sampler: Sampler | None = None
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.sampler = sampler
        self.num_samples = len(self._block(torch.arange(len(self.dataset))))

    def _block(self, order: torch.Tensor) -> list[int]:
        return order.tensor_split(self.num_replicas)[self.rank].tolist()

    def __iter__(self) -> Iterator[int]:
        if self.sampler is not None:
            order = torch.tensor(list(self.sampler))
        elif self.shuffle:
            order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(len(self.dataset))
        return iter(self._block(order))


def exact_mean(tensor: torch.Tensor, reduce_op: Any) -> torch.Tensor:
    """An integer tensor as float64 when it is to be averaged: Lightning's epoch mean of a logged value divides the
    replicas' summed values by their mean batch-size total, an integer tensor, whose mean Lightning truncates (7
    samples on 2 replicas: 3, not 3.5). Padded sampling hid it; unpadded, one replica has a sample more."""
    return tensor.double() if reduce_op in (None, "mean", "avg") and not tensor.is_floating_point() else tensor


def warn_if_restarting_mid_epoch(dataloader: DataLoader, trainer) -> None:
    """A loader without ``state_dict``/``load_state_dict`` restarts its epoch from the first batch: say so."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    length = sized_len(dataloader)
    mid_epoch = done > 0 and (length is None or done % length != 0)
    if not trainer.fit_loop.restarting or not mid_epoch or isinstance(dataloader, _Stateful):
        return
    rank_zero_warn(
        f"Resuming at batch {done} of epoch {trainer.current_epoch}, but the train_dataloader "
        f"({type(dataloader).__name__}) cannot restore its position: the epoch's data restarts from its first batch, "
        f"so its first {done} batches are trained again and its last {done} not at all this epoch. Use a loader "
        "with state_dict()/load_state_dict() (torchdata's StatefulDataLoader, as lightning_spatial.data builds) or "
        "resume from a checkpoint saved at an epoch's end."
    )
