"""Running the repository's scripts (recipes/, benchmarks/, tools/) the way their users do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun_2(script: str, *args: str, cwd: Path | None = None) -> str:
    """Run ``script`` (a path from the repository root) on 2 processes under torchrun (rendezvous on this
    machine); its stdout."""
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    done = subprocess.run(
        [*cmd, str(ROOT / script), *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout
