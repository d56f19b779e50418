"""ImageFolderData: images at any resolution, masks with the same stems, labels from subfolders, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_spatial.data import ImageFolderData

MEAN, STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])


def _write(folder, name: str, h: int, w: int, seed: int, classes: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rgb, mask = rng.integers(0, 256, (h, w, 3), dtype=np.uint8), rng.integers(0, classes, (h, w), dtype=np.uint8)
    for sub in ("images", "masks"):
        (folder / sub / name).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rgb).save(folder / "images" / f"{name}.png")
    Image.fromarray(mask).save(folder / "masks" / f"{name}.png")
    return rgb, mask


def _all(data: ImageFolderData) -> list[dict]:
    return [*data._split(True), *data._split(False)]


def test_full_resolution_images_and_masks(tmp_path):
    written = {"a": _write(tmp_path, "a", 20, 30, 0), "b": _write(tmp_path, "b", 17, 41, 1)}
    data = ImageFolderData(str(tmp_path / "images"), masks=str(tmp_path / "masks"), val_fraction=0.5)
    assert len(data._split(True)) == 1 and len(data._split(False)) == 1
    for sample in _all(data):
        h, w = sample["mask"].shape
        rgb, mask = next(v for v in written.values() if v[1].shape == (h, w))
        expected = ((rgb / 255 - MEAN) / STD).transpose(2, 0, 1)
        torch.testing.assert_close(sample["image"], torch.tensor(expected, dtype=torch.float32))
        assert torch.equal(sample["mask"], torch.tensor(mask, dtype=torch.int64)) and "label" not in sample


def test_resize_and_labels_from_subfolders(tmp_path):
    for k, cls in enumerate(["dog", "cat", "cat"]):
        _write(tmp_path, f"{cls}/{k}", 12 + k, 20, k)
    data = ImageFolderData(str(tmp_path / "images"), size=[8, 16], batch_size=2, val_fraction=0)
    assert data.classes == ["cat", "dog"]
    samples = list(data._split(True))
    assert sorted(int(s["label"]) for s in samples) == [0, 0, 1]
    assert all(s["image"].shape == (3, 8, 16) for s in samples)
    batch = next(iter(data.train_dataloader()))
    assert batch["image"].shape == (2, 3, 8, 16) and batch["label"].shape == (2,)


def test_resized_masks_keep_class_indices(tmp_path):
    """Nearest-neighbour at half size reads every second pixel: no blended (invented) classes."""
    _, mask = _write(tmp_path, "a", 32, 48, 0, classes=5)
    data = ImageFolderData(str(tmp_path / "images"), masks=str(tmp_path / "masks"), size=[16, 24], val_fraction=0)
    (sample,) = data._split(True)
    assert torch.equal(sample["mask"], torch.tensor(mask[::2, ::2], dtype=torch.int64))


@pytest.mark.parametrize(
    "case, match",
    [
        ("no root", "root '.*missing' is not a folder of images"),
        ("empty", "holds no images"),
        ("no mask", r"no mask for image .*b.png: expected .*masks/b.png"),
        ("sizes", r"images differ in size \(.*\).*batch_size=1 \(got 2\); or set size=\[H, W\]"),
        ("mixed", "mixes images and class subfolders"),
        ("fraction", r"val_fraction must be in \[0, 1\), got 1.5"),
    ],
)
def test_bad_folders_say_what_to_change(tmp_path, case, match):
    _write(tmp_path, "a", 10, 12, 0)
    _write(tmp_path, "b", 11, 12, 1)
    images, kwargs = tmp_path / "images", {}
    if case == "no root":
        images = tmp_path / "missing"
    elif case == "empty":
        images = tmp_path / "masks2"
        images.mkdir()
    elif case == "no mask":
        (tmp_path / "masks" / "b.png").unlink()
        kwargs["masks"] = str(tmp_path / "masks")
    elif case == "sizes":
        kwargs["batch_size"] = 2
    elif case == "mixed":
        _write(tmp_path, "cls/c", 10, 12, 2)
    else:
        kwargs["val_fraction"] = 1.5
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        ImageFolderData(str(images), **kwargs)


def test_a_mask_of_another_size_names_both_files(tmp_path):
    _write(tmp_path, "a", 10, 12, 0)
    Image.fromarray(np.zeros((10, 13), np.uint8)).save(tmp_path / "masks" / "a.png")
    data = ImageFolderData(str(tmp_path / "images"), masks=str(tmp_path / "masks"), val_fraction=0)
    with pytest.raises(ValueError, match=r"mask .*a.png has shape \(10, 13\).*images/a.png, shape \(10, 12\)"):
        data._split(True)[0]
