"""Host time of Horovod's gradient hooks: what one backward costs the training thread with
``hvd.DistributedOptimizer`` (a Python hook per parameter) and with ``HorovodStrategy(bucket_mb=...)``'s
buckets (a light hook per parameter, one grouped all-reduce per bucket), against no hooks at all.

    horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python tools/horovod_host.py

The model has PETR's parameter count (481) in tiny layers, so backward's own work is small and the hooks show.
Times are the training thread's CPU time (``time.thread_time``): Horovod's background thread, which does the
communication, is not counted, nor does it count when it preempts the training thread. Medians over steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import horovod.torch as hvd
import torch
from torch import nn

from lightning_spatial.strategies.horovod import GradientBuckets


def backward_ms(model: nn.Module, x: torch.Tensor, synchronize) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    start = time.thread_time()
    loss.backward()
    elapsed = (time.thread_time() - start) * 1e3
    synchronize()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parameters", type=int, default=480, help="weights and biases of tiny linear layers")
    p.add_argument("--steps", type=int, default=50, help="steps of each, interleaved (after 5 of each)")
    p.add_argument("--bucket-mb", type=float, default=0.01, help="bucket size (the layers hold 1 KiB each)")
    args = p.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    models = []
    for _ in range(3):  # the same model thrice: no hooks, Horovod's optimizer, our buckets; steps interleave
        torch.manual_seed(0)
        models.append(nn.Sequential(*[nn.Linear(16, 16) for _ in range(args.parameters // 2)]))
    plain, theirs, ours = models
    n = len(list(plain.parameters()))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(theirs.parameters(), lr=0.1), theirs.named_parameters())
    buckets = GradientBuckets(hvd, list(ours.parameters()), int(args.bucket_mb * 2**20), hvd.Compression.none)

    def bucketed() -> None:
        buckets.synchronize()
        buckets.armed = True

    buckets.armed = True
    runs = {"no hooks": (plain, lambda: None), "hvd.DistributedOptimizer": (theirs, optimizer.synchronize)}
    runs["bucket_mb"] = (ours, bucketed)
    times: dict[str, list[float]] = {name: [] for name in runs}
    x = torch.randn(4, 16)
    for step in range(args.steps + 5):
        for name, (model, synchronize) in runs.items():
            elapsed = backward_ms(model, x, synchronize)
            if step >= 5:
                times[name].append(elapsed)
    if hvd.rank() == 0:
        base = statistics.median(times["no hooks"])
        print(f"{n} parameters, {len(buckets.buckets)} buckets; backward, training thread's CPU ms (median):")
        for name, values in times.items():
            ms = statistics.median(values)
            print(f"  {name:26} {ms:6.2f} ms   hooks {(ms - base) / n * 1e3:5.1f} us per parameter")


if __name__ == "__main__":
    main()
