"""One rank's peak memory and time of a PETR-sized decoder cross-attending to camera tokens, three ways.

A 6-layer ``nn.TransformerDecoder`` (900 queries, 256 channels, 8 heads, FFN 2048) attends to the stride-16
tokens of 6 cameras at 640x1600 (6 x 40 x 100 = 24,000 tokens); forward and backward, the gradient reaching
the queries, the decoder and the camera features:

- ``single``: one device holds every token (the baseline).
- ``split``: one rank of our S-way width split: it holds 1/S of every camera's columns as a ``SpatialTensor``;
  tokens are a merged, sharded dim and each cross-attention merges the ranks' partial results by log-sum-exp.
- ``gather``: the same rank if attention had no handler: the exact fallback all-gathers keys and values in
  every layer (what a model got before ``ops.attention``).

One GPU runs one rank with PyTorch's ``fake`` process group (collectives return at once: one rank's real
compute and memory; the all-reduces' bytes are reported, not sent). ``peak GiB`` is
``torch.cuda.max_memory_allocated`` over the timed steps, ``step GiB`` the part above what stays allocated
between steps (weights, their gradients, the inputs): the activations and workspace of forward + backward.

    python tools/bench_attention.py --check     # first: our CUDA kernels against torch (S=1, exact), then
    python tools/bench_attention.py             # the table; rows appended to $OUT/bench_attention.jsonl

CPU smoke run (CI, no timing asserted):

    python tools/bench_attention.py --device cpu --queries 8 --dim 16 --heads 2 --ffn 32 --cameras 2 \\
        --height 4 --width 8 --layers 1 --spatial 2 --steps 1 --warmup 0 --check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_spatial import SpatialFallbackWarning, register_handler, remove_handler
from lightning_spatial.primitives import Axis, DimShard, Layout, partition, wrap
from lightning_spatial.run import Run, entered

GIB = 2**30


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queries", type=int, default=900)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cameras", type=int, default=6)
    p.add_argument("--height", type=int, default=40, help="token rows per camera (640 / 16)")
    p.add_argument("--width", type=int, default=100, help="token columns per camera (1600 / 16)")
    p.add_argument("--spatial", type=int, default=4, help="ranks of the width split")
    p.add_argument("--modes", default="single,split,gather")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--check", action="store_true", help="first compare split with single at S=1 (must agree)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p.parse_args()


def decoder(args, device) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(
        args.dim, args.heads, dim_feedforward=args.ffn, dropout=args.dropout, batch_first=True
    )
    return nn.TransformerDecoder(layer, args.layers).to(device)


def camera_tokens(features: torch.Tensor, batch: int) -> torch.Tensor:
    """(B*N, C, h, w) -> (B, N*h*w, C) as PETR flattens them (sharded maps give sharded tokens)."""
    bn, c, h, w = features.shape
    return features.unflatten(0, (batch, bn // batch)).permute(0, 1, 3, 4, 2).reshape(batch, -1, c)


def inputs(args, device, columns: tuple[int, int], width_axis: Axis | None):
    """Queries, and this rank's camera features (all of them when ``width_axis`` is None), with gradients."""
    gen = torch.Generator(device=device).manual_seed(1)
    queries = torch.randn(args.batch, args.queries, args.dim, device=device, generator=gen).requires_grad_()
    shape = (args.batch * args.cameras, args.dim, args.height, args.width)
    full = torch.randn(shape, device=device, generator=gen)  # every rank draws the same, keeps its columns
    local = full[..., columns[0] : columns[1]].clone().requires_grad_()
    del full
    if width_axis is None:
        return queries, local, local
    return queries, local, wrap(local, Layout((DimShard(-1, width_axis, args.width),)))


