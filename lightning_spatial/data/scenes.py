"""Synthetic wide "road scenes" that need no download: a learnable task at any resolution.

Each image holds a few coloured boxes on a noisy background; the class label is the colour covering the
most pixels and the dense mask marks each pixel's box colour (0 = background). Samples are generated from
their index, so every rank and every run sees the same data.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from .._arguments import integers
from .loading import resumable_loader

COLOURS = torch.tensor([[0.0, 0.0, 0.0], [1.0, -1.0, -1.0], [-1.0, 1.0, -1.0], [-1.0, -1.0, 1.0]])


class Scenes(Dataset):
    def __init__(self, num_samples: int, height: int, width: int, seed: int = 0, boxes: int = 4):
        integers(0, num_samples=num_samples, boxes=boxes)
        integers(1, height=height, width=width)
        self.num_samples, self.height, self.width, self.seed, self.boxes = num_samples, height, width, seed, boxes

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        mask = torch.zeros(self.height, self.width, dtype=torch.long)
        for _ in range(self.boxes):
            h = int(torch.randint(self.height // 8, self.height // 2 + 1, (1,), generator=g))
            w = int(torch.randint(self.width // 16, self.width // 4 + 1, (1,), generator=g))
            top = int(torch.randint(0, self.height - h + 1, (1,), generator=g))
            left = int(torch.randint(0, self.width - w + 1, (1,), generator=g))
            mask[top : top + h, left : left + w] = int(torch.randint(1, len(COLOURS), (1,), generator=g))
        image = COLOURS[mask].permute(2, 0, 1) + 0.5 * torch.randn(3, self.height, self.width, generator=g)
        counts = torch.bincount(mask.flatten(), minlength=len(COLOURS))[1:]
        return {"image": image, "label": counts.argmax(), "mask": mask}


class SyntheticScenes(L.LightningDataModule):
    """Train/val splits of ``Scenes``; ``num_classes`` is 3 for labels and 4 (with background) for masks."""

    def __init__(
        self,
        num_samples: int = 64,
        height: int = 64,
        width: int = 256,
        batch_size: int = 8,
        num_workers: int = 0,
        val_samples: int = 16,
    ):
        super().__init__()
        self.save_hyperparameters()
        integers(1, num_samples=num_samples, height=height, width=width, batch_size=batch_size)
        integers(0, num_workers=num_workers, val_samples=val_samples)

    def train_dataloader(self) -> StatefulDataLoader:
        h = self.hparams
        return resumable_loader(Scenes(h.num_samples, h.height, h.width, seed=0), h.batch_size, True, h.num_workers)

    def val_dataloader(self) -> StatefulDataLoader:
        h = self.hparams
        return resumable_loader(Scenes(h.val_samples, h.height, h.width, seed=1), h.batch_size, False, h.num_workers)
