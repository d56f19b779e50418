"""Training from packed records under a real Trainer, for every launcher: each rank checks every batch it gets
against the sample rendered directly at its sampler's index, and counts them."""

from __future__ import annotations

import math

import lightning as L
import torch

from lightning_spatial import gather
from lightning_spatial.data import SurroundSynthetic, collate_surround

DATA = dict(num_samples=4, val_samples=2, height=8, width=22, cameras=2, max_objects=4, batch_size=1)


class SamplesChecked(L.LightningModule):
    """Loss from the camera matrices only: no op that ``spatial_tp`` shards, so any strategy runs it."""

    def __init__(self, **data):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.direct = dict(zip(("train", "val"), SurroundSynthetic(**{**DATA, **data}).datasets()))
        self.checked = {"train": 0, "val": 0}

    def _check(self, split: str, batch: dict) -> None:
        """The batch is one of the split's samples as rendered directly, exactly (the loaders' samplers draw their
        own orders: shuffled per epoch for training, unpadded blocks for validation)."""
        got = {k: gather(v) if k.endswith("images") else v for k, v in batch.items()}  # spatial_tp's shards
        samples = self.direct[split]
        same = [i for i in range(len(samples)) if _equal(got, collate_surround([samples[i]]))]
        assert same, f"a {split} batch matches none of the {len(samples)} samples rendered directly"
        self.checked[split] += 1

    def training_step(self, batch, batch_idx):
        self._check("train", batch)
        return (self.weight * batch["lidar2img"]).sum()

    def validation_step(self, batch, batch_idx):
        self._check("val", batch)

    def on_fit_end(self):
        replicas = self.trainer.strategy.distributed_sampler_kwargs["num_replicas"]
        assert self.checked == {s: math.ceil(len(d) / replicas) for s, d in self.direct.items()}, self.checked

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _equal(a: dict, b: dict) -> bool:
    try:
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    except AssertionError:
        return False
    return True


def fit(strategy, devices: int, records_dir, num_nodes: int = 1, **data) -> None:
    """One epoch on ``records_dir`` (litdata, the default format); ``data`` overrides ``DATA``."""
    L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_epochs=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(SamplesChecked(**data), SurroundSynthetic(records_dir=str(records_dir), **{**DATA, **data}))
