"""The Hydra recipes run end to end (toy sizes): the main job, a dense task, and a multirun sweep."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TOY = [
    "data.num_samples=8",
    "data.val_samples=4",
    "data.height=32",
    "data.width=64",
    "data.batch_size=4",
    "trainer.max_epochs=1",
]


def run(
    *overrides: str, tmp_path: Path, flags: tuple[str, ...] = (), toy: tuple[str, ...] = tuple(TOY), stderr=False
) -> str:
    """``recipes/train.py`` with the overrides; its stdout (and stderr after it, with ``stderr=True``)."""
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "train.py"),
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


def torchrun_2(script: str, *args: str, cwd: Path | None = None) -> str:
    """Run ``recipes/<script>`` on 2 processes under torchrun (rendezvous on this machine); its stdout."""
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    done = subprocess.run(
        [*cmd, str(ROOT / "recipes" / script), *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


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


def test_benchmark_smoke_on_cpu(tmp_path):
    """The benchmark script runs end to end at a toy size (fake process group), into a folder it creates; no
    timing is asserted."""
    out = tmp_path / "rows"
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "benchmark.py"),
        "--device",
        "cpu",
        "--model",
        "convnext_atto",
        "--batch",
        "1",
        "--height",
        "64",
        "--widths",
        "256",
        "--spatial",
        "2,4",
        "--layouts",
        "width,tiles",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--out",
        str(out),
        *("--graphs", "both", "--profile"),  # graphs run eagerly off CUDA; the profile is the host's
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert [(r["spatial"], r["tiles"]) for r in rows] == [(2, "1x2"), (2, "1x2"), (4, "1x4"), (4, "2x2")]
    assert all(r["halo_mib_per_step"] > 0 and r["ours_ms"] > 0 and r["zero_grad"] == "after_forward" for r in rows)
    assert all(r["graphs"] == "both" and r["profile"][0]["wall"] > 0 and r["shard_profile"]["wall"] > 0 for r in rows)
    # copies by the op that made them: DDP's into its buckets in our step only (the shard alone runs without DDP)
    assert all("torch::distributed::reducer::copy_" in r["profile"][0]["copies"] for r in rows)
    assert not any("torch::distributed::reducer::copy_" in r["shard_profile"]["copies"] for r in rows)


def test_compiled_benchmark_smoke_on_cpu(tmp_path):
    """``--compile both``: inductor compiles the shard-only model and our spatial step (one rank of a fake group)."""
    cmd = [sys.executable, str(ROOT / "recipes" / "benchmark.py"), "--device", "cpu", "--model", "convnext_atto"]
    cmd += ["--batch", "1", "--height", "64", "--widths", "256", "--spatial", "2", "--compile", "both"]
    cmd += ["--steps", "1", "--warmup", "1", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert row["compile"] == "both" and row["ours_ms"] > 0 and row["shard_ms"] > 0 and row["halo_mib_per_step"] > 0


@pytest.mark.slow
def test_benchmark_under_torchrun(tmp_path):
    """The N-GPU path (real halos and gradient all-reduce between processes), here gloo on 2 CPU ranks."""
    torchrun_2(
        "benchmark.py",
        *("--device", "cpu", "--model", "convnext_atto", "--batch", "1", "--height", "64", "--widths", "256"),
        *("--spatial", "2", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)),
    )
    (row,) = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert row["backend"] == "gloo" and row["rank"] == 0  # one row, written by rank 0
    assert row["spatial"] == 2 and row["halo_mib_per_step"] > 0 and row["ours_ms"] > 0 and row["shard_ms"] > 0


def test_petr_benchmark_smoke_on_cpu(tmp_path):
    """The surround-camera detector task of the benchmark: one device, then one rank of 2 (fake group)."""
    cmd = [sys.executable, str(ROOT / "recipes" / "benchmark.py"), "--device", "cpu", "--model", "petr_tiny"]
    cmd += ["--cameras", "2", "--batch", "1", "--height", "64", "--widths", "176", "--spatial", "1,2"]
    done = subprocess.run(
        [*cmd, "--steps", "1", "--warmup", "0", "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert [(r["spatial"], r["baseline"]) for r in rows] == [(1, "one device"), (2, "one device")]
    assert all(r["ours_ms"] > 0 and r["shard_ms"] > 0 for r in rows) and rows[1]["halo_mib_per_step"] > 0


def test_trainer_benchmark_plays_one_rank_beside_its_shard_alone(tmp_path):
    """``--fake-world``: one process plays rank 1 of a 3-rank width split through the Trainer (the fake backend), and
    ``--baseline shard`` runs the plain model alone on that rank's 32 of 96 columns first; no timing is asserted."""
    args = ["--accelerator", "cpu", "--strategy", "spatial_tp", "--model", "convnext_atto", "--height", "32"]
    args += ["--width", "96", "--fake-world", "3", "--baseline", "shard", "--steps", "2", "--warmup", "1"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "bench_trainer.py"), *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "bench_trainer.jsonl").read_text().splitlines()]
    assert row["world"] == 3 and row["rank"] == 1 and row["baseline_run"]["world"] == 1
    assert row["time_vs_baseline"] == round(row["step_ms"] / row["baseline_run"]["step_ms"], 3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, compiled", [("spatial_tp", ""), ("spatial_tp", "module"), ("spatial_tp", "backbone"), ("ddp", "")]
)
def test_trainer_benchmark_under_torchrun(strategy, compiled, tmp_path):
    """Step time through the Trainer (module, DataLoader, collate hook) on 2 gloo ranks, eager or compiled
    (inductor: the whole module, or the backbone in place under ``--cuda-graphs``); no timing is asserted."""
    args = [
        "--accelerator",
        "cpu",
        "--strategy",
        strategy,
        "--model",
        "convnext_atto",
        "--height",
        "32",
        "--width",
        "64",
    ]
    profile = ["--profile"] if strategy == "ddp" else []
    graphs = ["--cuda-graphs", "backbone"] if strategy == "spatial_tp" and compiled != "module" else []  # eager on CPU
    compile_ = ["--compile", compiled] if compiled == "backbone" else ["--compile"] if compiled else []
    torchrun_2(
        "bench_trainer.py", *args, *profile, *graphs, *compile_, "--steps", "2", "--warmup", "1", "--out", str(tmp_path)
    )
    (row,) = [json.loads(line) for line in (tmp_path / "bench_trainer.jsonl").read_text().splitlines()]
    assert row["world"] == 2 and row["strategy"] == strategy and row["step_ms"] > 0 and row["compile"] == compiled
    assert (row["compiled_graphs"] > 0) == bool(compiled)
    assert row["cuda_graphs"] == ("auto" if strategy == "ddp" or compiled == "module" else "backbone")
    assert row["step_ms_range"][0] <= row["step_ms"] <= row["step_ms_range"][1]
    assert row["threads"] == 1  # torchrun's OMP_NUM_THREADS=1
    profiles = list(tmp_path.glob("profile_*.txt"))
    if profile:  # rank 0's first timed step, by host time
        assert len(profiles) == 1 and profiles[0].name.startswith("profile_ddp_convnext_atto_32-true_")
        header, table = profiles[0].read_text().split("\n", 1)
        assert json.loads(header)["strategy"] == "ddp" and "aten::convolution" in table
    else:
        assert not profiles


