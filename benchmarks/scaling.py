"""Strong scaling on one machine in one call: ConvNeXt-XL and PETR on N GPUs against one GPU, same global batch.

    python benchmarks/scaling.py --out results    # all visible GPUs; rows, logs and topology under results/
    python benchmarks/scaling.py --gpus 4 --time-limit 560
    python benchmarks/scaling.py --device cpu --gpus 8 --toy   # rehearsal: gloo, convnext_atto, petr_tiny, tiny images

Each part is a subprocess running ``benchmarks/spatial_step.py``; with ``--time-limit`` a part that would overrun
what is left of it is stopped, and the table shows what ran:

1. ``nvidia-smi topo -m`` -> ``topology.txt`` (and into ``scaling.json`` with the rows).
2. One-GPU baselines, fp32 on the first GPU and bf16 on the second at the same time: ConvNeXt-XL, batch 7 at
   3x512x4096, the whole image on one GPU (fp32 needs 131 GiB of the H200's 140).
3. torchrun over the N GPUs: ConvNeXt-XL S = N along the width and in tiles (2x2 / 2x4), and D = 2 data replicas
   x S = N/2 (width and tiles), fp32 then bf16, each with ``--profile``: where one step's time goes on every rank.
4. torchrun: PETR (ConvNeXt-B, 900 queries), batch 1 of 6 cameras at 3x512x1408, S = 8, 4, 2 where S divides N
   (D = N/S), fp32 then bf16; 5. the same for the tiny PETR.

**Efficiency** = T1 / (N x TN) for the same global batch, TN the step of N = D x S ranks. A spatial group trains
on b samples (7 ConvNeXt images, 1 PETR sample), so the global batch is D x b; D x b does not fit one GPU (fp32
b = 7 already needs 131 GiB), so T1 = D x t1(b), the one-GPU step of one group's batch, and the efficiency reduces
to t1(b) / (S x TN). ConvNeXt's t1(b) comes from part 2; PETR's from its row: rank 0 times the whole input on one
device in the same process before and after the spatial step (the faster of the two). **Memory**: the largest
per-rank peak over the ranks, against the shard alone on one GPU (ConvNeXt; target 1.10 x) or against the whole
input on one device (PETR).

**Time** (estimated for 8 H200s from the one-H200 rows of docs/benchmarks.md; 4 GPUs run fewer, slower configs
and land about the same): process start and model builds ~4 s per build (350 M parameters initialised on the
host), 3 builds per config (baseline, ours, baseline again); torchrun start ~20 s per part.
  baselines (parallel)   fp32 1 warm-up + 2 steps x 3.0 s + cuDNN autotuning                    ~40 s
  ConvNeXt, 8 configs    per config 12 s builds + 10 baseline steps + 7 ours + 1 profiled step:
                         S=8 fp32 ~25 s, D=2 x S=4 fp32 ~30 s, bf16 ~20 s; + start              ~220 s
  PETR, 6 configs        one device 0.38 / 0.17 s x 10 + ours x 7 + builds, ~12 s each + start    ~90 s
  PETR tiny, 6 configs   ~6 s each + start                                                     ~55 s
  total ~410 s.
Timed steps: warm-up 2 + 3 steps (median) for the torchrun rows as in docs/benchmarks.md; 1 + 2 for the 3 s
one-GPU ConvNeXt steps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from spatial_step import tiles

ROOT = Path(__file__).resolve().parents[1]
BENCH = str(ROOT / "benchmarks" / "spatial_step.py")
CONVNEXT = (  # benchmark arguments at full size, at toy size
    "--model convnext_xlarge --batch 7 --height 512 --widths 4096",
    "--model convnext_atto --batch 2 --height 64 --widths 256",
)
PETR = "--batch 1 --cameras 6 --height 512 --widths 1408"
PARTS = [  # (part, full size, toy size; None: not rehearsed)
    ("convnext", *CONVNEXT),
    ("petr", f"--model petr {PETR}", None),
    ("petr_tiny", f"--model petr_tiny {PETR}", "--model petr_tiny --batch 1 --cameras 2 --height 64 --widths 352"),
]
BASELINE_STEPS, STEPS = ("--steps 2 --warmup 1", "--steps 3 --warmup 2")
TOY_STEPS = "--steps 1 --warmup 1"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=0, help="ranks N (default: every visible GPU; cpu: 4)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--toy", action="store_true", help="rehearsal sizes: convnext_atto, petr_tiny, tiny images")
    p.add_argument("--time-limit", type=float, default=math.inf, help="seconds for the whole run (default: none)")
    p.add_argument(
        "--parts",
        default=",".join(name for name, *_ in PARTS),
        help="comma list of the grid's parts (convnext brings its one-GPU baselines); all by default",
    )
    p.add_argument("--precisions", default="fp32,bf16", help="comma list: fp32, bf16 (the baselines follow)")
    p.add_argument("--out", default=".")
    return p.parse_args()


def visible_gpus() -> list[str]:
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU")]


class Runner:
    """Subprocesses under one deadline, each logged to ``out/<name>/log.txt`` with its rows in ``bench.jsonl``."""

    def __init__(self, out: Path, time_limit: float):
        self.out, self.deadline, self.parts = out, time.monotonic() + time_limit, []
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.env = {**env, "PYTHONUNBUFFERED": "1"}

    def start(self, name: str, cmd: list[str], **env: str) -> tuple[str, subprocess.Popen, float]:
        (self.out / name).mkdir(parents=True, exist_ok=True)
        cmd = [*cmd, "--out", str(self.out / name)]
        print(f"[{name}] {' '.join(cmd)}", flush=True)
        with open(self.out / name / "log.txt", "w") as log:  # the child keeps its own descriptor
            env = {**self.env, **env}
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return name, proc, time.monotonic()

    def finish(self, *started: tuple[str, subprocess.Popen, float]) -> None:
        for name, proc, t0 in started:
            try:
                rc = proc.wait(timeout=None if math.isinf(self.left()) else max(1.0, self.left()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)  # the part's own process group: torchrun and its workers
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                rc = "stopped: time limit"
            self.parts.append({"part": name, "rc": rc, "seconds": round(time.monotonic() - t0, 1)})
            print(f"[{name}] rc {rc}, {self.parts[-1]['seconds']} s", flush=True)
            if rc != 0:
                print("".join((self.out / name / "log.txt").read_text().splitlines(True)[-15:]), flush=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()


def context(args, n: int) -> dict:
    import timm
    import torch

    def sh(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60).stdout.strip()
        except OSError:
            return ""

    gpu = args.device == "cuda"
    query = "--query-gpu=index,name,memory.total,driver_version"
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ranks": n,
        "device": sh("nvidia-smi", query, "--format=csv,noheader").splitlines() if gpu else f"cpu x {os.cpu_count()}",
        "topology": sh("nvidia-smi", "topo", "-m") if gpu else "cpu rehearsal (gloo): no GPU topology",
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None,
            "timm": timm.__version__,
            "commit": sh("git", "rev-parse", "--short", "HEAD") or None,
        },
    }


def run_parts(args, n: int, runner: Runner) -> None:
    cpu = ["--device", "cpu"] if args.device == "cpu" else []
    steps = TOY_STEPS if args.toy else STEPS
    one = [sys.executable, BENCH, *cpu, "--spatial", "1", "--baseline", "only"]
    one += [*CONVNEXT[1 if args.toy else 0].split(), *(TOY_STEPS if args.toy else BASELINE_STEPS).split()]
    # one GPU each, at the same time; on CPU one thread each, as torchrun gives each rank
    places = [{"CUDA_VISIBLE_DEVICES": g} for g in visible_gpus()[:2]] if not cpu else [{"OMP_NUM_THREADS": "1"}] * 2
    wanted, precisions = args.parts.split(","), args.precisions.split(",")
    if "convnext" in wanted:
        runner.finish(
            *[runner.start(f"one_gpu_{p}", [*one, "--precisions", p], **env) for p, env in zip(precisions, places)]
        )
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), BENCH, *cpu]
    halves = (n, n // 2)  # D = 1 x S = N and D = 2 x S = N/2
    tile_shapes = [f"{h}x{w}" for h, w in (tiles("tiles", s) for s in halves) if h > 1]
    for name, full, toy in PARTS:
        size = toy if args.toy else full
        if name not in wanted or size is None:
            continue
        if runner.left() < 10:
            runner.parts.append({"part": name, "rc": "skipped: time limit", "seconds": 0.0})
            print(f"[{name}] skipped: time limit", flush=True)
            continue
        if name == "convnext":
            grid = ["--spatial", ",".join(map(str, halves)), "--layouts", ",".join(["width", *tile_shapes])]
        else:
            grid = ["--spatial", ",".join(str(s) for s in (8, 4, 2) if s <= n and n % s == 0), "--layouts", "width"]
        cmd = [*launch, *size.split(), *steps.split(), *grid, "--precisions", args.precisions, "--profile"]
        runner.finish(runner.start(name, cmd))


def rows_with_efficiency(out: Path, parts: list[dict]) -> list[dict]:
    rows = []
    for part in parts:
        path = out / part["part"] / "bench.jsonl"
        if path.exists():
            rows += [{"part": part["part"], **json.loads(line)} for line in path.read_text().splitlines()]
    key = ("model", "batch", "height", "width", "precision")
    one_gpu = {tuple(r[k] for k in key): r["shard_ms"] for r in rows if r["part"].startswith("one_gpu")}
    for r in rows:
        if r["part"].startswith("one_gpu"):
            r.update(ranks=1, t1_ms=r["shard_ms"], t1_from="this row", efficiency=1.0, ours_ms=r["shard_ms"])
            continue
        r["ranks"] = r["data"] * r["spatial"]
        if r["baseline"] == "one device":
            r["t1_ms"], r["t1_from"] = min(r["shard_ms"], r.get("shard_ms_after", math.inf)), "rank 0, same process"
        else:
            r["t1_ms"], r["t1_from"] = one_gpu.get(tuple(r[k] for k in key), math.nan), "one-GPU part, same call"
        r["efficiency"] = r["t1_ms"] / (r["spatial"] * r["ours_ms"])
        if r.get("profile"):  # mean over the ranks, of the times (``copies`` is a table)
            times = [k for k, v in r["profile"][0].items() if isinstance(v, float | int)]
            r["profile_mean_ms"] = {k: statistics.fmean(p[k] for p in r["profile"]) for k in times}
    return rows


COLUMNS = [  # title, width, digits
    ("T1 ms", 8, 1),
    ("TN ms", 8, 1),
    ("eff", 6, 3),
    ("GiB/rank", 8, 2),
    ("base GiB", 8, 2),
    ("mem x", 6, 3),
    ("halo MiB", 8, 1),
    ("halo ms", 8, 1),
    ("coll ms", 8, 1),
    ("idle ms", 8, 1),
]


def print_table(rows: list[dict]) -> None:
    head = f"{'model, input':42} {'prec':5} {'D x S':6} {'tiles':5} " + " ".join(f"{t:>{w}}" for t, w, _ in COLUMNS)
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        cams = f"x{r['cameras']}" if r.get("cameras") else ""
        name = f"{r['model']} {r['batch']}{cams}x3x{r['height']}x{r['width']}"
        grid = "1 GPU" if r["ranks"] == 1 else f"{r['data']}x{r['spatial']}"
        prof = r.get("profile_mean_ms", {})
        cells = [r["t1_ms"], r["ours_ms"], r["efficiency"], r.get("ours_gib", r.get("shard_gib")), r.get("shard_gib")]
        cells += [r.get("mem_ratio"), r.get("halo_mib_per_step")]
        cells += [prof.get("halo_exposed"), prof.get("collective_exposed"), prof.get("idle")]
        text = " ".join("-".rjust(w) if v is None else f"{v:{w}.{d}f}" for v, (_, w, d) in zip(cells, COLUMNS))
        print(f"{name:42} {r['precision']:5} {grid:6} {r['tiles']:5} {text}")
    print(
        "T1: one GPU, one group's batch; eff = T1 / (S x TN); GiB/rank: the largest rank; base GiB: the shard alone "
        "(ConvNeXt) or the whole input on one device (PETR); halo / coll / idle ms: exposed halo, exposed collectives "
        "and device idle of one profiled step, mean over the ranks"
    )


def targets(rows: list[dict], n: int) -> list[str]:
    """The scaling targets (efficiency >= 0.90, memory <= 1.10 x the shard) on the ConvNeXt rows that use every
    rank for one image (D = 1, S = N)."""

    def verdict(value: float, ok: bool) -> str:
        return "not measured" if math.isnan(value) else "holds" if ok else "missed"

    out = []
    for r in rows:
        if r["model"].startswith("convnext") and r["ranks"] == n and r["data"] == 1:
            eff, mem = r["efficiency"], r.get("mem_ratio", math.nan)
            here = "" if n == 8 else f"; here {n}"
            out.append(
                f"{r['precision']} {r['tiles']}: efficiency {eff:.3f} ({verdict(eff, eff >= 0.9)}: >= 0.90 at 8 GPUs"
                f"{here}), memory {mem:.3f} x the shard ({verdict(mem, mem <= 1.1)}: <= 1.10)"
            )
    return out


def main() -> None:
    args = parse()
    runner = Runner(Path(args.out), args.time_limit)
    if args.device == "cuda" and shutil.which("nvidia-smi") is None:
        raise SystemExit("no nvidia-smi here: for the CPU rehearsal pass --device cpu --toy")
    visible = len(visible_gpus()) if args.device == "cuda" else math.inf
    n = args.gpus or (visible if args.device == "cuda" else 4)
    if not 2 <= n <= visible:
        raise SystemExit(f"{n} ranks: the grid needs at least 2 and at most the visible GPUs ({visible})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = context(args, n)
    (out / "topology.txt").write_text(ctx["topology"] + "\n")
    print(ctx["topology"], flush=True)
    run_parts(args, n, runner)
    rows = rows_with_efficiency(out, runner.parts)
    lines = targets(rows, n)
    (out / "scaling.json").write_text(
        json.dumps({"context": ctx, "parts": runner.parts, "targets": lines, "rows": rows}, indent=1) + "\n"
    )
    print_table(rows)
    print("\n".join(["", *lines]) if lines else "\nno ConvNeXt row at D = 1, S = N: targets not measured")


if __name__ == "__main__":
    main()
