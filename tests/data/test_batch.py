"""The sample/batch contract: collate layout and normalisation, and the checks every source runs."""

from __future__ import annotations

import pytest
import torch

from lightning_spatial.data import check_sample, collate_surround


def _sample(boxes: int = 2, cameras: int = 3, size=(4, 6), seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "images": torch.randint(0, 256, (cameras, 3, *size), dtype=torch.uint8, generator=g),
        "lidar2img": torch.randn(cameras, 4, 4, generator=g),
        "intrinsics": torch.randn(cameras, 3, 3, generator=g),
        "cam2ego": torch.randn(cameras, 4, 4, generator=g),
        "boxes": torch.randn(boxes, 9, generator=g),
        "labels": torch.randint(0, 10, (boxes,), generator=g),
    }


def test_collate_stacks_cameras_normalises_images_and_keeps_box_lists():
    samples = [_sample(2, seed=0), _sample(0, seed=1)]
    batch = collate_surround(samples)
    assert batch["images"].dtype == torch.float32 and batch["images"].shape == (2, 3, 3, 4, 6)
    pixel = samples[1]["images"][2, 1, 3, 5].item() / 255  # green channel: ImageNet mean 0.456, std 0.224
    assert batch["images"][1, 2, 1, 3, 5].item() == pytest.approx((pixel - 0.456) / 0.224, rel=1e-6)
    assert torch.equal(batch["lidar2img"][1], samples[1]["lidar2img"])
    assert [b.shape for b in batch["boxes"]] == [(2, 9), (0, 9)] and [len(x) for x in batch["labels"]] == [2, 0]


def test_collate_names_mismatched_camera_counts():
    with pytest.raises(ValueError, match=r"disagree on images.*\(2, 3, 4, 6\).*\(3, 3, 4, 6\)"):
        collate_surround([_sample(cameras=3), _sample(cameras=2)])


def test_check_names_a_nan_box_field():
    sample = _sample(3)
    sample["boxes"][1, 7] = float("nan")
    with pytest.raises(ValueError, match=r"here: boxes row 1 has a non-finite vx"):
        check_sample(sample, "here")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cameras": 6}, r"images hold 3 cameras but the calibration has 6"),
        ({"size": (8, 6)}, r"images are \(4, 6\) \(H, W\) but the calibration is for \(8, 6\)"),
    ],
)
def test_check_names_camera_count_and_size_mismatch(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_sample(_sample(), "here", **kwargs)


def test_check_names_a_camera_tensor_of_the_wrong_count():
    sample = _sample()
    sample["lidar2img"] = sample["lidar2img"][:2]
    with pytest.raises(ValueError, match=r"lidar2img is \(2, 4, 4\), expected \(3, 4, 4\) for 3 cameras"):
        check_sample(sample, "here")


def test_check_accepts_an_empty_scene():
    sample = _sample(0)
    assert check_sample(sample, "here", size=(4, 6), cameras=3) is sample
