"""The collate hook: which batch entries are sharded, nested batches, multi-camera tensors, overrides."""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_spatial import LayoutError, SpatialTensor, gather
from lightning_spatial.sharding import ShardingCollate, describe, shard_batch
from tests.spmd import LAYOUTS, axes, run_spmd


def _nested_case(layout):
    ax = axes(layout)
    torch.manual_seed(0)
    batch = {
        "cams": torch.randn(2, 6, 3, 16, 24),  # (B, N_cam, C, H, W)
        "targets": [{"depth": torch.randn(2, 6, 16, 24), "boxes": torch.randn(2, 5, 7)}],
        "lidar2img": torch.randn(2, 6, 4, 4),
        "valid": torch.ones(2, 16, 24, dtype=torch.bool),
        "name": "scene-1",
    }
    out = shard_batch(batch, ax)
    for t in (out["cams"], out["targets"][0]["depth"], out["valid"]):
        assert isinstance(t, SpatialTensor)
    for t in (out["targets"][0]["boxes"], out["lidar2img"]):
        assert type(t) is torch.Tensor
    assert out["name"] == "scene-1"
    assert torch.equal(gather(out["cams"]), batch["cams"])
    assert torch.equal(gather(out["targets"][0]["depth"]), batch["targets"][0]["depth"])
    # the shard owns its memory: pinning and transfers move only our slice
    local = out["cams"].to_local()
    assert local.untyped_storage().nbytes() == local.numel() * local.element_size()
    # an explicit choice overrides the rule
    chosen = shard_batch(batch, ax, select=lambda path, t: path == "['cams']")
    assert isinstance(chosen["cams"], SpatialTensor) and type(chosen["valid"]) is torch.Tensor
    # the hook pickles for DataLoader workers (process groups are found again by their ranks)
    hook = pickle.loads(pickle.dumps(ShardingCollate(torch.utils.data.default_collate, ax)))
    collated = hook([{"image": torch.randn(3, 16, 24), "label": torch.tensor(1)} for _ in range(2)])
    assert isinstance(collated["image"], SpatialTensor) and collated["label"].shape == (2,)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_nested_and_multi_camera_batches(layout):
    run_spmd(_nested_case, LAYOUTS[layout][0], layout)


def _image_choice_case():
    ax = axes("w2")
    torch.manual_seed(0)
    bev = {  # camera matrices come first and have >= 4 dims; the images are uint8
        "intrinsics": torch.randn(2, 6, 3, 3),
        "images": torch.randint(0, 255, (2, 6, 3, 16, 24), dtype=torch.uint8),
        "mask": torch.rand(2, 16, 24) > 0.5,
    }
    out = shard_batch(bev, ax)
    assert type(out["intrinsics"]) is torch.Tensor
    assert isinstance(out["images"], SpatialTensor) and out["images"].dtype == torch.uint8
    assert isinstance(out["mask"], SpatialTensor) and torch.equal(gather(out["mask"]), bev["mask"])
    assert describe(out) == (
        "sharded batch tensors: ['images'] (2, 6, 3, 16, 24), ['mask'] (2, 16, 24); "
        "replicated: ['intrinsics'] (2, 6, 3, 3)"
    )
    # without a key named image(s): the largest H x W wins, wherever it sits in the batch
    out = shard_batch({"depth": torch.randn(2, 1, 8, 12), "cams": torch.randn(2, 3, 16, 24)}, ax)
    assert isinstance(out["cams"], SpatialTensor) and type(out["depth"]) is torch.Tensor
    # a key named image(s) wins over a larger map (a BEV target grid)
    out = shard_batch({"bev": torch.randn(2, 4, 64, 64), "image": torch.randn(2, 3, 16, 24)}, ax)
    assert isinstance(out["image"], SpatialTensor) and type(out["bev"]) is torch.Tensor


def test_the_image_is_named_or_the_largest_and_may_be_uint8():
    run_spmd(_image_choice_case, 2)


def _no_image_case():
    with pytest.raises(LayoutError, match="no image-sized tensor in the batch"):
        shard_batch({"label": torch.tensor([1, 2]), "vector": torch.randn(2, 5)}, axes("w2"))


def test_a_batch_without_an_image_is_an_error():
    run_spmd(_no_image_case, 2)
