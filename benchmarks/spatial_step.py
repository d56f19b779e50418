"""Per-rank memory and step time of spatial training against the single-GPU shard-only baseline.

One GPU (PyTorch's ``fake`` process group: collectives return at once, so this measures one rank's real
compute and memory; halo bytes are counted separately):

    python benchmarks/spatial_step.py --widths 4096 --spatial 4,8 --layouts width --precisions fp32

N GPUs (real NCCL halos and gradient all-reduce; spatial groups of ``--spatial`` ranks):

    torchrun --nproc-per-node 8 benchmarks/spatial_step.py --widths 4096 --spatial 8

There every config whose spatial size S divides the world runs, as world/S data replicas; the memory is the
largest over the ranks. ``benchmarks/scaling.py`` drives the whole multi-GPU grid against the one-GPU baseline.

For each configuration it times, in the same process: the plain model on one rank's share of the input
("shard-only": the ideal, no halo, no communication) and our spatial step on that rank (forward,
backward, AdamW). Ratios ours/shard-only are the numbers that matter. Both steps zero the gradients where
Lightning's Trainer does, after the forward pass (``--zero-grad after_forward``): the last step's gradients
live through the forward, in DDP's buckets for ours and as ``.grad`` for the plain model, so the peaks compare
what a Trainer run holds. ``after_step`` frees them before the next forward, as a raw loop may; DDP's buckets
cannot be freed, so there ours carries one gradient's size (1.3 GiB for ConvNeXt-XL) more. CPU smoke run (CI):

    python benchmarks/spatial_step.py --device cpu --model convnext_atto --batch 1 --height 64 --widths 256 \\
        --spatial 2 --steps 1 --warmup 0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import time

import tasks
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from lightning_spatial.primitives import (
    Axis,
    CUDAGraphed,
    DimShard,
    Layout,
    SpatialDims,
    counting_halo_bytes,
    gradients_laid_out_like_parameters,
    noting_bucket_views,
    partition,
    wrap,
)
from lightning_spatial.run import Run, current, entered
from lightning_spatial.strategies._scopes import cutting_bev_planes

GIB = 2**30


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default="convnext_xlarge",
        help="a timm model, or a BEV detector on surround cameras: petr, lift_splat, simple_bev, bevformer "
        "(paper-sized), petr_tiny, lift_splat_tiny, simple_bev_tiny, bevformer_tiny",
    )
    p.add_argument("--cameras", type=int, default=6, help="cameras per sample (BEV detectors)")
    p.add_argument(
        "--bev-shard",
        default="none",
        choices=["none", "x", "y", "xy"],
        help="where a BEV detector's grid ends after its splat: replicated (none) or sharded over its cells "
        "(SpatialParallelStrategy(bev_shard=...))",
    )
    p.add_argument(
        "--bev-planes",
        default="model",
        choices=["model", "none"],
        help="with --bev-shard: the model's parameters that are a BEV grid (BEVFormer's learned queries) cut to the "
        "rank's cells (SpatialParallelStrategy(bev_planes=...)), or none",
    )
    p.add_argument(
        "--bev-size",
        default=None,
        help="a BEV detector's grid, X,Y (e.g. 200,200; default: the module's own)",
    )
    p.add_argument(
        "--bev-encoder",
        default=None,
        help="Lift-Splat's and Simple-BEV's BEV encoder: convs or a timm ResNet (default: the module's own, "
        "resnet18 paper-sized, convs tiny); rows record the one that ran",
    )
    p.add_argument("--batch", type=int, default=7)
    p.add_argument("--height", type=int, default=512)
    p.add_argument("--widths", default="4096", help="comma list")
    p.add_argument("--spatial", default="4", help="comma list of spatial group sizes")
    p.add_argument(
        "--layouts", default="width", help="comma list: width, height, tiles (2-D, square-ish), HxW (2x4: S = 8 only)"
    )
    p.add_argument("--precisions", default="fp32", help="comma list: fp32, bf16")
    p.add_argument("--ckpt", default="0", help="comma list: 0, 1 (timm activation checkpointing)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--baseline",
        default="1",
        choices=["0", "1", "once", "only"],
        help="also time the shard-only baseline, or only it; once: a whole-input baseline (the BEV detectors') is "
        "timed at the first spatial size and reused by the others",
    )
    p.add_argument("--out", default=".")
    p.add_argument("--profile", action="store_true", help="where one spatial step's time goes (torch.profiler)")
    p.add_argument(
        "--zero-grad",
        default="after_forward",
        choices=["after_forward", "after_step"],
        help="where a step sets the gradients to None: after the forward pass, as Lightning's Trainer does "
        "(the last step's live through the forward), or after the optimizer step",
    )
    p.add_argument(
        "--graphs",
        default="none",
        choices=["none", "ours", "both"],
        help="replay the model's forward and backward as CUDA graphs (lightning_spatial.graphs.CUDAGraphed): in "
        "our spatial step, or in it and the shard-only baseline",
    )
    p.add_argument(
        "--compile",
        default="none",
        choices=["none", "ours", "both"],
        help="torch.compile the model (inductor) in our spatial step, or in it and the shard-only baseline",
    )
    p.add_argument("--compile-mode", default=None, help="torch.compile's mode (default, max-autotune-no-cudagraphs)")
    p.add_argument(
        "--compile-backend", default="inductor", help="torch.compile's backend (aot_eager: no code generated)"
    )
    return p.parse_args()


def tiles(layout: str, s: int) -> tuple[int, int]:
    if "x" in layout:
        h, w = layout.split("x")
        return int(h), int(w)
    if layout == "width":
        return 1, s
    if layout == "height":
        return s, 1
    h = int(s**0.5)
    while s % h:
        h -= 1
    return h, s // h


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(step, device, steps: int, warmup: int) -> tuple[float, float, float]:
    """(median step ms, peak GiB allocated and reserved during the timed steps). A CUDA graph's activations live
    in its own pool, reserved at capture: a replay allocates nothing, so for graphs the reserved peak counts."""
    for _ in range(warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    cuda = device.type == "cuda"
    peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else float("nan")
    reserved = torch.cuda.max_memory_reserved(device) / GIB if cuda else float("nan")
    return statistics.median(times), peak, reserved


def train_step(task, model, optimizer, make_input, precision: str, device: torch.device, zero_grad: str):
    """One training step; ``zero_grad`` is where it sets the gradients to None (see the module docstring)."""

    def step():
        x = make_input()
        ctx = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
        with ctx:
            loss = task.loss(model, x)
        if zero_grad == "after_forward":  # Lightning's closure: training_step, zero_grad, backward
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if zero_grad == "after_step":
            optimizer.zero_grad(set_to_none=True)

    return step


def build(task, device, ckpt: bool, graphed: bool = False, compiled: bool = False, mode=None, backend="inductor"):
    torch.manual_seed(0)
    model = task.build(device, ckpt)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if compiled:
        model = torch.compile(model, backend=backend, mode=mode)
    if graphed:
        model = CUDAGraphed(model, warmup=1)
    return model, optimizer


def free(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_config(
    args, device, width: int, s: int, layout: str, precision: str, ckpt: bool, real: bool, timed: dict | None = None
) -> dict:
    """One configuration's row, in a run of the op layer of its own: one rank of a fake group receives zeros where
    halos would arrive (uninitialised memory could hold NaNs, which a detector's Hungarian matching refuses), and
    ``--bev-shard`` says where a BEV detector's grid ends."""
    bev_shard = None if args.bev_shard == "none" else args.bev_shard
    with entered(Run(zero_undelivered=not real, bev_shard=bev_shard)):
        return _run_config(args, device, width, s, layout, precision, ckpt, real, timed)


def _run_config(args, device, width: int, s: int, layout: str, precision: str, ckpt: bool, real: bool, timed) -> dict:
    """``timed``: the whole-input baselines measured so far, by precision, width and checkpointing (``--baseline
    once``; None: each row times its own)."""
    task = tasks.task(args)
    sh, sw = tiles(layout, s)
    rank = dist.get_rank() if real else min(1, s - 1)  # fake: an interior rank (halos on both sides)
    ih, iw = divmod(rank % s, sw)
    (h0, h1), (w0, w1) = partition(args.height, sh)[ih], partition(width, sw)[iw]
    local = task.image_shape(h1 - h0, w1 - w0)
    alone_shape = local if task.baseline == "shard" else task.image_shape(args.height, width)
    row = {
        "model": args.model,
        "batch": args.batch,
        "cameras": args.cameras if task.baseline == "one device" else 0,
        "height": args.height,
        "width": width,
        "spatial": s,
        "data": dist.get_world_size() // s if real else 1,
        "layout": layout,
        "tiles": f"{sh}x{sw}",
        "precision": precision,
        "ckpt": ckpt,
        "rank": rank,
        "baseline": task.baseline,
        "backend": dist.get_backend() if real else "fake",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "zero_grad": args.zero_grad,
        "graphs": args.graphs,
        "compile": args.compile,
        "compile_backend": args.compile_backend,
        "bev_shard": args.bev_shard,
        "bev_planes": args.bev_planes if args.bev_shard != "none" else "none",
        "bev_size": args.bev_size,
    }
    gen = torch.Generator(device=device).manual_seed(rank)
    baseline = args.baseline != "0" and (not real or rank == 0)

    def make_input(shape, layout_obj=None):
        return lambda: task.input(
            wrap(torch.randn(shape, device=device, generator=gen), layout_obj), args.height, width
        )

    def alone() -> tuple[float, float, float]:
        compiled = args.compile == "both"
        model, opt = build(task, device, ckpt, args.graphs == "both", compiled, args.compile_mode, args.compile_backend)
        row.setdefault("bev_encoder", tasks.bev_encoder(model))
        step = train_step(task, model, opt, make_input(alone_shape), precision, device, args.zero_grad)
        result = measure(step, device, args.steps, args.warmup)
        if args.profile and "shard_profile" not in row:
            row["shard_profile"] = profile(step, device, show=False)
        del model, opt, step
        free(device)
        return result

    once = args.baseline == "once" and task.baseline == "one device" and timed is not None
    key = (precision, width, ckpt) if once else None
    reused = timed.get(key) if key else None  # the whole input's step does not depend on S
    if reused:
        row.update(reused)
    elif baseline:
        row["shard_ms"], row["shard_gib"], row["shard_reserved_gib"] = alone()
    if args.baseline == "only":
        return row

    if not real:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=rank, world_size=s, store=FakeStore())
    dims = SpatialDims(dist.get_world_size(), sh, sw)
    mesh = dims.build(device.type)
    shards = []
    if sh > 1:
        shards.append(DimShard(-2, Axis.from_group(mesh.get_group("spatial_h")), args.height))
    if sw > 1:
        shards.append(DimShard(-1, Axis.from_group(mesh.get_group("spatial_w")), width))
    layout_obj = Layout(tuple(shards)) if shards else None
    compiled = args.compile != "none"
    model, opt = build(task, device, ckpt, args.graphs != "none", compiled, args.compile_mode, args.compile_backend)
    row.setdefault("bev_encoder", tasks.bev_encoder(model))
    gradients_laid_out_like_parameters(model)  # as spatial_tp does: no stride warning or gradient copy in DDP
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True
    )  # gradients live in the buckets: no second copy of 1.3 GB of gradients
    graphed = args.graphs != "none"  # replays write their gradients straight into the buckets, noted by the hook
    hook = allreduce_hook if real else _completed  # the fake backend's all-reduce yields no tensor: hand one back
    if graphed or not real:
        ddp.register_comm_hook(None, noting_bucket_views(hook) if graphed else hook)
    row["grad_allreduce_mib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    planes = task.bev_planes if args.bev_shard != "none" and args.bev_planes == "model" else {}
    cut = contextlib.ExitStack()  # as the strategy does while it runs
    cut.enter_context(cutting_bev_planes(model, planes, {d.dim: d.axis for d in shards}, current().bev_shard))
    step = train_step(task, ddp, opt, make_input(local, layout_obj), precision, device, args.zero_grad)
    row["ours_ms"], row["ours_gib"], row["ours_reserved_gib"] = measure(step, device, args.steps, args.warmup)
    if real:  # the rank that needs most memory is the one that matters
        row["ours_gib_ranks"] = every_rank(row["ours_gib"])
        row["ours_gib"] = max(row["ours_gib_ranks"])
    with counting_halo_bytes() as halos:
        step()
    row["halo_mib_per_step"] = halos.sent / 2**20
    if args.profile:
        summary = profile(step, device, show=not real or rank == 0)
        ops = summary.pop("op_device_ms", None)
        row["profile"] = every_rank(summary) if real else [summary]
        if ops is not None and "shard_profile" in row:
            row["extra_device_ms"] = extra_device_time(ops, row["shard_profile"].pop("op_device_ms"))
    cut.close()
    del ddp, model, opt, step
    free(device)
    if baseline:  # time the baseline again after ours: the ratio uses the faster of its two runs
        if not reused:
            row["shard_ms_after"], *_ = alone()
        if key and not reused:
            row["baseline_timed_at_spatial"] = s
            names = ("baseline_timed_at_spatial", "shard_ms", "shard_gib", "shard_reserved_gib", "shard_ms_after")
            timed[key] = {n: row[n] for n in names}
        row["time_ratio"] = row["ours_ms"] / min(row["shard_ms"], row["shard_ms_after"])
        # a replay allocates nothing (its pool is reserved at capture): graphed steps compare reserved peaks
        peak = "reserved_gib" if args.graphs != "none" else "gib"
        row["mem_ratio"] = row[f"ours_{peak}"] / row[f"shard_{peak}"] if device.type == "cuda" else float("nan")
    if not real:
        dist.destroy_process_group()
    return row


COLUMNS = [
    ("shard ms", "shard_ms", 9, 1),
    ("ours ms", "ours_ms", 9, 1),
    ("t ratio", "time_ratio", 8, 3),
    ("shard GiB", "shard_gib", 10, 2),
    ("ours GiB", "ours_gib", 9, 2),
    ("m ratio", "mem_ratio", 8, 3),
    ("halo MiB", "halo_mib_per_step", 9, 1),
]


def print_table(rows: list[dict]) -> None:
    print(f"\n{'config':60}" + "".join(f" {title:>{width}}" for title, _, width, _ in COLUMNS))
    for r in rows:
        r = {**r, "shard_ms": min(r.get("shard_ms", float("nan")), r.get("shard_ms_after", float("nan")))}
        cameras = f"x{r['cameras']}" if r.get("cameras") else ""
        name = f"{r['model']} {r['batch']}{cameras}x3x{r['height']}x{r['width']} S={r['spatial']} {r['tiles']}"
        name += f" {r['precision']}" + (" ckpt" if r["ckpt"] else "")
        name += f" D={r['data']}" if r.get("data", 1) > 1 else ""
        name += f" bev={r['bev_shard']}" if r.get("bev_shard", "none") != "none" else ""
        name += f" {r['bev_encoder']}" if r.get("bev_encoder") else ""
        print(
            f"{name:60}"
            + "".join(f" {r.get(key, float('nan')):{width}.{digits}f}" for _, key, width, digits in COLUMNS)
        )


def profile(step, device, show: bool) -> dict[str, float]:
    """Where one step's time goes, in ms (``show``: print the ops with most device, then host, time).

    On CUDA from the kernels' intervals: ``halo`` (NCCL send/recv), ``collective`` (the other NCCL kernels: the
    gradient buckets' all-reduce, our spatial reductions) and ``compute`` (every other kernel) are the time each
    runs; ``*_exposed`` is the part of it when no kernel of another kind runs (what it adds to the step: a halo
    kernel also waits for its neighbour); ``idle`` is the wall time with no kernel at all (the device waits for the
    host; the profiler's own host cost lands here). On CPU (gloo) from the host ops, coarse: a halo op's time
    includes its window copies, collectives run asynchronously are missed, ``compute`` is the rest of the wall.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        wall = (time.perf_counter() - start) * 1e3
    spans: dict[str, list[tuple[float, float]]] = {"halo": [], "collective": [], "compute": []}
    for e in prof.events():
        if (e.device_type == DeviceType.CUDA) == cuda and (kind := _kind(e.name, cuda)):
            spans[kind].append((e.time_range.start / 1e3, e.time_range.end / 1e3))
    busy = _covered(sum(spans.values(), []))
    out = {"wall": wall, "idle": wall - busy if cuda else 0.0}
    for kind, own in spans.items():
        out[kind] = _covered(own)
        out[f"{kind}_exposed"] = busy - _covered([s for k, v in spans.items() if k != kind for s in v])
    out["copies"] = _copies_by_caller(prof.events())
    if not cuda:
        out["compute"] = out["compute_exposed"] = wall - busy
    else:  # device time by the op that launched it (self time: an op's own kernels)
        out["op_device_ms"] = {
            e.key: e.self_device_time_total / 1e3 for e in prof.key_averages() if e.self_device_time_total > 0
        }
    if show:
        events = prof.key_averages()
        for key in ["self_cuda_time_total"] * cuda + ["self_cpu_time_total"]:
            print(events.table(sort_by=key, row_limit=12))
        print(json.dumps({"profile_ms": {k: v for k, v in out.items() if k not in ("op_device_ms", "copies")}}))
        print(json.dumps({"copies_by_caller": out["copies"]}), flush=True)
    return out


_COPYING = ("aten::copy_", "aten::clone", "aten::_to_copy", "aten::to", "aten::contiguous")


def _copies_by_caller(events) -> dict[str, list]:
    """Every copy of the step (outermost ``aten::copy_``) by the op that asked for it, through ``clone``, ``to``...:
    ``{caller: [count, device ms]}``, e.g. ``torch::autograd::AccumulateGrad > aten::clone`` (autograd copying a
    gradient into ``.grad``) apart from ``torch::distributed::reducer::copy_`` (DDP's into its bucket). Kernels of a
    CUDA graph replay are not among them."""
    out: dict[str, list] = {}
    for e in events:
        if e.name != "aten::copy_" or (e.cpu_parent is not None and e.cpu_parent.name == "aten::copy_"):
            continue
        via, parent = [], e.cpu_parent
        while parent is not None and parent.name in _COPYING:
            via.append(parent.name)
            parent = parent.cpu_parent
        caller = " > ".join([parent.name if parent is not None else "(step)", *via[::-1]])
        count, ms = out.get(caller, [0, 0.0])
        out[caller] = [count + 1, ms + e.device_time_total / 1e3]
    return dict(sorted(out.items(), key=lambda item: -item[1][1]))


def extra_device_time(ours: dict[str, float], shard: dict[str, float], top: int = 15) -> list[tuple[str, float, float]]:
    """The ops whose own device time in our step most exceeds the shard-only step's: (name, ours ms, shard ms)."""
    rows = [(name, ours.get(name, 0.0), shard.get(name, 0.0)) for name in ours.keys() | shard.keys()]
    rows.sort(key=lambda r: r[2] - r[1])
    print(f"{'op (self device time)':90} {'ours ms':>9} {'shard ms':>9}")
    for name, a, b in rows[:top]:
        print(f"{name[:90]:90} {a:9.2f} {b:9.2f}")
    print(f"{'all ops':90} {sum(ours.values()):9.2f} {sum(shard.values()):9.2f}", flush=True)
    return rows[:top]


def _kind(name: str, cuda: bool) -> str | None:
    """A profiler event's kind of work: a CUDA kernel, or on CPU a host op (None: part of compute)."""
    low = name.lower()
    if cuda and "nccl" not in low:
        return "compute"
    if ("send" in low or "recv" in low) if cuda else name.startswith("_FetchWindow"):
        return "halo"
    if cuda or any(c in low.replace("_", "") for c in ("allreduce", "allgather", "reducescatter", "broadcast")):
        return "collective"
    return None


def _covered(spans: list[tuple[float, float]]) -> float:
    """Length of the union of intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def every_rank(value):
    """``value`` of every rank (under torchrun), in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _completed(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def setup(args) -> tuple[torch.device, bool]:
    """This process's device, and whether its ranks are real (under torchrun) or one rank of a fake group."""
    real = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if real and not dist.is_initialized():
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if real else 0
    device = torch.device(args.device, local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    if args.compile != "none" and not real:
        # One rank's compute: its gradient all-reduce is the fake backend's no-op, so nothing is lost by not
        # splitting the compiled backward at DDP's buckets (on CPU that split met a stride mismatch in a 1x1
        # convolution's backward, torch 2.14; docs/benchmarks.md).
        torch._dynamo.config.optimize_ddp = False
    return device, real


def main() -> None:
    args = parse()
    os.makedirs(args.out, exist_ok=True)  # a missing folder would cost the run its first row
    device, real = setup(args)
    rows, timed = [], {}
    grid = [  # precision outermost: a bf16 failure cannot cost the fp32 rows
        (prec, w, int(s), lay, ck == "1")
        for prec in args.precisions.split(",")
        for w in args.widths.split(",")
        for s in args.spatial.split(",")
        for lay in args.layouts.split(",")
        for ck in args.ckpt.split(",")
    ]
    for precision, width, s, layout, ckpt in grid:
        if (real and dist.get_world_size() % s) or math.prod(tiles(layout, s)) != s:
            continue
        row = run_config(args, device, int(width), s, layout, precision, ckpt, real, timed)
        rows.append(row)
        if not real or dist.get_rank() == 0:  # each row as it comes: a config failing later costs none of these
            print(json.dumps(row), flush=True)
            with open(os.path.join(args.out, "bench.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
    if not real or dist.get_rank() == 0:
        print_table(rows)
    if real:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
