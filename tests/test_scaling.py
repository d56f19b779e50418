"""benchmarks/scaling.py: the multi-GPU scaling grid, rehearsed on CPU under torchrun (gloo); no timing is asserted.
And the profile summary of benchmarks/spatial_step.py: which kernel is which kind of work, how intervals add up."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import spatial_step  # noqa: E402 - a script beside its helpers, not a package

PROFILE_KEYS = {"wall", "idle", "copies"} | {
    f"{k}{e}" for k in ("halo", "collective", "compute") for e in ("", "_exposed")
}


@pytest.mark.parametrize(
    "name, cuda, kind",
    [
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", True, "halo"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", True, "collective"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", True, "collective"),
        ("void cudnn::cnn::conv2d_grouped_direct_kernel<float>(...)", True, "compute"),
        ("_FetchWindowBackward", False, "halo"),
        ("c10d::allreduce_", False, "collective"),
        ("aten::convolution_backward", False, None),
    ],
)
def test_profile_kinds(name, cuda, kind):
    assert spatial_step._kind(name, cuda) == kind


def test_covered_counts_overlaps_once():
    assert spatial_step._covered([]) == 0
    assert spatial_step._covered([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (2.5, 2.75), (6.0, 6.5)]) == 5.0


class _GradientsSeenByForward(torch.nn.Linear):
    """Records, at each forward, whether its weight still holds the last step's gradient."""

    seen: list[bool]

    def forward(self, x):
        self.seen.append(self.weight.grad is not None)
        return super().forward(x)


@pytest.mark.parametrize("zero_grad, seen", [("after_forward", [False, True, True]), ("after_step", [False] * 3)])
def test_benchmark_steps_free_gradients_where_they_say(zero_grad, seen):
    """The benchmark's steps free the gradients where Lightning's closure does (after the forward pass: the last
    step's live through it) or, as a raw loop may, after the optimizer step: what a peak-memory row compares."""

    class Task:
        def loss(self, model, x):
            return model(x).square().mean()

    model = _GradientsSeenByForward(3, 2)
    model.seen = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = spatial_step.train_step(
        Task(), model, optimizer, lambda: torch.randn(4, 3), "fp32", torch.device("cpu"), zero_grad
    )
    fresh = []  # each backward's own gradient: what .grad holds after it unless gradients accumulate
    model.weight.register_hook(lambda grad: fresh.append(grad.clone()))
    for _ in range(3):
        step()
    assert model.seen == seen
    assert model.weight.grad is None if zero_grad == "after_step" else torch.equal(model.weight.grad, fresh[-1])


@pytest.mark.slow
def test_scaling_rehearsal_on_4_ranks(tmp_path):
    """The whole grid at toy size, 4 gloo ranks: baselines, S = 4 (width, 2x2) and D = 2 x S = 2, in fp32 (bf16 rows
    are made by the same code: the next test runs one)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--device", "cpu", "--gpus", "4", "--toy"]
    cmd += ["--precisions", "fp32"]
    done = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "scaling.json").read_text())
    assert [(p["part"], p["rc"]) for p in result["parts"]] == [("one_gpu_fp32", 0), ("convnext", 0), ("petr_tiny", 0)]
    rows = result["rows"]
    grid = [(r["model"], r["precision"], r["data"], r["spatial"], r["tiles"]) for r in rows]
    assert grid == [
        ("convnext_atto", "fp32", 1, 1, "1x1"),
        ("convnext_atto", "fp32", 1, 4, "1x4"),
        ("convnext_atto", "fp32", 1, 4, "2x2"),
        ("convnext_atto", "fp32", 2, 2, "1x2"),
        ("petr_tiny", "fp32", 1, 4, "1x4"),
        ("petr_tiny", "fp32", 2, 2, "1x2"),
    ]
    one_gpu = {r["precision"]: r["shard_ms"] for r in rows if r["part"].startswith("one_gpu")}
    for r in rows[1:]:
        assert r["backend"] == "gloo" and r["ranks"] == 4 and r["halo_mib_per_step"] > 0
        t1 = one_gpu[r["precision"]] if r["model"] == "convnext_atto" else min(r["shard_ms"], r["shard_ms_after"])
        assert math.isclose(r["efficiency"], t1 / (r["spatial"] * r["ours_ms"]))
        assert len(r["ours_gib_ranks"]) == 4 and len(r["profile"]) == 4  # every rank reported
        assert all(set(p) == PROFILE_KEYS and p["wall"] > 0 and p["halo"] > 0 for p in r["profile"])
    context = result["context"]
    assert context["ranks"] == 4 and context["versions"]["torch"] and context["topology"]
    assert (tmp_path / "topology.txt").read_text().strip() == context["topology"]
    assert "model, input" in done.stdout and "fp32 1x4: efficiency" in done.stdout


@pytest.mark.slow
def test_scaling_one_part_one_precision(tmp_path):
    """--parts / --precisions narrow the grid (a bf16 row on a short device call): its baseline comes along."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--device", "cpu", "--gpus", "2", "--toy"]
    cmd += ["--parts", "convnext", "--precisions", "bf16", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "scaling.json").read_text())
    assert [(p["part"], p["rc"]) for p in result["parts"]] == [("one_gpu_bf16", 0), ("convnext", 0)]
    grid = [(r["precision"], r["data"], r["spatial"]) for r in result["rows"]]
    assert grid == [("bf16", 1, 1), ("bf16", 1, 2), ("bf16", 2, 1)]
    assert result["rows"][1]["t1_ms"] == result["rows"][0]["shard_ms"]  # the bf16 baseline, not fp32's
