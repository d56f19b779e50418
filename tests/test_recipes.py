"""The Hydra recipes run end to end (toy sizes): the main job, a dense task, and a multirun sweep."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOY = ["data.num_samples=8", "data.val_samples=4", "data.height=32", "data.width=64", "data.batch_size=4",
       "trainer.max_epochs=1"]


def run(*overrides: str, tmp_path: Path, flags: tuple[str, ...] = ()) -> str:
    cmd = [sys.executable, str(ROOT / "recipes" / "train.py"), *flags, *TOY, f"hydra.run.dir={tmp_path}",
           f"hydra.sweep.dir={tmp_path}", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [(), ("model=resnet18_seg",), ("strategy=single", "trainer.devices=1")])
def test_train_recipe(overrides, tmp_path):
    assert "final metrics:" in run(*overrides, tmp_path=tmp_path)


@pytest.mark.slow
def test_multirun_sweep(tmp_path):
    out = run("strategy.spatial_size=1,2", tmp_path=tmp_path, flags=("-m",))  # data parallel vs spatial
    assert out.count("final metrics:") == 2
