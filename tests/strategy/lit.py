"""A plain LightningModule and data used by the strategy tests: nothing in them knows about sharding."""

from __future__ import annotations

import lightning as L
import timm
import torch
import torch.nn.functional as F
import torchmetrics
from torch.utils.data import DataLoader, Dataset


class Images(Dataset):
    """Fixed random images with a class label and a dense (per-pixel) label map."""

    def __init__(self, n: int, height: int, width: int, classes: int = 3, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(n, 3, height, width, generator=g)
        self.labels = torch.randint(0, classes, (n,), generator=g)
        self.masks = torch.randint(0, classes, (n, height, width), generator=g)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i):
        return {"image": self.images[i], "label": self.labels[i], "mask": self.masks[i]}


class SegNet(torch.nn.Module):
    """A small encoder-decoder: strided convs, BatchNorm, max pool, bilinear upsampling, per-pixel logits."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.enc1 = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.enc2 = torch.nn.Sequential(
            torch.nn.MaxPool2d(2), torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.GroupNorm(4, 16), torch.nn.GELU()
        )
        self.up = torch.nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.head = torch.nn.Conv2d(24, classes, 1)

    def forward(self, x):
        a = self.enc1(x)
        b = self.up(self.enc2(a))
        return self.head(torch.cat([a, b], 1))


def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "segnet":
        return SegNet()
    return timm.create_model(name, pretrained=False, num_classes=3)


class LitModel(L.LightningModule):
    def __init__(self, name: str, lr: float = 0.05):
        super().__init__()
        self.name, self.lr = name, lr
        self.model = make_model(name)
        self.dense = name == "segnet"
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(3, average="micro")

    def forward(self, x):
        return self.model(x)

    def _loss(self, batch):
        out = self(batch["image"])
        return F.cross_entropy(out, batch["mask"] if self.dense else batch["label"]), out

    def training_step(self, batch, batch_idx):
        loss, _ = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, out = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        if not self.dense:
            self.accuracy(out, batch["label"])
            self.log("val_acc", self.accuracy)

    def test_step(self, batch, batch_idx):
        loss, _ = self._loss(batch)
        self.log("test_loss", loss, sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch["image"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def loader(dataset: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)
