"""Step time through Lightning's Trainer, as users train: a LightningModule, a DataLoader (with the strategy's
collate hook), any strategy. Compares strategies on the same model and global batch in one place.

    torchrun --nproc-per-node 2 benchmarks/trainer_step.py --strategy ddp --model convnext_large --batch 2
    horovodrun -np 2 -H localhost:2 python benchmarks/trainer_step.py --strategy horovod --model convnext_large \
        --batch 2
    torchrun --nproc-per-node 2 benchmarks/trainer_step.py --strategy spatial_tp --model convnext_large --batch 4
    torchrun --nproc-per-node 2 benchmarks/trainer_step.py --strategy spatial_tp --cuda-graphs backbone ...
    torchrun --nproc-per-node 2 benchmarks/trainer_step.py --strategy spatial_tp --compile ...
    torchrun --nproc-per-node 2 benchmarks/trainer_step.py --strategy spatial_tp --compile backbone \
        --cuda-graphs backbone
    python benchmarks/trainer_step.py --strategy single --model petr --batch 1 --height 512 --width 1408
    python benchmarks/trainer_step.py --strategy spatial_tp --fake-world 8 --baseline shard --model convnext_xlarge \
        --batch 7 --height 512 --width 4096 --precision bf16-mixed      # one GPU: rank 1 of 8, and its shard alone
    python benchmarks/trainer_step.py ... --fake-world 8 --tiles 2x4   # the group as 2 x 4 tiles (rank 1: row 0, col 1)

One GPU plays one rank of a larger run with ``--fake-world S`` (``lightning_spatial.fake_rank.FakeRank``: PyTorch's
fake backend, so the rank runs the real run's kernels on its shard, and no message travels); ``--baseline`` runs, in
the same process and first, the plain model alone through the Trainer (one device, eager, no graphs) on that rank's
shard of the input (``shard``) or on the whole input (``device``), and the row holds both and their ratio.

``--batch`` is per process for data parallel strategies and per spatial group for ``spatial_tp`` (every rank of
a group loads the same samples and keeps its columns). Samples are fixed random images held in memory, so the
loader costs only the copy; the median of the timed steps (forward, backward, optimizer) and rank 0's peak memory are
reported by rank 0. Each timed step runs between two device synchronisations, so a step's host time before its first
kernel counts; ``--timing window`` times the steps back to back instead, as a training run runs them (the host queues
the next step while the device finishes this one), and reports their mean. CPU smoke run: ``--accelerator cpu
--model convnext_atto --height 32 --width 64``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import lightning as L
import tasks
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_spatial  # noqa: F401 - registers "spatial_tp" and "horovod"
from lightning_spatial.primitives import CUDAGraphed


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="single", help="single | ddp | horovod | spatial_tp")
    p.add_argument("--spatial", type=int, default=0, help="spatial_tp group size (default: all processes)")
    p.add_argument(
        "--tiles", default=None, help="spatial_tp: the group as H x W tiles, e.g. 2x4 (default: a width split)"
    )
    p.add_argument(
        "--model",
        default="convnext_large",
        help="a timm classifier, or a BEV detector: petr, lift_splat, simple_bev, bevformer (paper-sized), *_tiny",
    )
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--cameras", type=int, default=6)
    p.add_argument("--height", type=int, default=512)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed")
    p.add_argument(
        "--cuda-graphs",
        default="auto",
        help="spatial_tp: auto (the default), off, or the submodules replayed as CUDA graphs, comma list (backbone)",
    )
    p.add_argument("--bev-shard", default="none", choices=["none", "x", "y", "xy"], help="spatial_tp: bev_shard")
    p.add_argument(
        "--bev-planes",
        default="model",
        choices=["model", "none"],
        help="spatial_tp with --bev-shard: bev_planes, the model's (BEVFormer's learned queries) or none",
    )
    p.add_argument("--bev-size", default=None, help="a BEV detector's grid, X,Y (default: the model's)")
    p.add_argument("--bev-encoder", default=None, help="Lift-Splat / Simple-BEV: resnet18 (default), convs, ...")
    p.add_argument("--fake-world", type=int, default=0, help="one GPU plays one rank of a run of this many ranks")
    p.add_argument("--fake-rank", type=int, default=None, help="the rank it plays (default: 1, an interior one)")
    p.add_argument("--baseline", choices=("none", "shard", "device"), default="none", help="the plain model alone")
    p.add_argument(
        "--compile",
        nargs="?",
        const="module",
        default="",
        help="inductor: 'module' (the flag alone) fits torch.compile(module); a submodule's name (backbone) compiles "
        "that submodule in place, which --cuda-graphs may then capture",
    )
    p.add_argument("--compile-mode", default=None, help="torch.compile's mode (default, max-autotune-no-cudagraphs)")
    p.add_argument(
        "--compile-backend", default="inductor", help="torch.compile's backend (aot_eager: no code generated)"
    )
    p.add_argument("--compression", default="none", help="horovod: none | fp16")
    p.add_argument("--fusion-mb", type=float, default=None, help="horovod: tensor fusion buffer (MiB)")
    p.add_argument("--cycle-ms", type=float, default=None, help="horovod: cycle time (ms)")
    p.add_argument("--groups", type=int, default=None, help="horovod: grouped all-reduce in this many groups")
    p.add_argument("--bucket-mb", type=float, default=None, help="horovod: gradients in buckets of this size (MiB)")
    p.add_argument("--async-completion", action="store_true", help="horovod: GPU ops complete on the stream")
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile the first timed step of local rank 0 or a fake rank, and the baseline's: a table of the ops and "
        "a Chrome trace (.json.gz)",
    )
    p.add_argument(
        "--timing",
        choices=("step", "window"),
        default="step",
        help="step: each timed step between two device synchronisations, the median; window: the timed steps back to "
        "back, synchronised before the first and after the last only, as a training run runs them (the host queues "
        "the next step while the device runs this one), step_ms their mean",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--accelerator", default="gpu")
    p.add_argument("--out", default=".")
    return p.parse_args()


class Fixed(Dataset):
    """One random sample, returned ``length`` times: the loader costs a copy, never generation."""

    def __init__(self, sample: dict, length: int):
        self.sample, self.length = sample, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        return self.sample


def model_and_data(args, length: int):
    g = torch.Generator().manual_seed(0)
    if args.model.removesuffix("_tiny") in tasks.DETECTORS:
        from lightning_spatial.data import collate_surround
        from lightning_spatial.data.geometry import projection
        from lightning_spatial.data.surround import CAMERAS, camera_rig

        intrinsics, cam2ego = camera_rig(CAMERAS[: args.cameras], (args.height, args.width))
        centres = torch.rand(10, 2, generator=g) * 80 - 40
        sample = {
            "images": torch.randint(0, 256, (args.cameras, 3, args.height, args.width), dtype=torch.uint8, generator=g),
            "lidar2img": projection(intrinsics, cam2ego),
            "intrinsics": intrinsics,
            "cam2ego": cam2ego,
            "boxes": torch.cat([centres, torch.tensor([[0.9, 1.9, 4.6, 1.7, 0.3, 2.0, 0.0]]).expand(10, -1)], 1),
            "labels": torch.zeros(10, dtype=torch.long),
        }
        detector = tasks.DetectorTask(args)
        model = detector.make(**detector.options)
        return model, DataLoader(
            Fixed(sample, length), args.batch, collate_fn=collate_surround, num_workers=2, pin_memory=True
        )
    from lightning_spatial.models import ImageTask

    sample = {"image": torch.randn(3, args.height, args.width, generator=g), "label": torch.tensor(1)}
    model = ImageTask(backbone=args.model, task="classification", num_classes=10, lr=1e-4)
    return model, DataLoader(Fixed(sample, length), args.batch, num_workers=2, pin_memory=True)


class StepTimer(L.Callback):
    def __init__(self, warmup: int, profile_to: str | None = None, options: dict | None = None, window: bool = False):
        self.warmup, self.times, self.profiler, self.window = warmup, [], None, window
        self.graphed: dict[str, bool] = {}  # at the last step (the strategy unwraps at its teardown)
        # at the end of the last step, GiB: what the graphs' private pools reserve, and the rest of the device's memory
        # that the caching allocator reserves and of that the live tensors' (where a rank's memory goes)
        self.graph_pools_gib = self.eager_reserved_gib = self.eager_allocated_gib = 0.0
        self.profile_to, self.options = profile_to, options

    def _sync(self, trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        alone = not self.window or batch_idx <= self.warmup  # a step timed on its own (a window's first)
        if alone:
            self._sync(trainer)
        if batch_idx == self.warmup and trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
        if batch_idx == self.warmup and self.profile_to and trainer.local_rank == 0:  # FakeRank plays rank 1
            self.profiler = torch.profiler.profile()  # CPU, and CUDA where there is one
            self.profiler.__enter__()
        if alone:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        last = batch_idx == trainer.max_steps - 1
        if not self.window or batch_idx < self.warmup or last:
            self._sync(trainer)
        if batch_idx >= self.warmup and (not self.window or last):
            steps = batch_idx - self.warmup + 1 if self.window else 1
            self.times.append((time.perf_counter() - self.start) * 1e3 / steps)
        if self.profiler is not None:  # the profiled step is timed too: its row says so ("profile": true)
            self.profiler.__exit__(None, None, None)
            table = self.profiler.key_averages()
            with open(self.profile_to, "w") as f:
                f.write(json.dumps(self.options) + "\n")
                for key in ("self_device_time_total", "self_cpu_time_total"):
                    f.write(f"sorted by {key}\n{table.table(sort_by=key, row_limit=30)}\n")
                f.write("every op, device time (us), calls\n")  # what two runs' tables are compared by
                for e in sorted(table, key=lambda e: -e.self_device_time_total):
                    f.write(json.dumps([e.key, round(e.self_device_time_total, 1), e.count]) + "\n")
            # the timeline, where the device idles (torch gzips a trace whose name ends in .gz)
            self.profiler.export_chrome_trace(self.profile_to.removesuffix(".txt") + "_trace.json.gz")
            self.profiler = None
        # the submodules the strategy wrapped: replaying (True) or eager (False: warming up, or a capture failed)
        self.graphed = {n: m.captured for n, m in pl_module.named_modules() if isinstance(m, CUDAGraphed)}
        if batch_idx == trainer.max_steps - 1 and trainer.strategy.root_device.type == "cuda":
            segments = torch.cuda.memory_snapshot()
            private = [s for s in segments if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)]
            eager = [s for s in segments if tuple(s.get("segment_pool_id", (0, 0))) == (0, 0)]
            self.graph_pools_gib = round(sum(s["total_size"] for s in private) / 2**30, 2)
            self.eager_reserved_gib = round(sum(s["total_size"] for s in eager) / 2**30, 2)
            self.eager_allocated_gib = round(sum(s["allocated_size"] for s in eager) / 2**30, 2)


def strategy(args):
    from lightning_spatial import HorovodStrategy, SpatialParallelStrategy

    if args.strategy == "spatial_tp":
        graphs = {"auto": "auto", "off": False}.get(args.cuda_graphs, args.cuda_graphs.split(","))
        bev_shard = None if args.bev_shard == "none" else args.bev_shard
        planes = tasks.task(args).bev_planes if bev_shard and args.bev_planes == "model" else None
        return SpatialParallelStrategy(
            tiles(args) or args.spatial or args.fake_world or None,
            cuda_graphs=graphs,
            bev_shard=bev_shard,
            bev_planes=planes,
        )
    if args.strategy == "horovod":
        fusion = None if args.fusion_mb is None else int(args.fusion_mb * 2**20)
        return HorovodStrategy(
            compression=args.compression,
            fusion_threshold_bytes=fusion,
            cycle_time_ms=args.cycle_ms,
            groups=args.groups,
            bucket_mb=args.bucket_mb,
            async_completion=args.async_completion,
        )
    return {"single": "auto", "ddp": "ddp"}[args.strategy]


def measure(args, plugins: list) -> dict:
    """One fit through the Trainer: the median timed step, the range, peak memory (allocated, and reserved: graph
    pools included)."""
    devices = (
        1 if args.strategy in ("single", "horovod") or args.fake_world else int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    )
    model, loader = model_and_data(args, (args.warmup + args.steps) * args.batch * 8)
    name = f"profile_{args.strategy}_{args.model}_{args.precision}_{os.getpid()}.txt"  # one per run; options inside
    options = {k: v for k, v in vars(args).items() if k != "out"}
    profile_to = os.path.join(args.out, name) if args.profile else None
    timer = StepTimer(args.warmup, profile_to, options, window=args.timing == "window")
    if args.accelerator == "gpu":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        strategy=strategy(args),
        precision=args.precision,
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        plugins=plugins,
    )
    if args.compile and args.compile != "module":
        model.get_submodule(args.compile).compile(backend=args.compile_backend, mode=args.compile_mode)
    if args.compile == "module":
        model = torch.compile(model, backend=args.compile_backend, mode=args.compile_mode)
    trainer.fit(model, loader)
    device = trainer.strategy.root_device
    cuda = device.type == "cuda"
    dims = getattr(trainer.strategy, "dims", None)
    return {
        "world": trainer.world_size,
        "rank": trainer.global_rank,
        "spatial_tiles": f"{dims.spatial_h}x{dims.spatial_w}" if dims is not None else None,
        "step_ms": statistics.median(timer.times),
        "step_ms_range": [round(min(timer.times), 1), round(max(timer.times), 1)],
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else float("nan"),
        "reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2) if cuda else float("nan"),
        "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],  # 0 when eager
        "cuda_graphed": timer.graphed,
        "graph_pools_gib": timer.graph_pools_gib,  # of reserved_gib
        "eager_reserved_gib": timer.eager_reserved_gib,  # outside the pools, at the last step's end
        "eager_allocated_gib": timer.eager_allocated_gib,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
    }


def baseline(args) -> dict:
    """The plain model alone (one device, eager, no graphs) on this rank's shard of the input or the whole input."""
    from lightning_spatial.primitives import partition

    plain = argparse.Namespace(**{**vars(args), "strategy": "single", "compile": "", "fake_world": 0})
    if args.baseline == "shard":  # the rank's rows and columns
        th, tw = tiles(args) or (1, args.spatial or args.fake_world)
        ih, iw = divmod(rank_played(args), tw)
        (top, bottom), (left, right) = partition(args.height, th)[ih], partition(args.width, tw)[iw]
        plain.height, plain.width = bottom - top, right - left
    return {**measure(plain, []), "input_hw": [plain.height, plain.width]}


