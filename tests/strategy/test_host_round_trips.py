"""A training step through the Trainer under ``spatial_tp`` (2 CPU ranks, forked): the strategy's hooks, the sharded
batch, the model, DDP's reduction and the optimizer copy nothing between host and device, so on a GPU the step
never waits for its queue to drain (tests/host.py). Only what runs on the host by design is allowed."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_spatial import SpatialParallelStrategy
from lightning_spatial.data import SurroundScenes, collate_surround
from lightning_spatial.models import ImageTask
from lightning_spatial.models.bev import LiftSplat
from tests.host import HostRoundTrips, waits
from tests.strategy.lit import Images

BY_DESIGN = {
    "batch.check_contents",  # the BEV batch's values, read in forward only while the batch is on the host (CPU here)
    "optimizer._get_value",  # torch's optimizers read their step counter: a host tensor unless capturable=True
}


class NoRoundTrips(L.Callback):
    """Watches the third step (the first ones may plan and cache) from its start to its end, optimizer included."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            self.host = HostRoundTrips()
            self.host.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 2:
            self.host.__exit__(None, None, None)
            found = waits(self.host.made, BY_DESIGN)
            assert not found, f"rank {trainer.global_rank}: (function, op) {found} wait for the device every step"


def _bev():
    scenes = SurroundScenes(8, 64, 96, cameras=2, max_objects=4, seed=3)
    return LiftSplat.tiny(), torch.utils.data.DataLoader(scenes, batch_size=1, collate_fn=collate_surround)


def _segmenter():
    return ImageTask("resnet18", task="segmentation", num_classes=3), torch.utils.data.DataLoader(Images(8, 64, 96), 2)


@pytest.mark.parametrize("make", [_bev, _segmenter], ids=["lift_splat", "segmenter"])
def test_a_training_step_through_the_trainer_never_waits_for_the_device(make):
    torch.manual_seed(0)
    model, data = make()
    L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SpatialParallelStrategy(2, start_method="fork", bev_shard="x", fallback="error"),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[NoRoundTrips()],
    ).fit(model, data)
