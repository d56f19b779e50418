"""The Hydra recipes run end to end (toy sizes): the main job, a dense task, and a multirun sweep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOY = [
    "data.num_samples=8",
    "data.val_samples=4",
    "data.height=32",
    "data.width=64",
    "data.batch_size=4",
    "trainer.max_epochs=1",
]


def run(*overrides: str, tmp_path: Path, flags: tuple[str, ...] = ()) -> str:
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "train.py"),
        *flags,
        *TOY,
        f"hydra.run.dir={tmp_path}",
        f"hydra.sweep.dir={tmp_path}",
        *overrides,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


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
@pytest.mark.parametrize("overrides", [(), ("model=convnext_atto",), ("strategy=single", "trainer.devices=1")])
def test_train_recipe(overrides, tmp_path):
    assert "final metrics:" in run(*overrides, tmp_path=tmp_path)


@pytest.mark.slow
def test_multirun_sweep(tmp_path):
    out = run("strategy.spatial_size=1,2", tmp_path=tmp_path, flags=("-m",))  # data parallel vs spatial
    assert out.count("final metrics:") == 2


def test_benchmark_smoke_on_cpu(tmp_path):
    """The benchmark script runs end to end at a toy size (fake process group); no timing is asserted."""
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
        str(tmp_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert [(r["spatial"], r["tiles"]) for r in rows] == [(2, "1x2"), (2, "1x2"), (4, "1x4"), (4, "2x2")]
    assert all(r["halo_mib_per_step"] > 0 and r["ours_ms"] > 0 for r in rows)


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


def test_dispatch_overhead_smoke():
    """The per-op host-time script runs every op on plain and sharded tensors; no timing is asserted."""
    cmd = [sys.executable, str(ROOT / "recipes" / "dispatch_overhead.py"), "--calls", "20", "--repeats", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    assert len(rows) == 9 and rows[-1][0] == "convnext_atto"


@pytest.mark.slow
def test_notebook_runs(tmp_path):
    """Executes the tour notebook's code cells in order (no Jupyter needed), in a fresh interpreter."""
    cells = json.loads((ROOT / "notebooks" / "tour.ipynb").read_text())["cells"]
    code = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    script = tmp_path / "tour.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "largest relative weight difference" in done.stdout


@pytest.mark.slow
def test_train_recipe_under_torchrun(tmp_path):
    """Launched by torchrun, Lightning's TorchElasticEnvironment supplies the ranks (as on a GPU cluster)."""
    out = torchrun_2("train.py", *TOY, "strategy.start_method=popen", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert out.count("final metrics:") == 2
