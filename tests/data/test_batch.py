"""The sample/batch contract: collate layout and normalisation, and the checks every source runs."""

from __future__ import annotations

import pytest
import torch

from lightning_spatial.data import ATTRIBUTES, check_sample, collate_surround


def _sample(boxes: int = 2, cameras: int = 3, size=(4, 6), seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "images": torch.randint(0, 256, (cameras, 3, *size), dtype=torch.uint8, generator=g),
        "lidar2img": torch.randn(cameras, 4, 4, generator=g),
        "intrinsics": torch.randn(cameras, 3, 3, generator=g),
        "cam2ego": torch.randn(cameras, 4, 4, generator=g),
        "boxes": torch.randn(boxes, 9, generator=g).index_add(1, torch.arange(3, 6), torch.full((boxes, 3), 3.0)),
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


def test_check_accepts_unknown_velocities():
    sample = _sample(3)
    sample["boxes"][1, 7:] = float("nan")  # the devkit's velocity of a lone annotation
    sample["boxes"][2, 8] = float("nan")
    assert check_sample(sample, "here") is sample


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "row, field, value, message",
    [
        (1, 2, NAN, r"here: boxes row 1 has z = nan: only vx, vy may be NaN \(unknown\); repair or drop that box"),
        (2, 8, INF, r"here: boxes row 2 has vy = inf: only vx, vy may be NaN"),
        (0, 7, -INF, r"here: boxes row 0 has vx = -inf"),
        (0, 3, 0.0, r"here: boxes row 0 has w = 0.0: sizes w, l, h must be > 0 \(metres\)"),
        (2, 5, -1.5, r"here: boxes row 2 has h = -1.5: sizes w, l, h must be > 0"),
    ],
)
def test_check_names_the_sample_row_and_field_of_a_bad_box(row, field, value, message):
    sample = _sample(3)
    sample["boxes"][row, field] = value
    with pytest.raises(ValueError, match=message):
        check_sample(sample, "here")


def _with_metric_fields(sample: dict, regions: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    sample["attributes"] = torch.randint(-1, len(ATTRIBUTES), (len(sample["labels"]),), generator=g)
    sample["ignore_regions"] = torch.randn(regions, 7, generator=g)
    return sample


def test_collate_keeps_attributes_and_ignore_regions_as_lists():
    samples = [_with_metric_fields(_sample(2, seed=0), 1, 0), _with_metric_fields(_sample(3, seed=1), 0, 1)]
    batch = collate_surround(samples)
    for key in ("attributes", "ignore_regions"):
        assert len(batch[key]) == 2 and all(torch.equal(b, s[key]) for b, s in zip(batch[key], samples))
    assert "attributes" not in collate_surround([_sample(2)])  # an optional field stays absent


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("attributes", torch.tensor([0, 1, 2]), r"attributes must be int64 \(2,\) to match the boxes, got .* \(3,\)"),
        ("attributes", torch.tensor([0.0, 1.0]), r"attributes must be int64 \(2,\) .* got torch.float32"),
        ("attributes", torch.tensor([3, 8]), r"attributes must lie in \[-1, 8\) \(-1: none\), got \[3, 8\]"),
        ("ignore_regions", torch.zeros(2, 9), r"ignore_regions must be float \(k, 7\) \(.x., .*\), got .*\(2, 9\)"),
        ("ignore_regions", torch.zeros(2, 7, dtype=torch.int64), r"ignore_regions must be float \(k, 7\)"),
    ],
)
def test_check_names_bad_attributes_and_ignore_regions(field, value, message):
    sample = _with_metric_fields(_sample(2), 1, 0)
    assert check_sample(sample, "here") is sample
    sample[field] = value
    with pytest.raises(ValueError, match=f"here: {message}"):
        check_sample(sample, "here")


@pytest.mark.parametrize(
    "labels, message",
    [
        (torch.tensor([0, 10, 2]), r"here: labels row 1 is 10, outside \[0, 10\): labels index CLASSES"),
        (torch.tensor([0, 1, -1]), r"here: labels row 2 is -1, outside \[0, 10\)"),
        (torch.tensor([0, 1, 2]).int(), r"labels must be int64 \(3,\) to match the boxes, got torch.int32"),
        (torch.tensor([0, 1]), r"labels must be int64 \(3,\) to match the boxes, got torch.int64 \(2,\)"),
    ],
)
def test_check_names_a_label_of_no_class_or_of_another_type(labels, message):
    with pytest.raises(ValueError, match=message):
        check_sample({**_sample(3), "labels": labels}, "here")


def test_check_names_boxes_of_another_type_or_width():
    sample = _sample(3)
    with pytest.raises(ValueError, match=r"boxes must be floating point \(m, 9\) .*, got torch.int64 \(3, 9\)"):
        check_sample({**sample, "boxes": sample["boxes"].long()}, "here")
    with pytest.raises(ValueError, match=r"boxes must be floating point \(m, 9\) .*, got torch.float32 \(3, 7\)"):
        check_sample({**sample, "boxes": sample["boxes"][:, :7]}, "here")


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
