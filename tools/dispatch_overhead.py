"""Host time per op, plain tensor vs SpatialTensor: the Python our dispatch adds to every op.

When a rank's GPU work per step is short (bf16 ConvNeXt-XL at S=8: 75 ms), this per-op host time decides
the step time (docs/benchmarks.md). Tiny CPU tensors keep compute negligible; one process with PyTorch's
``fake`` process group (halo messages skipped, as in benchmarks/spatial_step.py) stands for an interior rank of
``--spatial`` ranks sharded along the width. The "protocol alone" rows time a subclass whose
``__torch_function__`` only runs the op: the floor our dispatch stands on.

    python tools/dispatch_overhead.py --calls 2000
"""

from __future__ import annotations

import argparse
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_spatial.layout import DimShard, Layout
from lightning_spatial.primitives import Axis
from lightning_spatial.tensor import wrap


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000, help="calls per op and repeat")
    p.add_argument(
        "--repeats", type=int, default=7, help="the least of this many timings is reported (the least disturbed)"
    )
    p.add_argument("--spatial", type=int, default=8)
    p.add_argument("--model", default="convnext_atto", help="also time one forward of this timm model")
    return p.parse_args()


def per_call_us(fn, x, calls: int, repeats: int) -> float:
    for _ in range(max(calls // 10, 1)):
        fn(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return min(times)


class _Minimal(torch.Tensor):
    """The least a ``__torch_function__`` subclass can do (run the op, keep the class): the protocol's own cost,
    the floor under our dispatch."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if type(out) is torch.Tensor:
            out.__class__ = cls
        return out


def main() -> None:
    args = parse()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", rank=1, world_size=args.spatial, store=FakeStore())
    channels, width = 8, 8 * args.spatial
    layout = Layout((DimShard(-1, Axis.from_group(), width),))
    x = torch.randn(1, channels, 4, 8)
    depthwise, norm = torch.randn(channels, 1, 7, 7), torch.randn(channels)
    pointwise = torch.randn(4 * channels, channels, 1, 1)
    fc, scale = torch.nn.Linear(channels, 4 * channels), torch.randn(1, channels, 1, 1)
    ops = {
        "conv2d 7x7 depthwise (halo)": lambda t: F.conv2d(t, depthwise, padding=3, groups=channels),
        "conv2d 1x1 (no halo)": lambda t: F.conv2d(t, pointwise),
        "permute": lambda t: t.permute(0, 2, 3, 1),
        "layer_norm (channels last)": lambda t: F.layer_norm(t.permute(0, 2, 3, 1), (channels,), norm, norm),
        "linear (channels last)": lambda t: fc(t.permute(0, 2, 3, 1)),
        "gelu": F.gelu,
        "gelu, as nn.GELU calls it": torch.nn.GELU(),  # approximate= by keyword, as modules pass options
        "mul by a replicated tensor": lambda t: t * scale,
        "add": lambda t: t + t,
        "shape": lambda t: t.shape,
    }
    print(f"{'op':32} {'plain us':>9} {'sharded us':>11} {'added us':>9}")
    for name, fn in ops.items():
        plain = per_call_us(fn, x, args.calls, args.repeats)
        sharded = per_call_us(fn, wrap(x, layout), args.calls, args.repeats)
        print(f"{name:32} {plain:9.1f} {sharded:11.1f} {sharded - plain:9.1f}", flush=True)
    for name in ("gelu", "add"):  # the floor: no layout, no checks
        plain = per_call_us(ops[name], x, args.calls, args.repeats)
        minimal = per_call_us(ops[name], x.as_subclass(_Minimal), args.calls, args.repeats)
        print(f"{name + ', protocol alone':32} {plain:9.1f} {minimal:11.1f} {minimal - plain:9.1f}", flush=True)
    model = timm.create_model(args.model, pretrained=False, num_classes=10)
    shard = torch.randn(1, 3, 32, 128)  # rank 1's columns of a 32 x 128*S image: no stage is thinner than a halo
    image_layout = Layout((DimShard(-1, Axis.from_group(), 128 * args.spatial),))
    calls = max(args.calls // 200, 1)
    with torch.no_grad():
        plain = per_call_us(model, shard, calls, args.repeats) / 1e3
        sharded = per_call_us(model, wrap(shard, image_layout), calls, args.repeats) / 1e3
    print(f"{args.model + ' forward (ms)':32} {plain:9.2f} {sharded:11.2f} {sharded - plain:9.2f}")

    def train_step(x):  # forward and backward: the autograd Functions of windows and collectives too
        model(x).sum().backward()

    plain = per_call_us(train_step, shard, calls, args.repeats) / 1e3
    sharded = per_call_us(train_step, wrap(shard, image_layout), calls, args.repeats) / 1e3
    print(f"{args.model + ' fwd+bwd (ms)':32} {plain:9.2f} {sharded:11.2f} {sharded - plain:9.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
