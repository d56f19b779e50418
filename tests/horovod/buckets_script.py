"""Run under horovodrun by tests/horovod/test_horovod.py: ``GradientBuckets`` against ``hvd.allreduce``, with a
layer no rank uses and a layer only rank 0 uses (a bucket that never fills during backward)."""

from __future__ import annotations

import sys
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_spatial.strategies.horovod import GradientBuckets  # noqa: E402


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.rank0_only, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.rank0_only(x) if hvd.rank() == 0 else x


def main() -> None:
    hvd.init()
    torch.manual_seed(0)
    model = Model().double()
    torch.manual_seed(1 + hvd.rank())
    x = torch.randn(3, 8, dtype=torch.float64)
    model(x).square().sum().backward()
    reference = {
        n: hvd.allreduce(p.grad if p.grad is not None else torch.zeros_like(p), op=hvd.Average, name=f"ref.{n}")
        for n, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    buckets = GradientBuckets(hvd, list(model.parameters()), 8 * 72, hvd.Compression.none)  # a layer a bucket
    assert len(buckets.buckets) == 6, len(buckets.buckets)
    for _ in range(2):  # twice: the counts start again after synchronize
        model.zero_grad(set_to_none=True)
        buckets.armed = True
        model(x).square().sum().backward()
        sent_in_backward = len(buckets._sent)
        buckets.synchronize()
        assert sent_in_backward == (5 if hvd.rank() == 0 else 4), sent_in_backward  # the rest: in synchronize
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, reference[n]), n  # float64, the same sum of two terms: exact
    assert buckets.armed is False
    buckets.remove()
    model(x).sum().backward()  # no hooks left: nothing is sent
    assert not buckets._sent
    print("buckets ok", hvd.rank())


if __name__ == "__main__":
    main()
