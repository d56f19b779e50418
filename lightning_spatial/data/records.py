"""Packed surround samples: write a dataset once, then read any sample by index (map-style, so Lightning's
DistributedSampler, and the spatial strategy's data-parallel sampler, split it like any other dataset).

Formats (docs/data.md measures them): ``litdata`` (Lightning's binary chunks with an index.json),
``tfrecord`` (one TFRecord file and its ``.tfindex`` of byte offsets) and ``loose`` (one ``.pt`` per sample,
the baseline).

A records folder is whole or absent. Its ``surround.json`` holds the folder's identity: the format,
``SAMPLE_FORMAT`` and the source's ``describe()`` (every setting that changes the samples). ``write_records``
fills a hidden sibling folder, ends it with ``surround.json`` and renames it into place; records of another
identity there are moved aside and deleted. Writers running at once (each node's local rank 0 on a shared
filesystem) write a copy each: the first rename wins, a later copy of the same identity is dropped.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import uuid
from fnmatch import fnmatch
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .batch import check_sample

FORMATS = ("litdata", "tfrecord", "loose")
DEFAULT_FORMAT = "litdata"  # the fastest reader in docs/data.md
META = "surround.json"
# Bump when the samples written for unchanged settings change (batch.py's contract, a reader, the renderer):
# records written before are then rewritten instead of served stale.
SAMPLE_FORMAT = 3  # 3: nuScenes attributes, bike racks as ignore regions, NaN velocities, the gravity-aligned frame
# What the writers put into a records folder: only a folder holding nothing else is ever replaced.
_WRITTEN = (META, "[0-9]*.pt", "chunk-*.bin", "*index.json", "samples.tfrecord", "samples.tfindex")


def records_identity(dataset: Dataset, format: str) -> dict:
    """``surround.json`` of ``dataset`` (which has ``describe()``) written in ``format``, as JSON reads it back."""
    return json.loads(json.dumps({"format": format, "sample_format": SAMPLE_FORMAT, **dataset.describe()}))


def read_identity(root) -> dict | None:
    """The identity of the finished records at ``root``; None when there are none."""
    path = Path(root) / META
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}): delete the folder {root}") from error


def differences(found: dict, asked: dict) -> str:
    """The settings of ``asked`` that ``found`` does not share, as ``name (records: value, asked: value)``."""
    return ", ".join(f"{k} (records: {found.get(k)!r}, asked: {v!r})" for k, v in asked.items() if found.get(k) != v)


def write_records(dataset: Dataset, root, format: str = DEFAULT_FORMAT, num_workers: int = 0) -> Path:
    """Write every sample of ``dataset`` (which has ``describe()``) into ``root`` in ``format``, atomically (see
    the module docstring); ``num_workers`` processes produce the samples (rendering, JPEG decoding) while this one
    writes them in order."""
    if format not in FORMATS:
        raise ValueError(f"unknown records format {format!r}; choose one of {FORMATS}")
    root, identity = Path(root).absolute(), records_identity(dataset, format)
    _check_replaceable(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(root, "writing")
    staging.mkdir()
    try:
        _WRITERS[format](iter(DataLoader(dataset, batch_size=None, num_workers=num_workers)), staging)
        (staging / META).write_text(json.dumps(identity, indent=1))
        _publish(staging, root, identity)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # an interrupted write, or a copy another writer beat
    return root


def _publish(staging: Path, root: Path, identity: dict) -> None:
    """Rename the finished ``staging`` to ``root``, keeping a ``root`` of the same identity (a concurrent
    writer's) and moving any other records aside first."""
    while True:
        try:
            staging.rename(root)  # atomic; replaces nothing but an empty folder
            return
        except OSError as error:
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        if read_identity(root) == identity:
            return
        _check_replaceable(root)
        stale = _sibling(root, "stale")
        try:
            root.rename(stale)
        except FileNotFoundError:
            continue  # another writer moved it first
        shutil.rmtree(stale, ignore_errors=True)


def _check_replaceable(root: Path) -> None:
    if not root.is_dir():
        return
    foreign = [p.name for p in root.iterdir() if not any(fnmatch(p.name, pattern) for pattern in _WRITTEN)]
    if foreign:
        raise FileExistsError(
            f"{root} holds {sorted(foreign)[:3]}, which no records writer wrote: records replace the whole folder, "
            "so give them a folder of their own"
        )


def _sibling(root: Path, purpose: str) -> Path:
    """A fresh hidden name next to ``root`` (same filesystem, so renames between them are atomic)."""
    return root.with_name(f".{root.name}.{purpose}-{uuid.uuid4().hex}")


class PackedSurround(Dataset):
    """Samples from a records folder written by ``write_records``; ``expect`` (a ``describe()`` or
    ``records_identity`` dict) must match what the folder was written for, and so must ``SAMPLE_FORMAT``."""

    def __init__(self, root, expect: dict | None = None):
        self.root = Path(root)
        meta = read_identity(self.root)
        if meta is None:
            raise FileNotFoundError(
                f"no surround records at {self.root} ({META} missing): write them with write_records"
            )
        asked = json.loads(json.dumps({"sample_format": SAMPLE_FORMAT, **(expect or {})}))
        if differ := differences(meta, asked):
            raise ValueError(
                f"records at {self.root} were written for other settings: {differ}; rewrite them (prepare_data, "
                "write_records) or point records_dir elsewhere"
            )
        self.meta = meta
        self._reader, self._pid = None, None

    def describe(self) -> dict:
        return {k: v for k, v in self.meta.items() if k not in ("format", "sample_format")}

    def __len__(self) -> int:
        return self.meta["samples"]

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} records at {self.root}")
        if self._pid != os.getpid():  # readers hold files and caches: one per (worker) process
            self._reader, self._pid = _READERS[self.meta["format"]](self.root), os.getpid()
        sample = self._reader(index)
        size = (self.meta["height"], self.meta["width"])
        return check_sample(sample, f"{self.root} sample {index}", size=size, cameras=len(self.meta["cameras"]))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reader": None, "_pid": None}


