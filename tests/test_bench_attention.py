"""tools/bench_attention.py runs end to end on CPU at toy size (its split path agrees with torch, its "gather"
baseline really gathers; no timing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOY = "--device cpu --queries 8 --dim 16 --heads 2 --ffn 32 --cameras 2 --height 4 --width 8 --layers 2 --spatial 2"


@pytest.mark.slow
def test_bench_attention_smoke(tmp_path):
    cmd = [sys.executable, str(ROOT / "tools" / "bench_attention.py"), *TOY.split(), "--steps", "1", "--warmup", "0"]
    done = subprocess.run([*cmd, "--check", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "max relative error" in done.stdout
    rows = [json.loads(line) for line in (tmp_path / "bench_attention.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["single", "split", "gather"]
    assert [r["tokens_here"] for r in rows] == [2 * 4 * 8, 2 * 4 * 4, 2 * 4 * 4]
    assert [r["fallbacks"] > 0 for r in rows] == [False, False, True]  # only the baseline takes the fallback
