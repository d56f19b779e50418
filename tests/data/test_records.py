"""Packed records: every format round-trips the source samples exactly, reads by index in any order and in
DataLoader workers, splits under DistributedSampler; a folder is written whole (an interrupted or concurrent
write leaves no mix), rewritten for other settings and refused, naming the settings, by a reader asking for
others. Multi-process launchers: test_records_ranks.py."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_spatial.data import (
    CAMERAS,
    NuScenesSurround,
    PackedSurround,
    SurroundScenes,
    SurroundSynthetic,
    collate_surround,
    write_records,
)
from lightning_spatial.data.records import FORMATS, SAMPLE_FORMAT, read_identity, wait_for_records


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
    with pytest.raises(ValueError, match=r"records at .*r were written for other settings: height \(records: 16, "):
        PackedSurround(tmp_path / "r", expect=dict(source.describe(), height=32))
    with pytest.raises(FileNotFoundError, match=r"no surround records at .*missing.*surround.json missing"):
        PackedSurround(tmp_path / "missing")
    (tmp_path / "r" / "surround.json").write_text('{"format": "loose", "samp')
    with pytest.raises(ValueError, match=r"/r/surround.json is not valid JSON \(.*\): delete the folder .*/r$"):
        PackedSurround(tmp_path / "r")


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
    with pytest.raises(ValueError, match=r"width \(records: 44, asked: 88\)"):
        other.setup("fit")


def _scenes(seed: int = 0, samples: int = 3) -> SurroundScenes:
    return SurroundScenes(samples, 8, 22, cameras=1, max_objects=4, seed=seed)


class _FailingScenes(SurroundScenes):
    """Fails at sample 2, as a write does when the disk fills up or the process is interrupted."""

    def __getitem__(self, index: int) -> dict:
        if index == 2:
            raise KeyboardInterrupt
        return super().__getitem__(index)


def _assert_holds(root, scenes: SurroundScenes):
    packed = PackedSurround(root, expect=scenes.describe())
    assert len(packed) == len(scenes)
    for i in range(len(scenes)):
        _assert_same(packed[i], scenes[i])


@pytest.mark.parametrize("earlier", ["finished", "killed after its index"])
@pytest.mark.parametrize("format", FORMATS)
def test_rewriting_a_folder_yields_the_new_samples(tmp_path, format, earlier):
    write_records(_scenes(seed=0), tmp_path / "r", format)
    if earlier != "finished":
        (tmp_path / "r" / "surround.json").unlink()  # what a write killed between its index and surround.json left
    write_records(_scenes(seed=1), tmp_path / "r", format)
    _assert_holds(tmp_path / "r", _scenes(seed=1))
    assert [p.name for p in tmp_path.iterdir()] == ["r"]  # nothing left beside it


@pytest.mark.parametrize("format", FORMATS)
def test_an_interrupted_write_leaves_the_earlier_records_whole_and_nothing_else(tmp_path, format):
    write_records(_scenes(seed=0), tmp_path / "r", format)
    for root in (tmp_path / "r", tmp_path / "new"):
        with pytest.raises(KeyboardInterrupt):
            write_records(_FailingScenes(3, 8, 22, cameras=1, max_objects=4, seed=1), root, format)
    _assert_holds(tmp_path / "r", _scenes(seed=0))
    assert [p.name for p in tmp_path.iterdir()] == ["r"]


def _write_after(barrier, seed: int, root) -> None:
    barrier.wait()
    write_records(_scenes(seed=seed, samples=6), root)


@pytest.mark.parametrize("seeds", [(0, 0), (0, 1)], ids=["same", "different"])
def test_writers_at_once_leave_one_whole_folder(tmp_path, seeds):
    """Each node's local rank 0 writes on a shared filesystem (same settings), or two runs ask for different ones."""
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(seeds))
    writers = [ctx.Process(target=_write_after, args=(barrier, seed, tmp_path / "r")) for seed in seeds]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
        writer.kill()
    assert [writer.exitcode for writer in writers] == [0, 0]
    _assert_holds(tmp_path / "r", _scenes(seed=read_identity(tmp_path / "r")["seed"], samples=6))
    assert [p.name for p in tmp_path.iterdir()] == ["r"]