def step_fn(model, queries, features, args, mask=None):
    def step():
        ctx = (
            torch.autocast(queries.device.type, torch.bfloat16)
            if args.precision == "bf16"
            else contextlib.nullcontext()
        )
        with ctx:
            out = model(queries, camera_tokens(features, args.batch), memory_key_padding_mask=mask)
        out.float().square().mean().backward()
        return out

    return step


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(step, device, steps: int, warmup: int) -> tuple[float, float, float]:
    """(median ms, peak GiB, peak GiB above what stays allocated between steps: weights, their gradients,
    inputs)."""
    for _ in range(warmup):
        step()
    sync(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else float("nan")
    return statistics.median(times), peak, peak - base / GIB


@contextlib.contextmanager
def fallbacks_counted(gather: bool):
    """Count the fallbacks of the block (``gather``: as if attention had no spatial handler, so that
    ``multi_head_attention_forward`` takes the exact fallback; else fallbacks raise)."""
    counted = []
    saved = remove_handler(F.multi_head_attention_forward) if gather else None
    try:
        with entered(Run(fallback="warn" if gather else "error")), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", SpatialFallbackWarning)
            yield counted
        counted.extend(w for w in caught if w.category is SpatialFallbackWarning)
    finally:
        if saved is not None:
            register_handler(F.multi_head_attention_forward, override=True)(saved)


def fake_group(rank: int, size: int) -> Axis:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=size, store=FakeStore())
    return Axis.from_group()


def run_mode(args, device, mode: str) -> dict:
    s = 1 if mode == "single" else args.spatial
    rank = min(1, s - 1)  # an interior rank
    axis = fake_group(rank, s) if mode != "single" else None
    model = decoder(args, device)
    columns = partition(args.width, s)[rank]
    queries, leaf, features = inputs(args, device, columns, axis)
    step = step_fn(model, queries, features, args)
    with fallbacks_counted(gather=mode == "gather") as fallbacks:
        ms, peak, transient = measure(step, device, args.steps, args.warmup)
    tokens = args.batch * args.cameras * args.height * args.width
    row = {
        "mode": mode,
        "spatial": s,
        "rank": rank,
        "queries": args.queries,
        "dim": args.dim,
        "heads": args.heads,
        "tokens": tokens,
        "tokens_here": args.batch * args.cameras * args.height * (columns[1] - columns[0]),
        "fallbacks": len(fallbacks),  # ops that gathered (once per op and layer)
        "layers": args.layers,
        "precision": args.precision,
        "dropout": args.dropout,
        "ms": ms,
        "peak_gib": peak,
        "step_gib": transient,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    if mode == "split":  # per layer: one max all-reduce (B, h, Lq) and one of (B, h, Lq, E + 1), then dO's
        b, h, lq, e = args.batch, args.heads, args.queries, args.dim // args.heads
        row["allreduce_mib_per_step"] = args.layers * 4 * (b * h * lq * (1 + (e + 1) + e)) / 2**20
    del model, queries, leaf, features, step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def check(args, device) -> float:
    """Our split path at S=1 (every kernel and merge step, one rank) against plain torch: max relative error of
    the output and the gradients of queries, features and weights, with a key padding mask (the bias path)."""
    results = []
    for split in (False, True):
        axis = fake_group(0, 1) if split else None
        model = decoder(args, device)
        queries, leaf, features = inputs(args, device, (0, args.width), axis)
        keep = torch.rand(args.batch, args.cameras * args.height * args.width, device=device) > 0.2
        out = step_fn(model, queries, features, args, mask=~keep)()
        grads = [queries.grad, leaf.grad, *(p.grad for p in model.parameters())]
        results.append([out.detach(), *grads])  # the output is replicated: a plain tensor
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(*results))
    print(f"check: split vs single at S=1, max relative error {worst:.2e}", flush=True)
    return worst


COLUMNS = [
    ("ms", "ms", 9, 1),
    ("peak GiB", "peak_gib", 9, 3),
    ("step GiB", "step_gib", 9, 3),
    ("tokens here", "tokens_here", 12, 0),
]


def print_table(rows: list[dict]) -> None:
    print(f"\n{'mode':8} {'S':>2}" + "".join(f" {t:>{w}}" for t, _, w, _ in COLUMNS))
    for r in rows:
        print(f"{r['mode']:8} {r['spatial']:>2}" + "".join(f" {r[k]:{w}.{d}f}" for _, k, w, d in COLUMNS))


def main() -> None:
    args = parse()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.check and check(args, device) > (2e-2 if args.precision == "bf16" else 1e-4):
        raise SystemExit("check failed: the split path disagrees with torch")
    rows = []
    for mode in args.modes.split(","):
        rows.append(run_mode(args, device, mode))
        print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "bench_attention.jsonl"), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print_table(rows)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
