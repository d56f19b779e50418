"""HorovodStrategy under `horovodrun --gloo -np 2`: same weights as one device and as Lightning's DDP.

Horovod is built by `python -m lightning_spatial.install_horovod`, which .ci/run runs first; CI sets
LIGHTNING_SPATIAL_REQUIRE_HOROVOD=1 so that a missing build fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_spatial import HorovodStrategy
from lightning_spatial.data import SurroundSynthetic
from lightning_spatial.strategies.horovod import import_horovod
from tests.data.records_trainer import DATA
from tests.strategy.lit import Images, LitModel, loader
from tests.strategy.test_data_axis import Indexed
from tests.strategy.test_each_sample_once import (
    SAMPLES,
    Scored,
    assert_single_process_values,
    evaluate,
    informed_and_scenes,
)
from tests.strategy.test_equivalence import assert_same_weights

SCRIPT = Path(__file__).with_name("train_script.py")
HOROVODRUN = Path(sys.executable).with_name("horovodrun")

try:
    import_horovod()
    MISSING = None
except ImportError as err:
    MISSING = str(err)
if MISSING and os.environ.get("LIGHTNING_SPATIAL_REQUIRE_HOROVOD") == "1":
    raise RuntimeError(f"Horovod tests required but Horovod is unusable: {MISSING}")
needs_horovod = pytest.mark.skipif(MISSING is not None, reason=f"Horovod not built here: {MISSING}")


def horovodrun(script: Path, *args: str, cwd: Path | None = None, gloo: bool = True) -> subprocess.CompletedProcess:
    """``horovodrun -np 2`` on this machine (``--gloo``: gloo for the tensors too, on CPU); fails the test with
    the output if it fails."""
    flags = ["--gloo"] if gloo else []
    cmd = [str(HOROVODRUN), *flags, "-np", "2", "-H", "localhost:2", sys.executable, str(script), *args]
    env = {**os.environ, "PATH": f"{HOROVODRUN.parent}:{os.environ['PATH']}"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)
    output = done.stdout + done.stderr  # horovodrun prefixes each rank's lines: [1]<stderr>:
    first = output.find("Traceback")  # the first error: other ranks then often say only that Horovod shut down
    assert done.returncode == 0, output[max(first, 0) :][:6000] + "\n...\n" + output[-4000:]
    return done


def train(out: Path, *args: str, gloo: bool = True) -> dict:
    horovodrun(SCRIPT, "--out", str(out), *args, gloo=gloo)
    return torch.load(out / "final.pt")


def single_device(samples: int, batch: int, accumulate: int = 1, accelerator: str = "cpu") -> LitModel:
    model = LitModel("convnext_atto")
    L.Trainer(
        accelerator=accelerator,
        devices=1,
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=accumulate,
    ).fit(model, loader(Images(samples, 32, 64), batch))
    return model.cpu()


def as_model(state: dict) -> LitModel:
    model = LitModel("convnext_atto")
    model.load_state_dict(state)
    return model


@pytest.mark.slow
@needs_horovod
def test_horovod_matches_single_device_and_ddp(tmp_path):
    ours = as_model(train(tmp_path))
    assert_same_weights(ours, single_device(4, 4))
    ddp = LitModel("convnext_atto")
    L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork",
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(ddp, loader(Images(4, 32, 64), 2))
    assert_same_weights(ours, ddp)
    # logged values and torchmetrics are synchronised through Horovod: they equal one device's
    expected = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    ).validate(ours, loader(Images(6, 32, 64, seed=1), 2), verbose=False)[0]
    metrics = torch.load(tmp_path / "metrics.pt")
    for key in ("val_loss", "val_acc"):
        assert abs(float(metrics[key]) - expected[key]) <= 1e-5 * max(1.0, abs(expected[key])), (
            key,
            metrics[key],
            expected,
        )
    # the checkpoint rank 0 wrote under Horovod loads into the plain model
    checkpoint = torch.load((tmp_path / "checkpoint.txt").read_text(), weights_only=False)
    plain = LitModel("convnext_atto")
    plain.load_state_dict(checkpoint["state_dict"])
    assert_same_weights(plain, ours, tolerance=0)


@pytest.mark.slow
@needs_horovod
def test_horovod_ranks_read_the_records_local_rank_0_rewrites(tmp_path):
    """Records of other settings are there: local rank 0 rewrites them in prepare_data (Horovod holds no barrier
    around it, the other rank waits at the strategy's barrier before setup) and each rank checks every batch
    against the samples asked for."""
    SurroundSynthetic(records_dir=str(tmp_path), **dict(DATA, distance=(4.0, 10.0))).prepare_data()
    horovodrun(SCRIPT.with_name("records_script.py"), "--records", str(tmp_path))


@pytest.mark.slow
@needs_horovod
def test_horovod_gradient_accumulation(tmp_path):
    ours = as_model(train(tmp_path, "--samples", "8", "--batch", "2", "--accumulate", "2"))
    assert_same_weights(ours, single_device(8, 4, accumulate=2))


@pytest.mark.slow
@needs_horovod
def test_grouped_allreduce_reaches_the_single_device_weights(tmp_path):
    """Horovod's grouped all-reduce (3 groups of gradients) changes when gradients travel, not what arrives."""
    ours = as_model(train(tmp_path, "--groups", "3"))
    assert_same_weights(ours, single_device(4, 4))


@pytest.mark.slow
@needs_horovod
@pytest.mark.parametrize("accumulate", [1, 2])
def test_gradient_buckets_reach_the_single_device_weights(tmp_path, accumulate):
    """bucket_mb: gradients in 0.05 MiB buckets (convnext_atto's 14 MiB make dozens), each a grouped all-reduce
    sent from backward; with accumulation only the window's last backward sends (train_script checks both)."""
    samples = 4 * accumulate  # as the tests above: one step (window) per epoch
    ours = as_model(train(tmp_path, "--samples", str(samples), "--bucket-mb", "0.05", "--accumulate", str(accumulate)))
    assert_same_weights(ours, single_device(samples, 4, accumulate=accumulate))


@pytest.mark.slow
@needs_horovod
def test_gradient_buckets_send_unused_parameters_as_zeros(tmp_path):
    """A bucket with a parameter some rank did not use is sent by ``synchronize``, the missing gradient as
    zeros (as ``hvd.DistributedOptimizer`` does), and every gradient equals ``hvd.allreduce``'s average."""
    done = horovodrun(SCRIPT.with_name("buckets_script.py"), cwd=tmp_path)
    assert done.stdout.count("buckets ok") == 2, done.stdout


@pytest.mark.slow
@needs_horovod
def test_gradient_buckets_compress_to_fp16(tmp_path):
    """Buckets with fp16 compression: each bucket's gradients travel as fp16 and come back into the fp32
    gradients, so training agrees with one device to fp16's precision (held as the GPU options test holds it)."""
    ours = as_model(train(tmp_path, "--bucket-mb", "0.05", "--compression", "fp16"))
    assert_same_weights(ours, single_device(4, 4), tolerance=1e-2, zero_floor=1e-4)


@pytest.mark.slow
@needs_horovod
@pytest.mark.parametrize("model", ["petr", "bevformer"])
def test_horovod_trains_a_detector_to_the_single_device_weights(tmp_path, model):
    """Two Horovod ranks with 1 sample each reach the weights of one device with both samples (float64): the
    box count normalising the losses is averaged over the replicas, as DETR does."""
    from tests.models.test_bev_training import train as train_bev

    horovodrun(SCRIPT.with_name("bev_script.py"), "--out", str(tmp_path), "--model", model)
    reference = train_bev(model, "auto", 1)
    ours = type(reference).tiny().double()  # float64 on both sides: no rounding on the way
    ours.load_state_dict(torch.load(tmp_path / f"{model}.pt"))
    assert_same_weights(ours, reference, tolerance=1e-10)


needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")


@needs_horovod
@needs_two_gpus
@pytest.mark.parametrize(
    "options", [(), ("--async-completion",), ("--bucket-mb", "0.05")], ids=["default", "async_completion", "buckets"]
)
def test_horovod_on_two_gpus_matches_one_gpu(tmp_path, options):
    """NCCL: the same weights as one GPU on the same global batch (fp32, TF32 off on both sides), also when
    all-reduces complete on the CUDA stream instead of on the host (async_completion)."""
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    ours = as_model(train(tmp_path, "--accelerator", "gpu", *options, gloo=False))
    assert_same_weights(ours, single_device(4, 4, accelerator="gpu"))


@needs_horovod
@needs_two_gpus
def test_horovod_options_on_gpus(tmp_path):
    """fp16 compression, the fusion threshold and the timeline reach Horovod's NCCL path: training agrees with
    uncompressed training to fp16's precision and the timeline is a readable Chrome trace of NCCL all-reduces.
    A tensor whose gradients lie below fp16's normal range (6e-5) loses them to the compression (Horovod does not
    scale): from zero, three SGD steps move it by ~1.5 x its gradient on either side, so such a tensor is held to
    that floor instead of relatively (on two H200s the relative check failed on exactly such a tensor, a depthwise
    conv bias before LayerNorm: relative difference 1.00; this form of the check has not run on GPUs yet)."""
    timeline = tmp_path / "timeline.json"
    args = ["--accelerator", "gpu", "--compression", "fp16", "--fusion-threshold", str(64 * 2**20)]
    compressed = as_model(train(tmp_path, *args, "--trace", str(timeline), gloo=False))
    assert_same_weights(compressed, single_device(4, 4, accelerator="gpu"), tolerance=1e-2, zero_floor=1e-4)
    text = timeline.read_text().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")  # Horovod may leave the array open
    assert any("NCCL" in str(e.get("name", "")) + str(e.get("args", "")) for e in events), "no NCCL events"


@needs_horovod
def test_started_without_horovodrun_says_how_to_launch(monkeypatch):
    for key in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(key, raising=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="horovod", logger=False, max_epochs=1)
    with pytest.raises(RuntimeError, match="without horovodrun: launch with `horovodrun -np N"):
        trainer.fit(LitModel("segnet"), loader(Images(2, 8, 8), 2))


def test_missing_horovod_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod", None)  # import horovod -> ImportError
    with pytest.raises(
        ImportError, match="not installed: install it with `python -m lightning_spatial.install_horovod`"
    ):
        import_horovod()


def test_horovod_without_pytorch_support_says_how_to_rebuild(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "horovod", types.ModuleType("horovod"))
    monkeypatch.setitem(sys.modules, "horovod.torch", None)
    with pytest.raises(ImportError, match="without PyTorch support .* rebuild it"):
        import_horovod()


def test_strategy_options_are_validated():
    with pytest.raises(ValueError, match="compression must be 'none' or 'fp16'"):
        HorovodStrategy(compression="int8")
    with pytest.raises(ValueError, match="groups must be a positive number"):
        HorovodStrategy(groups=0)
    with pytest.raises(ValueError, match="bucket_mb must be a positive bucket size"):
        HorovodStrategy(bucket_mb=0)
    with pytest.raises(ValueError, match="groups and bucket_mb .* set one of them"):
        HorovodStrategy(groups=2, bucket_mb=25)


@pytest.mark.slow
@needs_horovod
def test_horovod_recipe(tmp_path):
    overrides = [
        "strategy=horovod",
        "trainer.devices=1",
        "data.num_samples=8",
        "data.val_samples=4",
        "data.height=32",
        "data.width=64",
        "data.batch_size=2",
        "trainer.max_epochs=1",
        f"strategy.timeline={tmp_path / 'timeline.json'}",
        f"hydra.run.dir={tmp_path}",
    ]
    done = horovodrun(SCRIPT.parents[2] / "recipes" / "train.py", *overrides, cwd=tmp_path)
    assert done.stdout.count("final metrics:") == 2
    assert (tmp_path / "timeline.json").stat().st_size > 0  # the timeline option reached Horovod


@pytest.mark.slow
@needs_horovod
def test_host_time_tool(tmp_path):
    """CPU smoke of tools/horovod_host.py (no timing asserted): all three ways report, the buckets several."""
    tool = Path(__file__).parents[2] / "tools" / "horovod_host.py"
    done = horovodrun(tool, "--steps", "2", "--parameters", "40", "--bucket-mb", "0.004", cwd=tmp_path)
    for name in ("no hooks", "hvd.DistributedOptimizer", "bucket_mb"):
        assert re.search(rf"{re.escape(name)} +\d+\.\d+ ms", done.stdout), done.stdout
    assert re.search(r"40 parameters, (\d{2,}|[2-9]) buckets", done.stdout), done.stdout


@pytest.mark.slow
@needs_horovod
def test_horovod_validates_each_sample_once(tmp_path):
    """7 images and 5 surround scenes on 2 replicas: the logged means, torchmetrics states and the nuScenes score
    equal one process's (unpadded validation, as under spatial_tp: tests/strategy/test_each_sample_once.py)."""
    horovodrun(SCRIPT.with_name("evaluate_script.py"), "--out", str(tmp_path))
    ours = json.loads((tmp_path / "validated.json").read_text())
    data = loader(Indexed(SAMPLES, 16, 24), 1)
    assert_single_process_values(ours["segnet"], evaluate(Scored(), data, "validate", 1, 1))
    assert_single_process_values(ours["petr"], evaluate(*informed_and_scenes(), "validate", 1, 1))
