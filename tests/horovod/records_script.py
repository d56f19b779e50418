"""Run under horovodrun by tests/horovod/test_horovod.py: train from the packed records at ``--records``, which
local rank 0 (re)writes in prepare_data while the other rank waits."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import lightning_spatial  # noqa: E402
from tests.data.records_trainer import fit  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    fit(lightning_spatial.HorovodStrategy(), 1, args.records)


if __name__ == "__main__":
    main()