def test_window_join_smoke():
    """The halo-window join benchmark runs on CPU and both ways join the same window; no timing is asserted."""
    cmd = [sys.executable, str(ROOT / "recipes" / "bench_window.py"), "--device", "cpu", "--batch", "1"]
    done = subprocess.run([*cmd, "--calls", "1", "--dtype", "float32"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("\n") == 5  # a header and four stages


def test_dispatch_overhead_smoke():
    """The per-op host-time script runs every op on plain and sharded tensors; no timing is asserted."""
    cmd = [sys.executable, str(ROOT / "recipes" / "dispatch_overhead.py"), "--calls", "20", "--repeats", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    assert len(rows) == 14 and [r[1] for r in rows[-2:]] == ["forward", "fwd+bwd"]
    assert ["gelu,", "as", "nn.GELU", "calls", "it"] in [r[:5] for r in rows]  # the module path, options by keyword
    assert [r[:3] for r in rows[-4:-2]] == [["gelu,", "protocol", "alone"], ["add,", "protocol", "alone"]]


@pytest.mark.slow
def test_train_recipe_under_torchrun(tmp_path):
    """Launched by torchrun, Lightning's TorchElasticEnvironment supplies the ranks (as on a GPU cluster), whatever
    the config's start_method (conf/strategy/spatial_tp.yaml's fork: each torchrun process forked 2 more, and
    their gloo groups broke with "Connection reset by peer")."""
    out = torchrun_2("train.py", *TOY, f"hydra.run.dir={tmp_path}", cwd=tmp_path)
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
def test_benchmark_sweep_writes_one_csv_and_a_plot(tmp_path):
    """recipes/bench_sweep.py as a 2-job Hydra multirun at toy size on CPU; no timing is asserted."""
    cmd = [sys.executable, str(ROOT / "recipes" / "bench_sweep.py"), "-m", "device=cpu", "backbone=convnext_atto"]
    cmd += ["batch=1", "height=64", "width=256", "spatial=1,2", "steps=1", "warmup=0", f"hydra.sweep.dir={tmp_path}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "bench.csv").open()))
    assert [(r["spatial"], r["tiles"]) for r in rows] == [("1", "1x1"), ("2", "1x2")]
    assert all(float(r["ours_ms"]) > 0 and float(r["shard_ms"]) > 0 for r in rows)
    assert float(rows[0]["halo_mib_per_step"]) == 0 < float(rows[1]["halo_mib_per_step"])
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


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
@pytest.mark.parametrize("experiment", ["bev_cpu", "simple_bev_cpu", "lift_splat_cpu"])
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
def test_petr_sweep_smoke(tmp_path):
    """recipes/petr_sweep.sh on CPU: two variants side by side, two steps each; both logs, metrics and the
    per-variant summary come back. No score is asserted."""
    variants = tmp_path / "variants.txt"
    variants.write_text("# comment lines are skipped\nq100_lr5e-4\nfew model.num_queries=30\n")
    env = {
        **os.environ,
        "DEV": "cpu",
        "ACC": "cpu",
        "MINUTES": "5",
        "VAL_EVERY": "1",
        "OUT": str(tmp_path),
        "RUNS": str(tmp_path / "runs"),
        "EXTRA": "data.num_samples=8 data.val_samples=4 +trainer.max_steps=2 data.num_workers=0",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    done = subprocess.run(
        ["bash", str(ROOT / "recipes" / "petr_sweep.sh"), str(variants)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()}
    assert set(lines) == {"q100_lr5e-4", "few"} and all(lines.values()), done.stdout
    with tarfile.open(tmp_path / "sweep.tgz") as tar:
        names = tar.getnames()
    assert "runs/few/csv/metrics.csv" in names and "runs.q100_lr5e-4.log" in names, names
