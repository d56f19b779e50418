"""The Hydra recipes run end to end (toy sizes): the main job, a dense task, a multirun sweep, the Fabric loop."""

from __future__ import annotations

import csv
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_spatial.models import ImageTask
from tests.scripts import ROOT, torchrun_2

TOY = [
    "data.num_samples=8",
    "data.val_samples=4",
    "data.height=32",
    "data.width=64",
    "data.batch_size=4",
    "trainer.max_epochs=1",
]


def run(
    *overrides: str,
    tmp_path: Path,
    flags: tuple[str, ...] = (),
    toy: tuple[str, ...] = tuple(TOY),
    stderr=False,
    script: str = "train.py",
) -> str:
    """``recipes/<script>`` with the overrides; its stdout (and stderr after it, with ``stderr=True``)."""
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / script),
        *flags,
        *toy,
        f"hydra.run.dir={tmp_path}",
        f"hydra.sweep.dir={tmp_path}",
        *overrides,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + (done.stderr if stderr else "")


def bev_toy(experiment: str) -> tuple[str, ...]:
    """A CPU BEV experiment shortened to one epoch of 8 scenes in batches of 4 (2 steps), scored on 4."""
    return (f"experiment={experiment}", "data.num_samples=8", "data.val_samples=4", "trainer.max_epochs=1")


def final_metrics(out: str) -> list[dict[str, float]]:
    """Every ``final metrics: {...}`` line's values; each must be a finite number."""
    runs = [dict(re.findall(r"'(\w+)': ([^,}]+)", body)) for body in re.findall(r"final metrics: \{(.*)\}", out)]
    runs = [{k: float(v) for k, v in run.items()} for run in runs]
    assert runs and all(run and all(math.isfinite(v) for v in run.values()) for run in runs), out[-3000:]
    return runs


def summary(out: str, key: str) -> list[str]:
    """The ``key: ...`` lines that the SpatialSummary callback printed (the progress bar's \\r split off)."""
    return re.findall(rf"^\s*{re.escape(key)}: (.*)$", out.replace("\r", "\n"), re.M)


@pytest.mark.slow
def test_train_recipe_shows_what_it_did(tmp_path):
    """The main job (toy size): width-sharded on 2 ranks, and it says so, with speed, memory and its outputs."""
    out = run(tmp_path=tmp_path)
    (metrics,) = final_metrics(out)
    assert set(metrics) == {"train_loss", "val_loss"} and metrics["train_loss"] > 0
    assert summary(out, "mesh") == [
        "2 rank(s) = data 1 x spatial 2 (tiles 1x2, height x width; sharded dims: width; SpatialParallelStrategy)"
    ]
    assert "batch['image'] (4, 3, 32, 64) sharded: (4, 3, 32, 32) on ranks 0,1" in out
    assert "batch['mask'] (4, 32, 64) sharded: (4, 32, 32) on ranks 0,1" in out
    assert "batch['label'] (4,) not sharded" in out
    (speed,) = summary(out, "throughput")
    assert float(speed.split()[0]) > 0 and "images/s (8 training images in" in speed  # 8 samples, one epoch
    (peaks,) = summary(out, "peak memory per rank (peak RSS of the process)")
    peaks = [p.split() for p in peaks.split(", ")]
    assert [p[0] for p in peaks] == ["r0", "r1"] and all(float(p[1]) > 0 for p in peaks)
    (state,) = summary(out, "rank 0")
    model_mib, saved_mib = (float(x) for x in re.findall(r"([\d.]+) MiB", state))
    (one,) = summary(out, "one device, same images (estimate")
    assert float(re.findall(r"([\d.]+) MiB", one)[-1]) > model_mib + saved_mib  # a second rank's activations
    keys = ("checkpoint (best val_loss)", "checkpoint (latest)", "logs (CSV)", "logs (TensorBoard)")
    paths = {key: Path(summary(out, key)[0].split()[0]) for key in keys}
    assert paths["checkpoint (best val_loss)"].suffix == ".ckpt" and paths["checkpoint (best val_loss)"].exists()
    assert paths["checkpoint (latest)"].name == "last.ckpt" and paths["checkpoint (latest)"].exists()
    assert "val_loss" in paths["logs (CSV)"].read_text().splitlines()[0]
    assert any(p.name.startswith("events.out.tfevents") for p in paths["logs (TensorBoard)"].iterdir())
    assert Path(summary(out, "plots")[0]).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, mesh, keys",
    [
        (("model=convnext_atto",), "data 1 x spatial 2", {"train_loss", "train_acc", "val_loss", "val_acc"}),
        (("strategy=single", "trainer.devices=1"), "1 rank(s) = data 1 x spatial 1", {"train_loss", "val_loss"}),
    ],
)
def test_train_recipe(overrides, mesh, keys, tmp_path):
    out = run(*overrides, tmp_path=tmp_path)
    (metrics,) = final_metrics(out)
    assert set(metrics) == keys and all(0 <= metrics[k] <= 1 for k in keys if k.endswith("_acc"))
    assert mesh in summary(out, "mesh")[0]


