"""SpatialSummary: what it counts (saved activations), and what it prints and logs on one device and on 2 spatial
ranks."""

from __future__ import annotations

import csv
import re

import lightning as L
import pytest
import torch

from lightning_spatial import SpatialParallelStrategy
from lightning_spatial.callbacks import SpatialSummary, _images
from lightning_spatial.saved import SavedActivations
from tests.strategy.lit import Images, LitModel, loader


def test_saved_activations_are_the_distinct_tensors_autograd_keeps_without_parameters():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.ReLU(), torch.nn.ReLU())
    x = torch.randn(2, 3, 16, 16)
    saved = SavedActivations(model)
    with saved:
        model(x).sum().backward()
    # conv keeps its input x; the first ReLU its output; the second ReLU its output (a new tensor); weights excluded
    assert saved.nbytes == x.numel() * 4 + 2 * (2 * 8 * 16 * 16 * 4)


def test_images_are_counted_in_the_image_tensor_not_in_the_camera_matrices():
    """A surround batch whose camera matrices come first (B, N, 4, 4) counts its B x N images (a PETR log
    once said 3.6 images/s where 6 cameras made 21.6)."""
    surround = {
        "lidar2img": torch.randn(2, 6, 4, 4),
        "images": torch.randn(2, 6, 3, 8, 16),
        "boxes": [torch.randn(1, 9)],
    }
    assert _images(surround) == 12
    assert _images({"image": torch.randn(4, 3, 8, 8), "label": torch.tensor([1, 2, 3, 4])}) == 4


def _fit(tmp_path, devices: int, width: int, epochs: int = 2, **strategy_kwargs) -> None:
    strategy = SpatialParallelStrategy(2, start_method="fork", **strategy_kwargs) if devices > 1 else "auto"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=epochs,
        logger=L.pytorch.loggers.CSVLogger(tmp_path, name="csv", version=""),
        callbacks=[SpatialSummary()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(LitModel("segnet"), loader(Images(8, 16, width), 4), loader(Images(4, 16, width, seed=1), 4))


def _mib(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"([\d.]+) MiB", line)]


def test_summary_on_one_device(tmp_path, capsys):
    _fit(tmp_path, 1, 32)
    out = capsys.readouterr().out
    assert "mesh: 1 rank(s) = data 1 x spatial 1 (SingleDeviceStrategy: data parallel only)" in out
    assert "batch['image'] (4, 3, 16, 32) not sharded" in out and "batch['mask'] (4, 16, 32) not sharded" in out
    assert "(16 training images in" in out  # 8 samples x 2 epochs
    (state,) = re.findall(r"rank 0: model state .*", out)
    (one,) = re.findall(r"one device, same images .*", out)
    params = sum(p.numel() * 4 for p in LitModel("segnet").parameters())
    model, saved = _mib(state)
    assert model == pytest.approx(3 * params / 2**20, abs=0.05)  # parameters, gradients, SGD momentum
    assert saved > 0 and _mib(one)[-1] == pytest.approx(model + saved, abs=0.11)  # one rank is one device
    assert f"logs (CSV): {tmp_path / 'csv' / 'metrics.csv'}" in out


def test_summary_on_two_spatial_ranks(tmp_path, capfd):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    _fit(tmp_path, 2, 36, ddp_comm_hook=fp16_compress_hook)
    out = capfd.readouterr().out
    assert "gradient all-reduce: DDP comm hook fp16_compress_hook\n" in out  # registered on CPU too
    assert out.count("mesh: ") == 1  # rank 0 prints
    assert "mesh: 2 rank(s) = data 1 x spatial 2 (tiles 1x2, height x width; sharded dims: width;" in out
    assert "batch['image'] (4, 3, 16, 36) sharded: (4, 3, 16, 18) on ranks 0,1" in out
    assert "batch['mask'] (4, 16, 36) sharded: (4, 16, 18) on ranks 0,1" in out
    assert "batch['label'] (4,) not sharded" in out
    assert "(16 training images in" in out  # a spatial group's ranks see the same 8 a epoch, counted once
    peaks = re.findall(r"peak memory per rank \(peak RSS of the process\): r0 ([\d.]+) MiB, r1 ([\d.]+) MiB", out)
    assert len(peaks) == 1
    model, saved = _mib(re.findall(r"rank 0: model state .*", out)[0])
    one = _mib(re.findall(r"one device, same images .*", out)[0])[-1]
    assert model + saved < one < model + 2.5 * saved  # plus rank 1's half of the activations
    # the same figures reach the loggers at the end of each epoch (2 steps of 4 images): the run so far
    logged = [r for r in csv.DictReader((tmp_path / "csv" / "metrics.csv").open()) if r.get("train/images")]
    assert [(int(r["step"]), float(r["train/images"])) for r in logged] == [(2, 8.0), (4, 16.0)]
    for r in logged:
        rate, images, seconds = (float(r[k]) for k in ("train/images_per_sec", "train/images", "train/time"))
        assert seconds > 0 and rate == pytest.approx(images / seconds, rel=1e-9)
    memory = [float(r["train/peak_memory_mib"]) for r in logged]
    assert 0 < memory[0] <= memory[1] <= max(map(float, peaks[0])) + 0.05  # the peak so far, of the larger rank


class _AgreeOnTrue(L.Callback):
    def on_train_start(self, trainer, pl_module):
        assert trainer.strategy.reduce_boolean_decision(True), "every rank said True, the reduction said False"


def test_all_ranks_agreeing_is_a_yes(tmp_path):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SpatialParallelStrategy(2, start_method="fork"),
        max_steps=1,
        logger=False,
        callbacks=[_AgreeOnTrue()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(LitModel("segnet"), loader(Images(4, 16, 32), 2))
