"""Run under horovodrun by tests/horovod/test_horovod.py: a tiny BEV detector (``--model``: petr, bevformer), data
parallel on Horovod, float64."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.models.test_bev_training import train  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="petr")
    args = p.parse_args()
    torch.set_num_threads(1)
    import lightning_spatial

    replica = (int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"]))  # set by horovodrun
    model = train(args.model, lightning_spatial.HorovodStrategy(), 1, replica)
    if model.trainer.global_rank == 0:
        torch.save(model.state_dict(), Path(args.out) / f"{args.model}.pt")


if __name__ == "__main__":
    main()