@pytest.mark.slow
def test_multirun_sweep(tmp_path):
    out = run("strategy.spatial_size=1,2", tmp_path=tmp_path, flags=("-m",))  # data parallel vs spatial
    assert len(final_metrics(out)) == 2
    meshes = summary(out, "mesh")
    assert [m.split(" (")[0] for m in meshes] == ["2 rank(s) = data 2 x spatial 1", "2 rank(s) = data 1 x spatial 2"]


@pytest.mark.slow
def test_train_recipe_under_torchrun(tmp_path):
    """Launched by torchrun, Lightning's TorchElasticEnvironment supplies the ranks (as on a GPU cluster), whatever
    the config's start_method (conf/strategy/spatial_tp.yaml's fork: each torchrun process forked 2 more, and
    their gloo groups broke with "Connection reset by peer")."""
    out = torchrun_2("recipes/train.py", *TOY, f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert len(final_metrics(out)) == 2  # one line per process
    assert [m.split(" (")[0] for m in summary(out, "mesh")] == ["2 rank(s) = data 1 x spatial 2"]  # rank 0 only


@pytest.mark.slow
def test_sweep_on_submitit_local_launcher(tmp_path):
    """hydra/launcher=submitit_local runs both jobs (the submitit_slurm launcher's local twin): each writes its
    checkpoint and logs, and its log holds finite final metrics."""
    run("hydra/launcher=submitit_local", "model=convnext_atto", "strategy=single", "trainer.devices=1", "seed=0,1",
        tmp_path=tmp_path, flags=("-m",))  # fmt: skip
    logs = sorted((tmp_path / ".submitit").glob("*/*_0_log.out"))
    assert len(logs) == 2
    seeds = set()
    for log in logs:
        (metrics,) = final_metrics(log.read_text())
        assert set(metrics) == {"train_loss", "train_acc", "val_loss", "val_acc"}
    for job in ("0", "1"):
        assert (tmp_path / job / "checkpoints" / "last.ckpt").exists()
        assert "val_loss" in (tmp_path / job / "csv" / "metrics.csv").read_text()
        seeds.add((tmp_path / job / ".hydra" / "overrides.yaml").read_text().split("seed=")[1].split()[0])
    assert seeds == {"0", "1"}


@pytest.mark.slow
def test_image_folder_demo_trains_sharded_at_each_files_resolution(tmp_path):
    """scikit-image's photos (shrunk 8x here) as an image folder with masks: width-sharded on 2 ranks."""
    script = [sys.executable, str(ROOT / "recipes" / "sample_images.py"), str(tmp_path / "photos"), "--scale", "0.125"]
    subprocess.run(script, check=True, capture_output=True, timeout=300)
    out = run(
        "experiment=image_folder_demo",
        f"data.root={tmp_path / 'photos' / 'images'}",
        f"data.masks={tmp_path / 'photos' / 'masks'}",
        tmp_path=tmp_path,
        toy=("trainer.max_epochs=1",),
    )
    (metrics,) = final_metrics(out)
    assert set(metrics) == {"train_loss", "val_loss"}
    assert summary(out, "mesh")[0].startswith("2 rank(s) = data 1 x spatial 2")
    (image,) = re.findall(r"batch\['image'\] \(1, 3, (\d+), (\d+)\) sharded: \(1, 3, \d+, (\d+)\) on ranks? 0", out)
    height, width, local = (int(n) for n in image)
    assert (height, width) in {(64, 64), (50, 75), (38, 56), (53, 80), (46, 46), (109, 125)}  # a photo's own size
    assert local == (width + 1) // 2


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["bev_cpu", "simple_bev_cpu", "lift_splat_cpu", "bevformer_cpu"])
def test_bev_experiment_scores_the_untrained_model_first(experiment, tmp_path):
    """The CPU BEV experiments (shortened) with validate_first=true: the untrained model's detection scores are
    printed and logged at step 0, before the training steps, and the final line has val_mAP and val_NDS. The
    scores, already reduced over ranks by the metric, are logged without Lightning's sync_dist advice."""
    out = run("validate_first=true", tmp_path=tmp_path, toy=bev_toy(experiment), stderr=True)
    assert "sync_dist=True" not in out, out[-3000:]
    untrained = re.findall(r"untrained metrics: (\{.*\})", out)  # printed after the progress bar's start
    assert len(untrained) == 1 and "'val_mAP'" in untrained[0] and "'val_NDS'" in untrained[0], out[-3000:]
    (metrics,) = final_metrics(out)
    assert 0 <= metrics["val_mAP"] <= 1 and 0 <= metrics["val_NDS"] <= 1
    rows = list(csv.DictReader((tmp_path / "csv" / "metrics.csv").open()))
    scored = [int(r["step"]) for r in rows if r.get("val_NDS")]
    assert scored[0] == 0 and len(scored) == 2, scored  # before training, then after its 2 steps