def tiles(args) -> tuple[int, int] | None:
    """``--tiles HxW`` as (H, W); None without it."""
    if not args.tiles:
        return None
    h, w = (int(n) for n in args.tiles.split("x"))
    if args.fake_world and h * w != args.fake_world:
        raise SystemExit(f"--tiles {args.tiles} makes {h * w} ranks, --fake-world {args.fake_world}")
    return h, w


def rank_played(args) -> int:
    return min(1, args.fake_world - 1) if args.fake_rank is None else args.fake_rank


def main() -> None:
    args = parse()
    if args.timing == "window" and args.profile:
        raise SystemExit("--profile synchronises the device after the step it profiles: use it with --timing step")
    os.makedirs(args.out, exist_ok=True)
    options = {k: v for k, v in vars(args).items() if k != "out"}
    row = {**options}
    if args.baseline != "none":
        row["baseline_run"] = baseline(args)
    if args.fake_world:
        from lightning_spatial.fake_rank import FakeRank

        with FakeRank(args.fake_world, rank_played(args)) as env:
            row.update(measure(args, [env]))
    else:
        row.update(measure(args, []))
    if args.baseline != "none":
        row["time_vs_baseline"] = round(row["step_ms"] / row["baseline_run"]["step_ms"], 3)
        row["reserved_vs_baseline"] = round(row["reserved_gib"] / row["baseline_run"]["reserved_gib"], 3)
    row.update({"torch": torch.__version__, "threads": torch.get_num_threads()})  # torchrun: OMP_NUM_THREADS=1
    if row["rank"] == 0 or args.fake_world:
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "bench_trainer.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