def test_a_folder_holding_other_files_is_never_replaced(tmp_path, source):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"holds \['notes.txt'\], which no records writer wrote"):
        write_records(source, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


SETTINGS = {  # a change of each setting, starting from SurroundSynthetic(**TINY)
    "seed": 5,
    "distance": (30.0, 48.0),
    "max_objects": 2,
    "classes": ["car", "pedestrian"],
    "cameras": ["CAM_BACK"],
    "temporal": True,
    "format": "tfrecord",
}
TINY = dict(num_samples=2, val_samples=1, height=8, width=22, cameras=1, max_objects=6, distance=(4.0, 10.0))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_records_for_other_settings_are_refused_naming_them_then_rewritten(tmp_path, setting):
    SurroundSynthetic(records_dir=str(tmp_path), **TINY).prepare_data()
    key = "records_format" if setting == "format" else setting
    asked = SurroundSynthetic(records_dir=str(tmp_path), **dict(TINY, **{key: SETTINGS[setting]}))
    with pytest.raises(ValueError, match=rf"/train were written for other settings: {setting} \(records: "):
        asked.setup("fit")
    asked.prepare_data()
    asked.setup("fit")
    direct = SurroundSynthetic(**dict(TINY, **{key: SETTINGS[setting]}))
    direct.setup("fit")
    for packed, rendered in ((asked.train_set, direct.train_set), (asked.val_set, direct.val_set)):
        for i in range(len(rendered)):
            _assert_same(packed[i], rendered[i])
    written = (tmp_path / "train" / "surround.json").stat().st_ino
    asked.prepare_data()  # records of exactly these settings: kept
    assert (tmp_path / "train" / "surround.json").stat().st_ino == written


def test_records_of_an_earlier_sample_format_are_refused_then_rewritten(tmp_path):
    data = SurroundSynthetic(records_dir=str(tmp_path), **TINY)
    data.prepare_data()
    meta = tmp_path / "val" / "surround.json"
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), sample_format=SAMPLE_FORMAT - 1)))
    with pytest.raises(ValueError, match=rf"/val were written for other settings: sample_format \(records: "
                       rf"{SAMPLE_FORMAT - 1}, asked: {SAMPLE_FORMAT}\)"):  # fmt: skip
        data.setup("fit")
    data.prepare_data()
    data.setup("fit")


@pytest.mark.parametrize("setting", ["cameras", "pc_range", "temporal", "root"])
def test_nuscenes_records_are_refused_for_other_settings(tmp_path, setting):
    from tests.data.test_nuscenes import write_nuscenes

    root = write_nuscenes(tmp_path / "nuscenes")
    kwargs = dict(height=8, width=16, cameras=CAMERAS[:2])
    write_records(NuScenesSurround(root, **kwargs), tmp_path / "r", "loose")
    changed = {"cameras": CAMERAS[1:3], "pc_range": (-40.0, -40.0, -5.0, 40.0, 40.0, 3.0), "temporal": True}
    if setting == "root":
        root = write_nuscenes(tmp_path / "copy")
    asked = NuScenesSurround(root, **dict(kwargs, **{k: v for k, v in changed.items() if k == setting}))
    with pytest.raises(ValueError, match=rf"written for other settings: {setting} \(records: "):
        PackedSurround(tmp_path / "r", expect=asked.describe())


def test_waiting_for_records_returns_once_written_or_times_out_naming_them(tmp_path, source):
    writer = threading.Timer(0.3, write_records, (source, tmp_path / "r"))
    writer.start()
    assert len(wait_for_records(tmp_path / "r", source.describe(), timeout=60, poll=0.05)) == len(source)
    writer.join()
    with pytest.raises(TimeoutError, match=r"no surround records at .*never .*waited 0.2 s, the strategy's timeout"):
        wait_for_records(tmp_path / "never", source.describe(), timeout=0.2, poll=0.05)
