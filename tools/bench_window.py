"""Device time of joining a halo window, per ConvNeXt-XL stage at S = 8 (one GPU, no communication).

A depthwise 7x7 convolution on a width shard convolves a window: 3 received columns, the shard, 3 more. ConvNeXt's
activations are channels_last; halos travel contiguous (NCHW). This times the ways to join them:

    python tools/bench_window.py          # bf16; --dtype float32; CPU smoke: --device cpu --batch 1 --calls 1

``mixed``: ``torch.cat`` of NCHW halos and the channels_last shard (the op layer until 2026-12-01); ``laid out``: the
halos first copied into the window's layout, then one ``cat`` over views in memory order (``halo._cat``, what the
op layer does now; the halo copies are included); ``ideal``: the shard's bytes read and written once at 3.3 TB/s.
"""

from __future__ import annotations

import argparse
import time

import torch

from lightning_spatial.halo import _cat, _laid_out_like, empty_as

STAGES = [(256, 128, 128), (512, 64, 64), (1024, 32, 32), (2048, 16, 16)]  # (C, H, W/8) of 7x3x512x4096


def timed(fn, device: torch.device, calls: int) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=7)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    print(f"{'stage (C, H, W)':20} {'mixed us':>9} {'laid out us':>12} {'ideal us':>9}")
    for c, h, w in STAGES:
        x = torch.randn(args.batch, c, h, w, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
        left, right = (torch.randn(args.batch, c, h, 3, device=device, dtype=dtype) for _ in range(2))
        out, reference = empty_as(x, [args.batch, c, h, w + 6]), empty_as(x, [args.batch, c, h, w + 6])
        mixed = timed(lambda: torch.cat([left, x, right], 3, out=reference), device, args.calls)
        laid_out = timed(
            lambda: _cat([_laid_out_like(out, left), x, _laid_out_like(out, right)], 3, out), device, args.calls
        )
        assert torch.equal(out, reference), "the two ways joined different windows"
        ideal = 2 * x.numel() * x.element_size() / 3.3e12 * 1e6
        print(f"{str((c, h, w)):20} {mixed:9.0f} {laid_out:12.0f} {ideal:9.0f}")


if __name__ == "__main__":
    main()
