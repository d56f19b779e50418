"""The collate hook: which batch entries are sharded, nested batches, multi-camera tensors, overrides."""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_spatial import LayoutError, SpatialTensor, gather
from lightning_spatial.sharding import ShardingCollate, shard_batch
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


def _no_image_case():
    with pytest.raises(LayoutError, match="no image-sized tensor in the batch"):
        shard_batch({"label": torch.tensor([1, 2]), "vector": torch.randn(2, 5)}, axes("w2"))


def test_a_batch_without_an_image_is_an_error():
    run_spmd(_no_image_case, 2)
