"""spatial_tp on two GPUs over NCCL (halos batched as one coalesced launch) reaches one GPU's weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.strategy.lit import Images, LitModel
from tests.strategy.test_equivalence import assert_same_weights, fit

SCRIPT = Path(__file__).with_name("nccl_script.py")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL)")
@pytest.mark.parametrize("shard_dim,graphs", [("width", False), ("height", False), ("width", True)])
def test_spatial_tp_on_two_gpus_matches_one_gpu(tmp_path, shard_dim, graphs):
    """``graphs``: the model replays as CUDA graphs (halo messages over NCCL inside them) from its third step
    of nine."""
    images = 12 if graphs else 4
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT)]
    cmd += ["--out", str(tmp_path), "--shard-dim", shard_dim, "--images", str(images)] + ["--cuda-graphs"] * graphs
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[2])}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    ours = LitModel("convnext_atto")
    ours.load_state_dict(torch.load(tmp_path / "final.pt"))
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    reference = LitModel("convnext_atto")
    fit(reference, "auto", 1, Images(images, 64, 64), 4, accelerator="gpu")
    assert_same_weights(ours, reference.cpu())
