"""Run under torchrun by tests/strategy/test_nccl.py: train convnext_atto with spatial_tp on 2 GPUs over NCCL."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_spatial import SpatialParallelStrategy  # noqa: E402
from tests.strategy.lit import Images, LitModel  # noqa: E402
from tests.strategy.test_equivalence import fit  # noqa: E402


class Replayed(L.Callback):
    def on_train_end(self, trainer, pl_module):
        assert len(pl_module.model._graphs) == 1, "the model never replayed"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shard-dim", default="width")
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--cuda-graphs", action="store_true", help="replay the timm model as CUDA graphs")
    args = p.parse_args()
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # plain fp32, as the reference
    model = LitModel("convnext_atto")
    strategy = SpatialParallelStrategy(2, args.shard_dim, cuda_graphs=["model"] if args.cuda_graphs else ())
    callbacks = [Replayed()] if args.cuda_graphs else []
    data = Images(args.images, 64, 64)
    trainer = fit(model, strategy, 2, data, 4, accelerator="gpu", callbacks=callbacks)
    if trainer.global_rank == 0:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, Path(args.out) / "final.pt")


if __name__ == "__main__":
    main()
