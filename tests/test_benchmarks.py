"""The benchmark scripts (benchmarks/) run end to end at toy sizes on CPU; no timing is asserted."""

from __future__ import annotations

import csv
import gzip
import json
import subprocess
import sys

import pytest

from lightning_spatial.data.records import FORMATS
from tests.scripts import ROOT, torchrun_2

pytestmark = pytest.mark.slow  # scripts run end to end in subprocesses, some under torchrun


def test_benchmark_smoke_on_cpu(tmp_path):
    """The benchmark script runs end to end at a toy size (fake process group), into a folder it creates; no
    timing is asserted."""
    out = tmp_path / "rows"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "spatial_step.py"),
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
    """``--compile both``: torch.compile traces the shard-only model and our spatial step (one rank of a fake group);
    ``aot_eager`` generates no code (inductor through shards: tests/test_compile.py)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "spatial_step.py"), "--device", "cpu", "--model", "convnext_atto"]
    cmd += ["--batch", "1", "--height", "64", "--widths", "256", "--spatial", "2", "--compile", "both"]
    cmd += ["--compile-backend", "aot_eager"]
    cmd += ["--steps", "1", "--warmup", "1", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert row["compile"] == "both" and row["compile_backend"] == "aot_eager"
    assert row["ours_ms"] > 0 and row["shard_ms"] > 0 and row["halo_mib_per_step"] > 0


def test_benchmark_under_torchrun(tmp_path):
    """The N-GPU path (real halos and gradient all-reduce between processes), here gloo on 2 CPU ranks."""
    torchrun_2(
        "benchmarks/spatial_step.py",
        *("--device", "cpu", "--model", "convnext_atto", "--batch", "1", "--height", "64", "--widths", "256"),
        *("--spatial", "2", "--steps", "1", "--warmup", "0", "--out", str(tmp_path)),
    )
    (row,) = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert row["backend"] == "gloo" and row["rank"] == 0  # one row, written by rank 0
    assert row["spatial"] == 2 and row["halo_mib_per_step"] > 0 and row["ours_ms"] > 0 and row["shard_ms"] > 0


@pytest.mark.parametrize("baseline", ["1", "once"])
def test_petr_benchmark_smoke_on_cpu(tmp_path, baseline):
    """The surround-camera detector task of the benchmark: one device, then one rank of 2 (fake group); with
    ``--baseline once`` the whole input's step is timed at the first spatial size only and reused by the next."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "spatial_step.py"), "--device", "cpu", "--model", "petr_tiny"]
    cmd += ["--cameras", "2", "--batch", "1", "--height", "64", "--widths", "176", "--spatial", "1,2"]
    cmd += ["--baseline", baseline]
    done = subprocess.run(
        [*cmd, "--steps", "1", "--warmup", "0", "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert [(r["spatial"], r["baseline"]) for r in rows] == [(1, "one device"), (2, "one device")]
    assert all(r["ours_ms"] > 0 and r["shard_ms"] > 0 for r in rows) and rows[1]["halo_mib_per_step"] > 0
    timings = [(r["shard_ms"], r["shard_ms_after"]) for r in rows]
    if baseline == "once":
        assert [r["baseline_timed_at_spatial"] for r in rows] == [1, 1] and timings[0] == timings[1]
    else:
        assert "baseline_timed_at_spatial" not in rows[1] and timings[0] != timings[1]


@pytest.mark.parametrize(
    "model, encoder",
    [("lift_splat_tiny", None), ("lift_splat_tiny", "resnet18"), ("simple_bev_tiny", None), ("bevformer_tiny", None)],
)
def test_bev_plane_benchmark_smoke_on_cpu(tmp_path, model, encoder):
    """The BEV detectors with their BEV grid sharded (``--bev-shard x``): one device, then one rank of 2; the tiny
    Lift-Splat with its own BEV encoder (the conv stack) and with the ResNet's (``--bev-encoder``), as rows record."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "spatial_step.py"), "--device", "cpu", "--model", model]
    cmd += ["--bev-encoder", encoder] if encoder else []
    cmd += [
        "--cameras",
        "2",
        "--batch",
        "1",
        "--height",
        "64",
        "--widths",
        "176",
        "--spatial",
        "1,2",
        "--bev-shard",
        "x",
    ]
    done = subprocess.run(
        [*cmd, "--steps", "1", "--warmup", "0", "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert [(r["spatial"], r["bev_shard"]) for r in rows] == [(1, "x"), (2, "x")] and "bev=x" in done.stdout
    expected = None if model == "bevformer_tiny" else encoder or "convs"
    assert [r["bev_encoder"] for r in rows] == [expected, expected]
    assert all(r["ours_ms"] > 0 and r["shard_ms"] > 0 for r in rows)


def _trainer_step_row(tmp_path, args: list[str]) -> dict:
    """benchmarks/trainer_step.py run in one process with ``args``: the one row it writes."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "trainer_step.py"), *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = [json.loads(line) for line in (tmp_path / "bench_trainer.jsonl").read_text().splitlines()]
    return row


def test_trainer_benchmark_plays_one_rank_beside_its_shard_alone(tmp_path):
    """``--fake-world``: one process plays rank 1 of a 3-rank width split through the Trainer (the fake backend), and
    ``--baseline shard`` runs the plain model alone on that rank's 32 of 96 columns first; ``--profile`` profiles the
    first timed step of each, lists every op of it and writes its timeline; no timing is asserted."""
    args = ["--accelerator", "cpu", "--strategy", "spatial_tp", "--model", "convnext_atto", "--height", "32"]
    args += ["--width", "96", "--fake-world", "3", "--baseline", "shard", "--steps", "2", "--warmup", "1", "--profile"]
    row = _trainer_step_row(tmp_path, args)
    assert row["world"] == 3 and row["rank"] == 1 and row["baseline_run"]["world"] == 1
    assert row["time_vs_baseline"] == round(row["step_ms"] / row["baseline_run"]["step_ms"], 3)
    for strategy, world in (("spatial_tp", 3), ("single", 0)):
        (profile,) = tmp_path.glob(f"profile_{strategy}_*.txt")
        header, tables = profile.read_text().split("\n", 1)
        assert json.loads(header)["fake_world"] == world and json.loads(header)["strategy"] == strategy
        ops = [json.loads(line)[0] for line in tables.split("every op, device time (us), calls\n")[1].splitlines()]
        assert "aten::convolution" in ops and ("_FetchWindow" in ops) == (strategy == "spatial_tp")
        with gzip.open(profile.with_name(profile.stem + "_trace.json.gz")) as f:  # the step's timeline
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert "aten::convolution" in names and ("_FetchWindow" in names) == (strategy == "spatial_tp")


def test_trainer_benchmark_plays_a_tile_of_a_2d_group(tmp_path):
    """``--tiles 2x2``: rank 1 of 4 plays the tile of rows 0-31 and columns 48-95, and its shard alone is that tile."""
    args = ["--accelerator", "cpu", "--strategy", "spatial_tp", "--model", "convnext_atto", "--height", "64"]
    args += ["--width", "96", "--fake-world", "4", "--tiles", "2x2", "--baseline", "shard", "--steps", "1"]
    row = _trainer_step_row(tmp_path, [*args, "--warmup", "1"])
    assert row["world"] == 4 and row["rank"] == 1 and row["spatial_tiles"] == "2x2"
    assert row["baseline_run"]["input_hw"] == [32, 48]


def test_trainer_benchmark_times_a_window_of_steps(tmp_path):
    """``--timing window``: the timed steps run back to back, one mean for the rank and one for its baseline (the
    range is that one value); ``--profile`` would synchronise inside the window, so the two are refused together."""
    args = ["--accelerator", "cpu", "--strategy", "spatial_tp", "--model", "convnext_atto", "--height", "32"]
    args += ["--width", "64", "--fake-world", "2", "--baseline", "shard", "--steps", "3", "--warmup", "1"]
    row = _trainer_step_row(tmp_path, [*args, "--timing", "window"])
    assert row["timing"] == "window" and row["world"] == 2
    for run in (row, row["baseline_run"]):
        assert run["step_ms"] > 0 and run["step_ms_range"] == [round(run["step_ms"], 1)] * 2
    refused = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "trainer_step.py"), *args, "--timing", "window", "--profile"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert refused.returncode != 0 and "--profile synchronises the device" in refused.stderr


@pytest.mark.parametrize("model", ["petr_tiny", "lift_splat_tiny", "simple_bev_tiny", "bevformer_tiny"])
def test_trainer_benchmark_trains_the_bev_detectors_with_the_bev_sharded(tmp_path, model):
    """The BEV detectors through the Trainer (the surround collate hook, ``--bev-shard x``): one rank of 2 beside the
    whole input on one device (``--baseline device``); no timing is asserted."""
    args = ["--accelerator", "cpu", "--strategy", "spatial_tp", "--model", model, "--cameras", "2", "--batch", "1"]
    args += ["--height", "64", "--width", "176", "--fake-world", "2", "--bev-shard", "x", "--baseline", "device"]
    row = _trainer_step_row(tmp_path, [*args, "--steps", "2", "--warmup", "1"])
    assert row["world"] == 2 and row["bev_shard"] == "x" and row["baseline_run"]["world"] == 1
    assert row["step_ms"] > 0 and row["baseline_run"]["step_ms"] > 0


@pytest.mark.parametrize(
    "strategy, compiled", [("spatial_tp", ""), ("spatial_tp", "module"), ("spatial_tp", "backbone"), ("ddp", "")]
)
def test_trainer_benchmark_under_torchrun(strategy, compiled, tmp_path):
    """Step time through the Trainer (module, DataLoader, collate hook) on 2 gloo ranks, eager or compiled (the whole
    module, or the backbone in place under ``--cuda-graphs``), traced by ``aot_eager``: no code generated (inductor's
    code is tested in tests/test_compile.py); no timing is asserted."""
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
    compile_ += ["--compile-backend", "aot_eager"] if compiled else []
    steps = ["--steps", "2", "--warmup", "1", "--out", str(tmp_path)]
    torchrun_2("benchmarks/trainer_step.py", *args, *profile, *graphs, *compile_, *steps)
    (row,) = [json.loads(line) for line in (tmp_path / "bench_trainer.jsonl").read_text().splitlines()]
    assert row["world"] == 2 and row["strategy"] == strategy and row["step_ms"] > 0 and row["compile"] == compiled
    assert (row["compiled_graphs"] > 0) == bool(compiled)
    assert row["compile_backend"] == ("aot_eager" if compiled else "inductor")
    assert row["cuda_graphs"] == ("auto" if strategy == "ddp" or compiled == "module" else "backbone")
    assert row["step_ms_range"][0] <= round(row["step_ms"], 1) <= row["step_ms_range"][1]  # the range is rounded
    assert row["threads"] == 1  # torchrun's OMP_NUM_THREADS=1
    profiles = list(tmp_path.glob("profile_*.txt"))
    if profile:  # rank 0's first timed step, by host time
        assert len(profiles) == 1 and profiles[0].name.startswith("profile_ddp_convnext_atto_32-true_")
        header, table = profiles[0].read_text().split("\n", 1)
        assert json.loads(header)["strategy"] == "ddp" and "aten::convolution" in table
    else:
        assert not profiles


def test_benchmark_sweep_writes_one_csv_and_a_plot(tmp_path):
    """benchmarks/sweep.py as a 2-job Hydra multirun at toy size on CPU; no timing is asserted."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sweep.py"), "-m", "device=cpu", "backbone=convnext_atto"]
    cmd += ["batch=1", "height=64", "width=256", "spatial=1,2", "steps=1", "warmup=0", f"hydra.sweep.dir={tmp_path}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "bench.csv").open()))
    assert [(r["spatial"], r["tiles"]) for r in rows] == [("1", "1x1"), ("2", "1x2")]
    assert all(float(r["ours_ms"]) > 0 and float(r["shard_ms"]) > 0 for r in rows)
    assert float(rows[0]["halo_mib_per_step"]) == 0 < float(rows[1]["halo_mib_per_step"])
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_data_formats_benchmark_smoke(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "data_formats.py"), "--sizes", "8x22", "--samples", "4"]
    done = subprocess.run([*cmd, "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "render 8x22 temporal=True" in done.stdout and all(f"records {f}: write" in done.stdout for f in FORMATS)
    assert done.stdout.count("2 ranks cold") == len(FORMATS)
