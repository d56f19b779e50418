"""The DataModule base every surround source shares: loaders that collate with ``collate_surround`` and,
with ``records_dir``, a one-time conversion of both splits to packed records that training then reads."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from .batch import collate_surround
from .loading import resumable_loader
from .records import META, PackedSurround, write_records

SPLITS = ("train", "val")


class SurroundDataModule(L.LightningDataModule):
    """Subclasses save ``batch_size``, ``num_workers``, ``records_dir`` and ``records_format`` as hyperparameters
    and implement ``datasets()`` -> (train, val), each with ``describe()``."""

    def datasets(self) -> tuple[Dataset, Dataset]:
        raise NotImplementedError

    def prepare_data(self) -> None:
        """Pack the splits into ``records_dir/{train,val}`` unless finished records are already there."""
        h = self.hparams
        if h.records_dir is None:
            return
        for split, dataset in zip(SPLITS, self.datasets()):
            root = Path(h.records_dir) / split
            if not (root / META).exists():
                write_records(dataset, root, h.records_format, num_workers=h.num_workers)

    def setup(self, stage: str | None = None) -> None:
        sets = self.datasets()
        if self.hparams.records_dir is not None:
            root = Path(self.hparams.records_dir)
            sets = tuple(PackedSurround(root / split, expect=s.describe()) for split, s in zip(SPLITS, sets))
        self.train_set, self.val_set = sets

    def train_dataloader(self) -> StatefulDataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> StatefulDataLoader:
        return self._loader(self.val_set, shuffle=False)

    def _loader(self, dataset: Dataset, shuffle: bool) -> StatefulDataLoader:
        h = self.hparams
        return resumable_loader(dataset, h.batch_size, shuffle, h.num_workers, collate_surround, h.num_workers > 0)


__all__ = ["SPLITS", "SurroundDataModule"]
