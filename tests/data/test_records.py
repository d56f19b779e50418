"""Packed records: every format round-trips the source samples exactly, reads by index in any order and in
DataLoader workers, splits under DistributedSampler, and refuses records written for other sizes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_spatial.data import PackedSurround, SurroundScenes, SurroundSynthetic, collate_surround, write_records
from lightning_spatial.data.records import FORMATS


class _Listed(Dataset):
    def __init__(self, samples, describe):
        self.samples, self._describe = samples, describe

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]

    def describe(self):
        return self._describe


@pytest.fixture(scope="module")
def source():
    scenes = SurroundScenes(5, 16, 44, cameras=3, temporal=True, max_objects=8)
    samples = [scenes[i] for i in range(4)]
    empty = dict(scenes[4], boxes=torch.zeros(0, 9), labels=torch.zeros(0, dtype=torch.int64))
    return _Listed([*samples, empty], scenes.describe())


def _assert_same(got: dict, want: dict):
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@pytest.mark.parametrize("format", FORMATS)
def test_round_trip_equals_the_source_in_any_order(tmp_path, source, format):
    packed = PackedSurround(write_records(source, tmp_path, format), expect=source.describe())
    assert len(packed) == 5 and packed.meta["format"] == format
    for i in (3, 0, 4, 1, 2):
        _assert_same(packed[i], source[i])


@pytest.mark.parametrize("format", ["litdata", "tfrecord"])
def test_distributed_sampler_splits_records_read_in_workers(tmp_path, source, format):
    packed = PackedSurround(write_records(source, tmp_path, format))
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(packed, num_replicas=2, rank=rank, shuffle=True, seed=3)
        loader = DataLoader(packed, batch_size=3, sampler=sampler, num_workers=1, collate_fn=collate_surround)
        (batch,) = list(loader)
        indices = list(sampler)
        seen += indices
        torch.testing.assert_close(batch, collate_surround([source[i] for i in indices]), rtol=0, atol=0)
    assert len(seen) == 6 and set(seen) == set(range(5))  # two ranks of 3 cover all 5 (one padded repeat)


def test_records_for_another_size_or_none_raise(tmp_path, source):
    write_records(source, tmp_path / "r", "loose")
    with pytest.raises(ValueError, match=r"records at .*r do not match .*'height': \(16, 32\)"):
        PackedSurround(tmp_path / "r", expect=dict(source.describe(), height=32))
    with pytest.raises(FileNotFoundError, match=r"no surround records at .*missing.*surround.json missing"):
        PackedSurround(tmp_path / "missing")


def test_datamodule_packs_once_and_trains_from_records(tmp_path):
    kwargs = dict(num_samples=3, val_samples=2, height=16, width=44, cameras=2, batch_size=2, max_objects=4)
    data = SurroundSynthetic(records_dir=str(tmp_path), num_workers=1, **kwargs)  # a worker renders for the writer
    data.prepare_data()
    data.setup("fit")
    assert isinstance(data.train_set, PackedSurround) and (tmp_path / "val" / "surround.json").exists()
    direct = SurroundSynthetic(**kwargs)
    direct.setup("fit")
    torch.testing.assert_close(next(iter(data.val_dataloader())), next(iter(direct.val_dataloader())), rtol=0, atol=0)
    other = SurroundSynthetic(records_dir=str(tmp_path), **dict(kwargs, width=88))
    with pytest.raises(ValueError, match=r"'width': \(44, 88\)"):
        other.setup("fit")
