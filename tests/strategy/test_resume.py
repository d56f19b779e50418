"""A run stopped inside an epoch and resumed from its last.ckpt ends with the weights of the run never stopped.

Float64, shuffled data (``SyntheticScenes``: a ``StatefulDataLoader`` over ``EpochShuffle``), 4 steps an epoch: the
stop falls inside the second epoch, so the resumed epoch's order must be that epoch's, and the run goes on into a
third epoch. With a loader that cannot resume, Lightning restarts the epoch's data from its first batch: the resumed
run trains that epoch's first batches again and never sees its last ones.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_spatial import SpatialParallelStrategy, SpatialTensor
from lightning_spatial.callbacks import LatestCheckpoint
from lightning_spatial.data import SyntheticScenes
from lightning_spatial.data.scenes import COLOURS
from tests.strategy.lit import Images, LitModel, SegNet, loader

SAMPLES, STOP, END = 8, 5, 10  # 4 steps an epoch of 2 samples: stop at epoch 1's second step, end in epoch 2


def segnet() -> LitModel:
    """LitModel's SegNet for the scenes' mask classes (background and each colour), built in float64: Lightning
    loads a checkpoint into the module before ``precision="64-true"`` converts it, which would round the restored
    weights to float32."""
    model = LitModel("segnet")
    torch.manual_seed(0)
    model.model = SegNet(len(COLOURS))
    return model.double()


class Sharded(L.Callback):
    """In the ranks: with spatial ranks the collate hook still shards the loader's images (workers too)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        assert isinstance(batch["image"], SpatialTensor) == bool(getattr(trainer.strategy, "axes", None))


def fit(out: Path, strategy, devices: int, replicas: int, workers: int = 0, resume: Path | None = None, **limits):
    """SegNet on 8 synthetic scenes, 2 a step over the data replicas; returns the last checkpoint."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy() if callable(strategy) else strategy,
        precision="64-true",
        max_epochs=-1,
        logger=False,
        callbacks=[LatestCheckpoint(out), Sharded()],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **limits,
    )
    L.seed_everything(7)
    data = SyntheticScenes(SAMPLES, 16, 24, batch_size=2 // replicas, num_workers=workers, val_samples=3)
    trainer.fit(segnet(), data, ckpt_path=resume)
    return out / "last.ckpt"


def saved(checkpoint: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """The step, and the weights, buffers and SGD momentum of a checkpoint."""
    state = torch.load(checkpoint, weights_only=True)
    momentum = {f"momentum.{k}": s["momentum_buffer"] for k, s in state["optimizer_states"][0]["state"].items()}
    return state["global_step"], {**state["state_dict"], **momentum}


def assert_same_state(ours: Path, reference: Path) -> None:
    """Equal steps; weights, buffers and momentum equal to float64 rounding (in practice bit for bit)."""
    (step, mine), (expected_step, expected) = saved(ours), saved(reference)
    assert step == expected_step
    for key, value in expected.items():
        if not value.is_floating_point():
            assert torch.equal(mine[key], value), key
            continue
        assert mine[key].dtype == torch.float64, key
        error = (mine[key] - value).abs().max() / value.abs().max().clamp_min(1e-300)
        assert error <= 1e-12, f"{key}: relative difference {error:.2e}"


def spatial(size: int):
    return lambda: SpatialParallelStrategy(size, start_method="fork")


RUNS = {  # name: (strategy, devices, data replicas, DataLoader workers)
    "one_device": ("auto", 1, 1, 0),
    "spatial_group_of_2_workers": (spatial(2), 2, 1, 2),
    "2_data_replicas": (spatial(1), 2, 2, 0),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_a_mid_epoch_stop_resumes_to_the_uninterrupted_weights(tmp_path, name):
    strategy, devices, replicas, workers = RUNS[name]
    reference = fit(tmp_path / "never_stopped", strategy, devices, replicas, workers, max_steps=END)
    stopped = fit(tmp_path / "stopped", strategy, devices, replicas, workers, max_steps=STOP)
    assert saved(stopped)[0] == STOP
    resumed = fit(tmp_path / "resumed", strategy, devices, replicas, workers, resume=stopped, max_steps=END)
    assert_same_state(resumed, reference)


def test_a_max_time_stop_resumes_to_the_uninterrupted_weights(tmp_path):
    """``max_time`` stops after the step that used up the time, then validates; last.ckpt holds that step."""
    strategy, devices, replicas, workers = RUNS["2_data_replicas"]
    reference = fit(tmp_path / "never_stopped", strategy, devices, replicas, workers, max_steps=END)
    stopped = fit(tmp_path / "stopped", strategy, devices, replicas, workers, max_time={"milliseconds": 1})
    step = saved(stopped)[0]
    assert 0 < step % 4, step  # inside an epoch
    resumed = fit(tmp_path / "resumed", strategy, devices, replicas, workers, resume=stopped, max_steps=END)
    assert_same_state(resumed, reference)


def test_a_plain_dataloader_warns_that_its_epoch_restarts(tmp_path):
    """A loader that cannot restore its position (a plain DataLoader) restarts the epoch's data: said in words."""

    def run(max_steps, ckpt_path=None):
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=SpatialParallelStrategy(1),
            max_steps=max_steps,
            logger=False,
            callbacks=[LatestCheckpoint(tmp_path)],
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(LitModel("segnet"), loader(Images(8, 16, 24), 2), ckpt_path=ckpt_path)

    run(1)
    with pytest.warns(UserWarning, match="its first 1 batches are trained again and its last 1 not at all"):
        run(2, tmp_path / "last.ckpt")
