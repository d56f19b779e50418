"""Validation and test count each sample once under data replicas, on a set the replicas do not divide evenly.

Lightning's ``DistributedSampler`` pads each replica's share with repeats of the first samples: with 7 samples on 2
replicas sample 0 was scored twice. The strategies sample evaluation unpadded, so replicas run different numbers of
batches, and every value (a logged mean, torchmetrics states, the nuScenes score) must equal one process's.
"""

from __future__ import annotations

from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing import ProcessRaisedException
from torch.utils.data import DataLoader
from torchmetrics.aggregation import CatMetric, MeanMetric

from lightning_spatial import SpatialParallelStrategy
from lightning_spatial.data import SurroundScenes, collate_surround
from lightning_spatial.metrics import NuScenesDetection
from lightning_spatial.models.bev import PETR
from tests.strategy.lit import LitModel, loader
from tests.strategy.test_data_axis import Indexed

SAMPLES = 7  # odd: 4 on one replica, 3 on the other


def evaluate(model: L.LightningModule, data: DataLoader, stage: str, devices: int, spatial: int) -> dict:
    """``trainer.validate`` or ``trainer.test`` on one process (``devices=1``) or under ``spatial_tp``; a collective
    waiting for a replica that has finished its batches fails after 60 s instead of hanging."""
    strategy = SpatialParallelStrategy(spatial, start_method="fork", timeout=timedelta(seconds=60))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy if devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    run = trainer.validate if stage == "validate" else trainer.test
    return run(model, data, verbose=False)[0]


def assert_single_process_values(ours: dict, reference: dict) -> None:
    for key, value in reference.items():
        assert ours[key] == pytest.approx(value, rel=1e-5, abs=0, nan_ok=True), key


class Scored(LitModel):
    """SegNet's per-sample losses: logged (a batch-size weighted mean over the epoch), averaged by a torchmetrics
    metric, and the sample indices collected (each exactly once)."""

    def __init__(self):
        super().__init__("segnet")
        self.mean = MeanMetric()
        self.indices = CatMetric()

    def _scored(self, batch, stage: str):
        losses = F.cross_entropy(self(batch["image"]), batch["mask"], reduction="none").mean((1, 2))
        self.log(f"{stage}_loss", losses.mean(), batch_size=len(losses), sync_dist=True)
        self.mean.update(losses)
        self.indices.update(batch["index"])

    def validation_step(self, batch, batch_idx):
        self._scored(batch, "val")

    def test_step(self, batch, batch_idx):
        self._scored(batch, "test")

    def _epoch_end(self):
        indices = self.indices.compute()
        self.log("samples", float(len(indices)))
        self.log("distinct", float(len(set(indices.tolist()))))
        self.log("mean", self.mean.compute())
        self.mean.reset()
        self.indices.reset()

    def on_validation_epoch_end(self):
        self._epoch_end()

    def on_test_epoch_end(self):
        self._epoch_end()


@pytest.mark.parametrize(
    "stage,devices,spatial",
    [("validate", 2, 1), ("test", 2, 1), ("validate", 4, 2)],
    ids=["validate-2data", "test-2data", "validate-2data-x-2spatial"],
)
def test_each_sample_is_scored_once(stage, devices, spatial):
    data = loader(Indexed(SAMPLES, 16, 24), 1)
    reference = evaluate(Scored(), data, stage, 1, 1)
    ours = evaluate(Scored(), data, stage, devices, spatial)
    assert reference["samples"] == reference["distinct"] == SAMPLES
    assert_single_process_values(ours, reference)


def test_validation_within_fit_scores_each_sample_once():
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SpatialParallelStrategy(1, start_method="fork", timeout=timedelta(seconds=60)),
        max_epochs=1,
        limit_train_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Scored(), loader(Indexed(4, 16, 24), 2), loader(Indexed(SAMPLES, 16, 24), 2))
    assert trainer.callback_metrics["samples"] == trainer.callback_metrics["distinct"] == SAMPLES


def test_fewer_samples_than_replicas_fail_before_evaluating():
    with pytest.raises(ProcessRaisedException, match="the val set has 1 samples, fewer than the 2 data-parallel"):
        evaluate(Scored(), loader(Indexed(1, 16, 24), 1), "validate", 2, 1)


class Informed(PETR):
    """The tiny PETR (its loss, logged per step) whose decoded boxes are each sample's true ones, the i-th shifted
    by i x 0.4 m in x and scored 1 / (1 + i), plus a stray box: a detection score that depends on every sample."""

    def forward(self, batch):
        return {**super().forward(batch), "truth": list(zip(batch["boxes"], batch["labels"]))}

    def decode(self, outputs):
        predictions = []
        for boxes, labels in outputs["truth"]:
            shifted = boxes.clone()
            shifted[:, 0] += 0.4 * torch.arange(len(boxes))
            stray = torch.tensor([[30.0, 30.0, 0.0, 2.0, 4.5, 1.7, 0.0, 0.0, 0.0]])
            predictions.append(
                {
                    "boxes": torch.cat([shifted, stray]),
                    "scores": torch.cat([1 / (1 + torch.arange(len(boxes)).float()), torch.tensor([0.5])]),
                    "labels": torch.cat([labels, torch.tensor([0])]),
                }
            )
        return predictions


def informed_and_scenes() -> tuple[Informed, DataLoader]:
    """The tiny ``Informed`` PETR scored by ``NuScenesDetection`` and 5 scenes, one a batch."""
    torch.manual_seed(0)
    model = Informed.tiny(metric=NuScenesDetection())
    return model, DataLoader(SurroundScenes(5, 64, 96, cameras=2, max_objects=4, seed=3), collate_fn=collate_surround)


def test_the_nuscenes_score_of_a_bev_detector_is_the_single_process_one():
    """5 scenes on 2 replicas (3 and 2 batches): the BEV loss normaliser must not wait for the other replica in
    validation, and ``NuScenesDetection`` and the logged losses equal one process's."""
    reference = evaluate(*informed_and_scenes(), "validate", 1, 1)
    assert 0 < reference["val_mAP"] < 1 and 0 < reference["val_NDS"] < 1, reference
    assert_single_process_values(evaluate(*informed_and_scenes(), "validate", 2, 1), reference)