def wait_for_records(root, expect: dict, timeout: float, poll: float = 1.0) -> PackedSurround:
    """The records at ``root`` once they match ``expect``, waiting up to ``timeout`` seconds for another process
    (in a multi-process run, each node's local rank 0 in ``prepare_data``) to finish writing them."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return PackedSurround(root, expect)
        except (FileNotFoundError, ValueError) as error:
            if timeout <= 0:
                raise
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{error} (waited {timeout:g} s, the strategy's timeout, for local rank 0's prepare_data to write "
                    "them: see its error, or raise the strategy's timeout for a longer write)"
                ) from error
        time.sleep(min(poll, max(deadline - time.monotonic(), 0.0)))


def _write_loose(samples, root: Path) -> None:
    for i, sample in enumerate(samples):
        torch.save(sample, root / f"{i:08d}.pt")


def _read_loose(root: Path):
    return lambda i: torch.load(root / f"{i:08d}.pt", weights_only=True)


def _write_litdata(samples, root: Path) -> None:
    from litdata.streaming.writer import BinaryWriter
    from litdata.utilities.env import _DistributedEnv

    writer = BinaryWriter(str(root), chunk_bytes="256MB")
    # One process writes the whole folder. Left to detect the torch.distributed world, the writer would wait in
    # merge() for an index from every rank, while Lightning runs prepare_data on local rank 0 only: a hang.
    writer._distributed_env = _DistributedEnv(world_size=1, global_rank=0, num_nodes=1)
    for i, sample in enumerate(samples):
        writer[i] = sample
    writer.done()
    writer.merge()


def _read_litdata(root: Path):
    from litdata import StreamingDataset

    return StreamingDataset(str(root)).__getitem__


def _write_tfrecord(samples, root: Path) -> None:
    from tfrecord.tools.tfrecord2idx import create_index
    from tfrecord.writer import TFRecordWriter

    writer = TFRecordWriter(str(root / "samples.tfrecord"))
    for sample in samples:
        datum = {}
        for key, value in sample.items():
            array = value.numpy()
            datum[key] = (array.tobytes(), "byte")
            datum[f"{key}.shape"] = (list(array.shape), "int")
            datum[f"{key}.dtype"] = (str(array.dtype).encode(), "byte")
        writer.write(datum)
    writer.close()
    create_index(str(root / "samples.tfrecord"), str(root / "samples.tfindex"))


def _read_tfrecord(root: Path):
    from tfrecord import example_pb2

    index = np.loadtxt(root / "samples.tfindex", dtype=np.int64, ndmin=2)
    file = open(root / "samples.tfrecord", "rb")

    def read(i: int) -> dict:
        file.seek(index[i, 0])
        record = file.read(index[i, 1])  # length (8 bytes), its CRC (4), the Example, its CRC (4)
        features = example_pb2.Example.FromString(record[12:-4]).features.feature
        out = {}
        for key in features:
            if key.endswith((".shape", ".dtype")):
                continue
            dtype = np.dtype(features[f"{key}.dtype"].bytes_list.value[0].decode())
            array = np.frombuffer(features[key].bytes_list.value[0], dtype=dtype).copy()
            out[key] = torch.from_numpy(array.reshape(list(features[f"{key}.shape"].int64_list.value)))
        return out

    return read


_WRITERS = {"loose": _write_loose, "litdata": _write_litdata, "tfrecord": _write_tfrecord}
_READERS = {"loose": _read_loose, "litdata": _read_litdata, "tfrecord": _read_tfrecord}

__all__ = [
    "DEFAULT_FORMAT",
    "FORMATS",
    "SAMPLE_FORMAT",
    "PackedSurround",
    "read_identity",
    "records_identity",
    "wait_for_records",
    "write_records",
]
