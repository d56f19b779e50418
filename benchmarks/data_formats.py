"""Samples/s of the surround data sources on this machine (the figures of docs/data.md):

    python benchmarks/data_formats.py --sizes 256x704 32x88 --samples 60 --dir /tmp/surround-bench

- render: synthetic samples/s per size, one process (``--threads`` torch threads), current frame and temporal;
- collate: ``collate_surround`` (uint8 -> normalised float32) samples/s at the first size;
- records: the first size's samples written in every format, then read by index in a random order, warm
  (files in the page cache) and cold (their pages dropped first with posix_fadvise, this process's files only),
  every tensor copied once so that lazily mapped readers pay for their reads; then the same by ``--ranks``
  processes at once, each reading its DistributedSampler share with its own reader, as data-parallel ranks do
  (all samples over the time from the first start to the last finish).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from lightning_spatial.data import PackedSurround, SurroundScenes, collate_surround, write_records
from lightning_spatial.data.records import FORMATS


class _Listed(torch.utils.data.Dataset):
    """Pre-rendered samples, so that writing times the format and not the renderer."""

    def __init__(self, samples: list[dict], describe: dict):
        self.samples, self._describe = samples, describe

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]

    def describe(self) -> dict:
        return self._describe


def _rate(count: int, fn) -> float:
    start = time.perf_counter()
    fn()
    return count / (time.perf_counter() - start)


def _read_all(packed: PackedSurround, order: list[int]) -> None:
    """Read and copy every tensor: a reader may hand out views of memory-mapped files it has not read yet."""
    for i in order:
        [value.clone() for value in packed[i].values()]


def _read_ranks(root: Path, ranks: int) -> float:
    """Samples/s of ``ranks`` forked processes reading their shares of the records at ``root`` at once."""
    ctx = mp.get_context("fork")
    start, times = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=_read_share, args=(root, rank, ranks, start, times)) for rank in range(ranks)]
    for proc in procs:
        proc.start()
    spans = [times.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    return len(PackedSurround(root)) / (max(end for _, end in spans) - min(begin for begin, _ in spans))


def _read_share(root: Path, rank: int, ranks: int, start, times) -> None:
    packed = PackedSurround(root)
    order = list(DistributedSampler(packed, num_replicas=ranks, rank=rank, shuffle=True))
    start.wait()
    begin = time.perf_counter()
    _read_all(packed, order)
    times.put((begin, time.perf_counter()))


def _drop_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["256x704", "32x88"])
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=2, help="processes reading at once in the last columns")
    parser.add_argument("--dir", default="/tmp/surround-bench")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    x = torch.rand(6 * 3 * 256 * 704)
    op_ms = 1e3 / _rate(10, lambda: [x * 2 for _ in range(10)])
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, torch threads {args.threads}, "
          f"one multiply over 6x3x256x704 floats {op_ms:.1f} ms")  # fmt: skip
    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes]
    for height, width in sizes:
        for temporal in (False, True):
            scenes = SurroundScenes(args.samples, height, width, temporal=temporal)
            scenes[0]
            rate = _rate(args.samples, lambda: [scenes[i] for i in range(args.samples)])
            print(f"render {height}x{width} temporal={temporal}: {rate:.1f} samples/s")
    scenes = SurroundScenes(args.samples, *sizes[0])
    samples = [scenes[i] for i in range(args.samples)]
    batches = [samples[i : i + 2] for i in range(0, len(samples) - 1, 2)]
    print(
        f"collate {sizes[0]}: {_rate(2 * len(batches), lambda: [collate_surround(b) for b in batches]):.1f} samples/s"
    )
    source, order = _Listed(samples, scenes.describe()), torch.randperm(args.samples).tolist()
    megabytes = sum(s["images"].numel() for s in samples) / args.samples / 1e6
    for format in FORMATS:
        root = Path(args.dir) / format
        shutil.rmtree(root, ignore_errors=True)
        write = _rate(args.samples, lambda: write_records(source, root, format))
        packed = PackedSurround(root)
        warm = _rate(args.samples, lambda: _read_all(packed, order))
        _drop_cache(root)
        packed = PackedSurround(root)  # a fresh reader: nothing of the warm pass in this process's memory
        cold = _rate(args.samples, lambda: _read_all(packed, order))
        ranks_warm = _read_ranks(root, args.ranks)
        _drop_cache(root)
        ranks_cold = _read_ranks(root, args.ranks)
        print(f"records {format}: write {write:.1f}, read warm {warm:.1f}, read cold {cold:.1f}, "
              f"{args.ranks} ranks warm {ranks_warm:.1f}, {args.ranks} ranks cold {ranks_cold:.1f} samples/s "
              f"({megabytes:.1f} MB of images per sample)")  # fmt: skip
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
