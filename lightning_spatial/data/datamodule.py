"""The DataModule base every surround source shares: loaders that collate with ``collate_surround`` and,
with ``records_dir``, a one-time conversion of both splits to packed records that training then reads.

Who writes the records: Lightning calls ``prepare_data`` on each node's local rank 0 (global rank 0 alone with
``prepare_data_per_node=False``) under any launcher, and it writes a split unless records of exactly its settings
are there; the other ranks wait at Lightning's barriers (around ``prepare_data`` under DDP and ``spatial_tp``,
before ``setup`` under every strategy, Horovod's included). In ``setup`` each rank of a multi-process run then
waits, up to the strategy's ``timeout``, until the folder holds records of its settings: another node may still
be writing them, or a shared filesystem may show the finished folder late.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
from lightning.pytorch.strategies.ddp import default_pg_timeout
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from .batch import collate_surround
from .loading import resumable_loader
from .records import differences, read_identity, records_identity, wait_for_records, write_records

SPLITS = ("train", "val")
log = logging.getLogger(__name__)


class SurroundDataModule(L.LightningDataModule):
    """Subclasses save ``batch_size``, ``num_workers``, ``records_dir`` and ``records_format`` as hyperparameters
    and implement ``datasets()`` -> (train, val), each with ``describe()``."""

    def datasets(self) -> tuple[Dataset, Dataset]:
        raise NotImplementedError

    def prepare_data(self) -> None:
        """Pack each split into ``records_dir/<split>`` unless records of exactly its settings are there."""
        h = self.hparams
        if h.records_dir is None:
            return
        for split, dataset in zip(SPLITS, self.datasets()):
            root, identity = Path(h.records_dir) / split, records_identity(dataset, h.records_format)
            found = read_identity(root)
            if found != identity:
                if found is not None:
                    log.warning("rewriting the records at %s, written for other settings: %s", root,
                                differences(found, identity))  # fmt: skip
                write_records(dataset, root, h.records_format, num_workers=h.num_workers)

    def setup(self, stage: str | None = None) -> None:
        sets = self.datasets()
        h = self.hparams
        if h.records_dir is not None:
            sets = tuple(
                wait_for_records(Path(h.records_dir) / split, records_identity(s, h.records_format), self._wait_s())
                for split, s in zip(SPLITS, sets)
            )
        self.train_set, self.val_set = sets

    def _wait_s(self) -> float:
        """How long ``setup`` waits for records that another process writes: the strategy's timeout (Lightning's
        30 min default when it has none, as Horovod) in a multi-process run; without one, records are either
        there (``prepare_data`` ran in this process) or not."""
        trainer = self.trainer
        if trainer is None or trainer.world_size == 1:
            return 0.0
        return (getattr(trainer.strategy, "_timeout", None) or default_pg_timeout).total_seconds()

    def train_dataloader(self) -> StatefulDataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> StatefulDataLoader:
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, dataset: Dataset, shuffle: bool) -> StatefulDataLoader:
        h = self.hparams
        return resumable_loader(dataset, h.batch_size, shuffle, h.num_workers, collate_surround, h.num_workers > 0)


__all__ = ["SPLITS", "SurroundDataModule"]
