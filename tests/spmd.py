"""Multi-process test harness: fork N gloo ranks on CPU, run a function on each, report every failure.

``fork`` starts a rank in ~0.1 s where ``spawn`` re-imports torch (~12 s on 2 cores); the parent never
initialises a process group or intra-op threads that a child could inherit. Once the parent has used CUDA (a GPU
test earlier in the same run), ranks are spawned: a forked child cannot touch CUDA, and Lightning's Trainer reads
every CUDA generator's state (``isolate_rng``) even on CPU.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_spatial.primitives import Axis


def run_spmd(fn: Callable, world_size: int, *args, timeout: float = 120.0) -> None:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks; raise with every rank's traceback on failure."""
    ctx = mp.get_context("spawn" if torch.cuda.is_initialized() else "fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        procs = [ctx.Process(target=_worker, args=(r, world_size, init, fn, args, results)) for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            failures = _collect(procs, results, timeout)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    if failures:
        raise AssertionError("\n".join(failures))


def _collect(procs, results, timeout: float) -> list[str]:
    """Every rank's failure; a rank killed by a signal (a crash in a kernel, say SIGFPE) is reported at once
    rather than after the time-out its peers would wait in their next collective."""
    failures, pending, deadline = [], set(range(len(procs))), time.monotonic() + timeout
    while pending:
        try:
            rank, error = results.get(timeout=1.0)
        except queue.Empty:
            dead = {r: procs[r].exitcode for r in pending if procs[r].exitcode not in (None, 0)}
            if dead:
                return failures + [f"rank {r} died: {_exit_reason(code)}" for r, code in dead.items()]
            if time.monotonic() > deadline:
                return failures + [f"timed out after {timeout} s (a rank hung)"]
            continue
        pending.discard(rank)
        if error:
            failures.append(f"rank {rank}:\n{error}")
    return failures


def _exit_reason(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _worker(rank, world_size, init, fn, args, results) -> None:
    error = None
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
        dist.barrier()  # every rank has connected before any can finish and close its connections mid-rendezvous
        fn(*args)
    except BaseException:  # noqa: BLE001 - report everything to the parent
        error = traceback.format_exc()
    finally:
        results.put((rank, error))
        results.close()
        results.join_thread()
        if dist.is_initialized():
            dist.destroy_process_group()
        os._exit(0)


@contextlib.contextmanager
def children_killed_after(timeout: float):
    """Kill the child processes of this process (a Trainer's forked ranks) if the block runs longer than
    ``timeout`` s: a hung rank then fails the test instead of blocking the suite."""
    fired = threading.Event()

    def kill() -> None:
        fired.set()
        for child in mp.active_children():
            child.kill()

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        yield
    except BaseException as error:
        if fired.is_set():
            raise AssertionError(f"killed after {timeout} s (hung)") from error
        raise
    finally:
        timer.cancel()


# Rank layouts used by every op test: name -> (world size, {tensor dim: mesh axis name}).
LAYOUTS = {
    "w2": (2, {-1: "w"}),
    "w3": (3, {-1: "w"}),  # with odd widths: uneven shards
    "h2": (2, {-2: "h"}),
    "2x2": (4, {-2: "h", -1: "w"}),
}


def axes(name: str) -> dict[int, Axis]:
    """Build the process groups of a layout inside a rank: dim -> Axis."""
    _, dims = LAYOUTS[name]
    if len(dims) == 1:
        return {dim: Axis.from_group() for dim in dims}
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("h", "w"))
    return {dim: Axis.from_group(mesh.get_group(axis)) for dim, axis in dims.items()}


def as_torchrun() -> None:
    """Inside a rank: look to Lightning like a process started by torchrun, so a Trainer starts no processes
    of its own and its methods (``predict``, ``validate``) return their results in every rank."""
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(
        TORCHELASTIC_RUN_ID="spmd", RANK=rank, LOCAL_RANK=rank, GROUP_RANK="0", WORLD_SIZE=world, LOCAL_WORLD_SIZE=world
    )
