"""Loaders that resume mid-epoch: a checkpoint saved inside an epoch continues on the samples that epoch had left.

Lightning saves a loader's ``state_dict()`` in its checkpoints and restores it on ``fit(ckpt_path=...)`` when the
loader has one: torchdata's ``StatefulDataLoader`` records how many samples its sampler gave out (its workers'
dataset state too), and on restore skips that many indices (not samples) of the epoch's order. The order itself
must then be the one the interrupted run had: ``EpochShuffle`` draws it from ``(seed, epoch)`` alone, as
``DistributedSampler`` does, and keeps the epoch in its state. Under several data replicas Lightning replaces it
by ``DistributedSampler(shuffle=True)``, which draws the same way.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader


class EpochShuffle(RandomSampler):
    """A permutation of ``data_source`` per epoch, drawn from ``seed + epoch`` (Lightning calls ``set_epoch``).

    A ``RandomSampler`` to Lightning, so that it injects ``DistributedSampler(shuffle=True)`` for several replicas.
    Its state is the epoch and the indices given out: restored, it gives out the rest of that epoch's permutation.
    ``seed``: Lightning's (``seed_everything``, else 0), the one its ``DistributedSampler`` uses, so one device and
    one data replica of a spatial group see samples in the same order.
    """

    def __init__(self, data_source: Dataset, seed: int | None = None) -> None:
        super().__init__(data_source)
        self.seed = int(os.getenv("PL_GLOBAL_SEED", 0)) if seed is None else seed
        self.epoch = 0
        self.yielded = 0
        self._resume: tuple[int, int] | None = None  # (epoch, indices given out) of a restored state

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        # a generator: the epoch is read at the first index, after Lightning's set_epoch
        order = torch.randperm(len(self.data_source), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        resume, self._resume = self._resume, None
        self.yielded = resume[1] if resume is not None and resume[0] == self.epoch else 0  # a later epoch starts anew
        for index in order[self.yielded :].tolist():
            self.yielded += 1
            yield index

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = state["epoch"]
        self._resume = (state["epoch"], state["yielded"])


def resumable_loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool,
    num_workers: int = 0,
    collate_fn: Callable[[list], Any] | None = None,
    persistent_workers: bool = False,
) -> StatefulDataLoader:
    """A ``StatefulDataLoader`` over ``dataset``, shuffled by ``EpochShuffle`` if ``shuffle``; in pinned memory where
    there is a GPU, so that the batch's copy to it does not wait for the step before it to finish."""
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=EpochShuffle(dataset) if shuffle else None,
        num_workers=num_workers,
        collate_fn=collate_fn,
        persistent_workers=persistent_workers,
        pin_memory=torch.cuda.is_available(),
    )


__all__ = ["EpochShuffle", "resumable_loader"]
