"""Packed surround samples: write a dataset once, then read any sample by index (map-style, so Lightning's
DistributedSampler, and the spatial strategy's data-parallel sampler, split it like any other dataset).

Formats (docs/data.md measures them): ``litdata`` (Lightning's binary chunks with an index.json),
``tfrecord`` (one TFRecord file and its ``.tfindex`` of byte offsets) and ``loose`` (one ``.pt`` per sample,
the baseline). Each records folder ends with ``surround.json`` (format, sample count, cameras, size,
temporal), written last, so an interrupted write is not mistaken for a finished one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .batch import check_sample

FORMATS = ("litdata", "tfrecord", "loose")
DEFAULT_FORMAT = "litdata"  # the fastest reader in docs/data.md
META = "surround.json"


def write_records(dataset: Dataset, root, format: str = DEFAULT_FORMAT, num_workers: int = 0) -> Path:
    """Write every sample of ``dataset`` (which has ``describe()``) into ``root`` in ``format``; ``num_workers``
    processes produce the samples (rendering, JPEG decoding) while this one writes them in order."""
    if format not in FORMATS:
        raise ValueError(f"unknown records format {format!r}; choose one of {FORMATS}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / META).unlink(missing_ok=True)
    samples = DataLoader(dataset, batch_size=None, num_workers=num_workers)
    _WRITERS[format](iter(samples), root)
    (root / META).write_text(json.dumps({"format": format, **dataset.describe()}, indent=1))
    return root


class PackedSurround(Dataset):
    """Samples from a records folder written by ``write_records``; ``expect`` (a ``describe()`` dict) must match."""

    def __init__(self, root, expect: dict | None = None):
        self.root = Path(root)
        if not (self.root / META).exists():
            raise FileNotFoundError(
                f"no surround records at {self.root} ({META} missing): write them with write_records"
            )
        self.meta = json.loads((self.root / META).read_text())
        if expect is not None and {k: self.meta.get(k) for k in expect} != expect:
            differ = {k: (self.meta.get(k), v) for k, v in expect.items() if self.meta.get(k) != v}
            raise ValueError(
                f"records at {self.root} do not match the data asked for (field: (records, asked)): {differ}; "
                "delete the folder or point records_dir elsewhere"
            )
        self._reader, self._pid = None, None

    def describe(self) -> dict:
        return {k: v for k, v in self.meta.items() if k != "format"}

    def __len__(self) -> int:
        return self.meta["samples"]

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} records at {self.root}")
        if self._pid != os.getpid():  # readers hold files and caches: one per (worker) process
            self._reader, self._pid = _READERS[self.meta["format"]](self.root), os.getpid()
        sample = self._reader(index)
        size = (self.meta["height"], self.meta["width"])
        return check_sample(sample, f"{self.root} sample {index}", size=size, cameras=self.meta["cameras"])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reader": None, "_pid": None}


def _write_loose(samples, root: Path) -> None:
    for i, sample in enumerate(samples):
        torch.save(sample, root / f"{i:08d}.pt")


def _read_loose(root: Path):
    return lambda i: torch.load(root / f"{i:08d}.pt", weights_only=True)


def _write_litdata(samples, root: Path) -> None:
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(root), chunk_bytes="256MB")
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

__all__ = ["DEFAULT_FORMAT", "FORMATS", "PackedSurround", "write_records"]
