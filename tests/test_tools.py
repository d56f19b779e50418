"""The internal tools (tools/) run end to end at toy sizes on CPU; no timing or score is asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.scripts import ROOT

pytestmark = pytest.mark.slow  # scripts run end to end in subprocesses


def test_window_join_smoke():
    """The halo-window join benchmark runs on CPU and both ways join the same window; no timing is asserted."""
    cmd = [sys.executable, str(ROOT / "tools" / "bench_window.py"), "--device", "cpu", "--batch", "1"]
    done = subprocess.run([*cmd, "--calls", "1", "--dtype", "float32"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("\n") == 5  # a header and four stages


def test_dispatch_overhead_smoke():
    """The per-op host-time script runs every op on plain and sharded tensors; no timing is asserted."""
    cmd = [sys.executable, str(ROOT / "tools" / "dispatch_overhead.py"), "--calls", "20", "--repeats", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines()[1:]]
    assert len(rows) == 14 and [r[1] for r in rows[-2:]] == ["forward", "fwd+bwd"]
    assert ["gelu,", "as", "nn.GELU", "calls", "it"] in [r[:5] for r in rows]  # the module path, options by keyword
    assert [r[:3] for r in rows[-4:-2]] == [["gelu,", "protocol", "alone"], ["add,", "protocol", "alone"]]


def test_petr_sweep_smoke(tmp_path):
    """tools/petr_sweep.sh on CPU: two variants side by side, two steps each; both logs, metrics and the
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
        ["bash", str(ROOT / "tools" / "petr_sweep.sh"), str(variants)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()}
    assert set(lines) == {"q100_lr5e-4", "few"} and all(lines.values()), done.stdout
    with tarfile.open(tmp_path / "sweep.tgz") as tar:
        names = tar.getnames()
    assert "runs/few/csv/metrics.csv" in names and "runs.q100_lr5e-4.log" in names, names


def test_profile_diff_sums_kernels_by_kind_and_leaves_host_rows_out(tmp_path):
    """tools/profile_diff.py on two op lists as trainer_step.py writes them: host rows (ops, autograd nodes, a
    replayed graph's node) repeat their kernels' time and are left out; the baseline is divided by --per."""
    rows = {
        "rank": [
            ["_ReplayBackward", 900.0, 1],
            ["aten::mm", 500.0, 2],
            ["ConvolutionBackward0", 300.0, 1],
            ["fmha_cutlassB_bf16(PyTorchMemEffAttention::AttentionBackwardKernel)", 700.0, 6],
            ["nvjet_sm90_tst_64x128", 500.0, 2],
            ["Memcpy DtoD (Device -> Device)", 200.0, 40],
            ["_ZN17cutlass__5x_cudnn6KernelINS_4conv", 100.0, 1],
        ],
        "base": [["aten::mm", 1600.0, 2], ["nvjet_sm90_tst_128x128", 1600.0, 2], ["Memset (Device)", 400.0, 3]],
    }
    for name, table in rows.items():
        lines = [json.dumps({"strategy": name}), "sorted by self_device_time_total", "(a table)"]
        lines += ["every op, device time (us), calls", *map(json.dumps, table)]
        (tmp_path / f"{name}.txt").write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, str(ROOT / "tools" / "profile_diff.py"), str(tmp_path / "rank.txt")]
    done = subprocess.run([*cmd, str(tmp_path / "base.txt"), "--per", "4"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    table = {line[:20].strip(): line[20:].split() for line in done.stdout.splitlines()[1:10]}
    assert table["attention"] == ["0.00", "0.70"] and table["gemm"] == ["0.40", "0.50"]
    assert table["copy, fill"] == ["0.10", "0.20"] and table["convolution"] == ["0.00", "0.10"]
    assert table["all kernels"] == ["0.50", "1.50"]


def test_memory_peak_finds_each_places_peak_and_what_was_alive_then():
    """tools/memory_peak.py on an allocator history: events before the fit's marker are left out, the pool's and the
    eager allocator's peaks are found apart (by the pool's segments), freed blocks leave the peak's groups."""
    spec = importlib.util.spec_from_file_location("memory_peak", ROOT / "tools" / "memory_peak.py")
    memory_peak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory_peak)
    mib = 2**20
    conv = [{"filename": "/x/site-packages/timm/models/convnext.py", "line": 201, "name": "forward"}]
    halo = [{"filename": "/y/lightning_spatial/halo.py", "line": 132, "name": "empty_as"}]

    def alloc(addr, size, frames=()):
        return {"action": "alloc", "addr": addr, "size": size * mib, "frames": list(frames)}

    def free(addr):
        return {"action": "free_requested", "addr": addr}

    events = [alloc(0, 50, conv), {"action": "alloc", "addr": 900 * mib, "size": memory_peak.MARK, "frames": []}]
    events += [alloc(0, 10, conv), alloc(10 * mib, 20, halo), free(10 * mib), alloc(10 * mib, 5, halo)]
    events += [alloc(100 * mib, 30, conv), alloc(130 * mib, 8, conv), free(100 * mib), free(0)]
    segments = [{"address": 0, "total_size": 40 * mib, "segment_pool_id": (0, 3)}]
    segments += [{"address": 100 * mib, "total_size": 64 * mib, "segment_pool_id": (0, 0)}]
    out = memory_peak.peaks({"device_traces": [events], "segments": segments})
    assert out["pool_reserved_mib"] == 40 and out["pool_peak_mib"] == 30 and out["eager_peak_mib"] == 38
    assert out["pool_at_peak"] == {
        "forward @ timm/models/convnext.py:201 forward": [10, 1],
        "empty_as @ halo.py:132 empty_as": [20, 1],
    }
    assert out["eager_at_peak"] == {"forward @ timm/models/convnext.py:201 forward": [38, 2]}


def test_op_sources_counts_each_fits_ops_by_the_line_that_issued_them(tmp_path):
    """tools/op_sources.py on CPU: the baseline's ops come from timm and torch's derivatives, the rank's halo
    messages from halo.py, its convolutions from the op layer; the table lists every op of both fits."""
    args = ["--strategy", "spatial_tp", "--fake-world", "2", "--baseline", "device", "--model", "convnext_atto"]
    args += ["--batch", "2", "--height", "32", "--width", "64", "--warmup", "2", "--steps", "1", "--accelerator", "cpu"]
    cmd = [sys.executable, str(ROOT / "tools" / "op_sources.py"), "--out", str(tmp_path), "--", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    baseline, rank = json.loads((tmp_path / "op_sources.json").read_text())["fits"]
    assert (baseline["fit"], rank["fit"]) == ("baseline", "rank")
    for fit in (baseline, rank):
        assert fit["ops"] == sum(fit["sources"].values())
        assert fit["sources"]["convolution_backward @ autograd ConvolutionBackward0"] > 0
        assert any(k.startswith("_single_tensor_adam") or "torch/optim/" in k for k in fit["sources"])
    assert any("timm/models/convnext.py" in k for k in baseline["sources"])
    assert not any("halo.py" in k or "ops/" in k for k in baseline["sources"])
    assert any(k.startswith("send @ halo.py") for k in rank["sources"])
    assert any(k.startswith("convolution @ ops/conv.py") for k in rank["sources"])
    table = done.stdout[done.stdout.index("baseline      rank  op") :].splitlines()
    ops = {line.split()[-1] for line in table[1:]}
    assert {"send", "recv_", "convolution", "convolution_backward"} <= ops
