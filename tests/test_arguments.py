"""Every module's constructor refuses a bad argument at construction, naming it, its value and what it takes (before
this, ``height=-64`` failed in a DataLoader worker and ``num_classes=0`` in the matching's indexing)."""

from __future__ import annotations

import pytest
import torch

from lightning_spatial.data import ImageFolderData, NuScenes, SurroundScenes, SurroundSynthetic, SyntheticScenes
from lightning_spatial.models import ImageTask
from lightning_spatial.models.bev import PETR, BEVFormer, LiftSplat, SimpleBEV

CASES = [  # (module, arguments, message); test ids: position-argument
    (PETR.tiny, dict(num_classes=0), r"num_classes must be an integer >= 1, got 0"),
    (PETR.tiny, dict(num_queries=-1), r"num_queries must be an integer >= 0, got -1"),
    (PETR.tiny, dict(num_layers=0), r"num_layers must be an integer >= 1, got 0"),
    (PETR.tiny, dict(depth_bins=2.5), r"depth_bins must be an integer >= 1, got 2.5"),
    (PETR.tiny, dict(denoise_groups=-2), r"denoise_groups must be an integer >= 0, got -2"),
    (PETR.tiny, dict(embed_dims=30, num_heads=3), r"embed_dims=30 must be a multiple of 4 .* and of num_heads=3"),
    (PETR.tiny, dict(num_heads=3), r"embed_dims=32 must be a multiple of 4 .* and of num_heads=3"),
    (PETR.tiny, dict(depth_range=(5.0, 1.0)), r"depth_range must be \(near, far\) metres with 0 < near < far"),
    (PETR.tiny, dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
    (PETR.tiny, dict(lr=0.0), r"lr must be a number > 0, got 0.0"),
    (LiftSplat.tiny, dict(num_classes=0), r"num_classes must be an integer >= 1, got 0"),
    (LiftSplat.tiny, dict(bev_size=(32, 0)), r"bev_size\[1\] must be an integer >= 1, got 0"),
    (LiftSplat.tiny, dict(max_detections=-1), r"max_detections must be an integer >= 0, got -1"),
    (LiftSplat.tiny, dict(weight_decay=-0.1), r"weight_decay must be a number >= 0, got -0.1"),
    (LiftSplat.tiny, dict(bev_encoder="resnet"), r"bev_encoder must be 'convs' .* or a timm ResNet .*got 'resnet'"),
    (LiftSplat.tiny, dict(bev_encoder="convnext_atto"), r"bev_encoder must be 'convs' .*got 'convnext_atto'"),
    (
        LiftSplat.tiny,
        dict(bev_encoder="resnet18", bev_size=(60, 60)),
        r"bev_size=\[60, 60\] does not fit bev_encoder='resnet18': its stride-8 stage .* multiples of 8 "
        r"\(X=60, Y=60\); use bev_size=\[64, 64\] .* or bev_encoder='convs'",
    ),
    (SimpleBEV, dict(bev_size=(200, 196)), r"bev_size=\[200, 196\] does not fit .*use bev_size=\[200, 200\]"),
    (SimpleBEV.tiny, dict(z_bins=0), r"z_bins must be an integer >= 1, got 0"),
    (SimpleBEV.tiny, dict(bev_layers=0), r"bev_layers must be an integer >= 1, got 0"),
    (SimpleBEV.tiny, dict(point_cloud_range=[-50, -50, -5, 50, -60, 3]), r"point_cloud_range must be .* y0 < y1"),
    (SimpleBEV.tiny, dict(warmup_steps=-1), r"warmup_steps must be an integer >= 0, got -1"),
    (BEVFormer.tiny, dict(encoder_layers=0), r"encoder_layers must be an integer >= 1, got 0"),
    (BEVFormer.tiny, dict(z_anchors=0), r"z_anchors must be an integer >= 1, got 0"),
    (BEVFormer.tiny, dict(num_cameras=0), r"num_cameras must be an integer >= 1, got 0"),
    (BEVFormer.tiny, dict(bev_size=(8,)), r"bev_size must be 2 integers >= 1, got \(8,\)"),
    (BEVFormer.tiny, dict(num_heads=3), r"embed_dims=32 must be a multiple of 4 .* and of num_heads=3"),
    (ImageTask, dict(num_classes=0), r"num_classes must be an integer >= 1, got 0"),
    (ImageTask, dict(lr=-1e-3), r"lr must be a number > 0, got -0.001"),
    (SyntheticScenes, dict(height=-64), r"height must be an integer >= 1, got -64"),
    (SyntheticScenes, dict(batch_size=0), r"batch_size must be an integer >= 1, got 0"),
    (SyntheticScenes, dict(num_workers=-1), r"num_workers must be an integer >= 0, got -1"),
    (SurroundSynthetic, dict(width=0), r"width must be an integer >= 1, got 0"),
    (SurroundSynthetic, dict(num_samples=0), r"num_samples must be an integer >= 1, got 0"),
    (SurroundSynthetic, dict(max_objects=-3), r"max_objects must be an integer >= 0, got -3"),
    (SurroundSynthetic, dict(distance=[14, 10]), r"distance=\(14, 10\): give \(near, far\) metres"),
    (lambda **kw: SurroundScenes(4, **kw), dict(height=-64, width=88), r"height must be an integer >= 1, got -64"),
    (lambda **kw: NuScenes("/nonexistent", **kw), dict(batch_size=0), r"batch_size must be an integer >= 1, got 0"),
]


IDS = [f"{i}-{next(iter(arguments))}" for i, (_, arguments, _) in enumerate(CASES)]


@pytest.mark.parametrize("make, arguments, message", CASES, ids=IDS)
def test_a_bad_constructor_argument_names_itself(make, arguments, message):
    with pytest.raises(ValueError, match=message), torch.device("meta"):  # raised before any weight is made
        make(**arguments)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(size=[64, 0]), r"size\[1\] must be an integer >= 1, got 0"),
        (dict(size=[64]), r"size must be 2 integers >= 1, got \[64\]"),
        (dict(batch_size=0), r"batch_size must be an integer >= 1, got 0"),
    ],
)
def test_a_bad_image_folder_argument_names_itself(tmp_path, arguments, message):
    from PIL import Image

    Image.new("RGB", (8, 4)).save(tmp_path / "a.png")
    with pytest.raises(ValueError, match=message):
        ImageFolderData(str(tmp_path), **arguments)


def test_empty_sets_are_arguments_too():
    """No queries (an empty prediction set), no detections kept and no validation samples are legal."""
    with torch.device("meta"):
        assert PETR.tiny(num_queries=0, max_detections=0).reference_logits.shape == (0, 3)
    assert len(SyntheticScenes(val_samples=0).hparams) and len(SurroundScenes(0, 8, 22)) == 0
