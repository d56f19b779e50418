"""Run under torchrun by tests/strategy/test_nccl.py: train convnext_atto with spatial_tp on 2 GPUs over NCCL."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_spatial import SpatialParallelStrategy  # noqa: E402
from tests.strategy.lit import Images, LitModel  # noqa: E402
from tests.strategy.test_equivalence import fit  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shard-dim", default="width")
    args = p.parse_args()
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # plain fp32, as the reference
    model = LitModel("convnext_atto")
    trainer = fit(model, SpatialParallelStrategy(2, args.shard_dim), 2, Images(4, 64, 64), 4, accelerator="gpu")
    if trainer.global_rank == 0:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, Path(args.out) / "final.pt")


if __name__ == "__main__":
    main()
