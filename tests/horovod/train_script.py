"""Run under horovodrun by tests/horovod/test_horovod.py: train convnext_atto with strategy="horovod"."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import lightning_spatial  # noqa: E402
from tests.strategy.lit import Images, LitModel, loader  # noqa: E402


class BucketsSentDuringBackward(L.Callback):
    """With ``bucket_mb``: every bucket left in backward, sent by its hooks (none on accumulating backwards)."""

    def __init__(self) -> None:
        self.checked = 0

    def on_after_backward(self, trainer, pl_module) -> None:  # before the strategy's post_backward waits
        buckets = trainer.strategy._buckets
        assert buckets is not None and len(buckets.buckets) > 1, "the gradients did not go through buckets"
        assert len(buckets._sent) == (len(buckets.buckets) if buckets.armed else 0), (len(buckets._sent), buckets.armed)
        compressed = trainer.strategy.compression == "fp16"  # sent as fp16 copies, copied back when they arrive
        assert all((grads is not None) == compressed for _, grads, _ in buckets._sent.values()), "compression"
        self.checked += buckets.armed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--accelerator", default="cpu", help="gpu: NCCL (plain fp32: TF32 off, as the reference)")
    p.add_argument("--compression", default="none")
    p.add_argument("--fusion-threshold", type=int, default=None)
    p.add_argument("--groups", type=int, default=None)
    p.add_argument("--bucket-mb", type=float, default=None)
    p.add_argument("--async-completion", action="store_true")
    p.add_argument("--trace", default=None, help="Horovod timeline path (horovodrun claims --timeline)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    model = LitModel("convnext_atto")
    strategy = lightning_spatial.HorovodStrategy(
        compression=args.compression,
        fusion_threshold_bytes=args.fusion_threshold,
        groups=args.groups,
        bucket_mb=args.bucket_mb,
        timeline=args.trace,
        async_completion=args.async_completion,
    )
    check = BucketsSentDuringBackward()
    trainer = L.Trainer(
        callbacks=[check] if args.bucket_mb is not None else [],
        accelerator=args.accelerator,
        devices=1,
        strategy=strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
        accumulate_grad_batches=args.accumulate,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, loader(Images(args.samples, 32, 64), args.batch), loader(Images(6, 32, 64, seed=1), 2))
    if trainer.global_rank == 0:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, Path(args.out) / "final.pt")
        Path(args.out, "checkpoint.txt").write_text(
            trainer.checkpoint_callback.best_model_path or trainer.checkpoint_callback.last_model_path
        )
    if args.async_completion:  # reached Horovod before its init
        assert os.environ["HOROVOD_ENABLE_ASYNC_COMPLETION"] == "1"
    if args.groups is not None:  # the option reached Horovod's optimizer (its grouped path ran)
        assert all(opt._groups == args.groups for opt in trainer.strategy.optimizers), "groups did not reach Horovod"
    if args.bucket_mb is not None:  # the buckets reduced the gradients, not Horovod's optimizer
        assert check.checked == trainer.global_step, (check.checked, trainer.global_step)
        assert trainer.strategy._buckets is None, "the buckets' hooks outlived fit"  # teardown removed them
        assert not any(type(opt).__module__.startswith("horovod") for opt in trainer.strategy.optimizers)
    assert rank_zero_only.rank == trainer.global_rank, "rank zero's logging and printing would run on every rank"
    # every rank must hold the same weights, and report the same synchronised metrics
    gathered = trainer.strategy.all_gather(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(gathered[0], gathered[1]), "weights differ between Horovod ranks"
    metrics = torch.stack([trainer.callback_metrics["val_loss"], trainer.callback_metrics["val_acc"]])
    gathered = trainer.strategy.all_gather(metrics)
    assert torch.equal(gathered[0], gathered[1]), f"ranks report different metrics: {gathered.tolist()}"
    if trainer.global_rank == 0:
        torch.save({k: v.cpu() for k, v in trainer.callback_metrics.items()}, Path(args.out) / "metrics.pt")


if __name__ == "__main__":
    main()