@pytest.mark.slow
def test_a_run_resumes_from_its_last_checkpoint(tmp_path):
    """A time-limited run resumed from <out>/checkpoints/last.ckpt in the same run directory (2 spatial ranks, as
    bev_h200.sh does): the second run continues at the step where time ran out, validates first the very weights
    the first run validated as it stopped (it used to run one validation batch of two: the restored loop counted
    the saved batches as done), and metrics.csv keeps the first run's rows (Lightning's CSVLogger deleted them).
    The BEV experiment's hyperparameters hold lists: saved as Hydra's ListConfig, weights_only=True refused them."""
    toy = ("experiment=bev_cpu", "data.num_samples=256", "data.val_samples=8", "validate_first=true")
    run("++trainer.max_time=00:00:00:03", tmp_path=tmp_path, toy=toy)  # stops inside the 64-step epoch
    last = tmp_path / "checkpoints" / "last.ckpt"
    stopped = torch.load(last, weights_only=True)["global_step"]  # plain containers: loads without pickle
    assert 0 < stopped < 64
    metrics = tmp_path / "csv" / "metrics.csv"
    first = list(csv.DictReader(metrics.open()))
    out = run(
        f"ckpt_path={last}", "++trainer.max_time=null", f"+trainer.max_steps={stopped + 2}", tmp_path=tmp_path, toy=toy
    )
    assert f"metrics at step {stopped} (resumed):" in out and "untrained" not in out
    assert torch.load(last, weights_only=True)["global_step"] == stopped + 2
    rows = list(csv.DictReader(metrics.open()))
    trained = [int(r["step"]) for r in rows if r.get("train_loss")]
    assert trained == sorted(set(trained)) and trained[-1] >= stopped, trained  # both runs' steps, each once
    scored = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
    before = [(int(r["step"]), float(r["val_loss"])) for r in first if r.get("val_loss")]
    assert scored[0][0] == 0 and scored[: len(before)] == before, (before, scored)  # untrained, ..., at the stop
    resumed = scored[len(before)][1]  # the second run's first validation: the weights saved at the stop
    assert resumed == pytest.approx(before[-1][1], rel=1e-6), (before, scored)


@pytest.mark.slow
def test_fabric_recipe_trains_sharded_and_saves_the_plain_model(tmp_path):
    """``recipes/fabric_train.py`` (toy size): 2 CPU ranks, width-sharded batches, finite losses, and a checkpoint
    whose model entry loads into the plain module on one process."""
    toy = [o for o in TOY if not o.startswith("trainer.")]
    out = run(tmp_path=tmp_path, toy=tuple(toy), script="fabric_train.py")
    (metrics,) = final_metrics(out)
    assert set(metrics) == {"train_loss", "val_loss"} and metrics["train_loss"] > 0
    assert "mesh: 2 ranks = 1 data replica(s) x 1x2 spatial tiles" in out
    assert "sharded batch tensors: ['image'] (4, 3, 32, 64), ['mask'] (4, 32, 64); replicated: ['label'] (4,)" in out
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["step"] == 2  # 8 samples in batches of 4, one epoch
    ImageTask(backbone="resnet18", task="segmentation", num_classes=4).load_state_dict(saved["model"])
