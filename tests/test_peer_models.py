"""Contract test over models nobody here wrote, as a new user would bring them: every segmentation model of
``torchvision.models.segmentation`` (auxiliary heads where the model has one) and a timm ``features_only``
backbone under torchvision's ``FeaturePyramidNetwork``, unchanged, in train mode. Outputs, every parameter's
gradient and every buffer (BatchNorm running statistics) on shards equal the single-process model's, with
fallbacks turned into errors: no op gathers.

Both meet a common pattern: a map pooled to 1x1 (replicated), resized to a sharded map's size with
``F.interpolate(size=x.shape[-2:])`` and joined with sharded maps (DeepLabV3's ASPP image pooling: ``torch.cat``;
the FPN's global-context level: the top-down add). EfficientNet-PyTorch brings its own autograd Function, and
Ross Wightman's EfficientDet (``effdet``) a whole detector: BiFPN, heads, anchor labeling and its losses.
torchvision's one-stage detectors ``FCOS`` and ``RetinaNet`` bring their own ``compute_loss``: boolean foreground
masks over the heads' token outputs, every pyramid level's tokens one after another (``pred[fg]``,
``gt[fg, labels[fg]] = 1.0``, ``x[torch.where(fg)[0], :]``), focal, GIoU (with a mask over the selected rows),
centerness and L1 losses on each rank's selected rows.
float64, float64 tolerance (``oracle.RTOL_FLOAT64``).
"""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
import torchvision
from torchvision.ops import FeaturePyramidNetwork

from lightning_spatial import SpatialTensor, fallback_mode
from tests.oracle import RTOL as RTOL_FP32
from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd

pytestmark = pytest.mark.slow  # whole models in float64 on 2 and 4 ranks: 5-55 s each on 2 cores
SEGMENTATION = torchvision.models.list_models(module=torchvision.models.segmentation)
# DeepLabV3's single-process float64 reference is itself noisier than RTOL_FLOAT64: the ASPP image-pooling branch
# normalises a 1x1 map over 2 samples and BatchNorm after the projection removes the batch mean, so its gradients
# cancel. One process, contiguous vs channels_last (a mere reordering), worst parameter gradient: 4.4e-12 relative
# (ResNet-50), 3.9e-11 (ResNet-101); the sharded runs differ by as much. These tolerances are 10x that noise.
RTOL = {"deeplabv3_resnet50": 5e-11, "deeplabv3_resnet101": 4e-10}


def _segmentation(name: str) -> torch.nn.Module:
    kwargs = dict(weights=None, weights_backbone=None, num_classes=3)  # no downloads
    try:
        return torchvision.models.get_model(name, aux_loss=True, **kwargs)
    except NotImplementedError:  # LR-ASPP has no auxiliary head
        return torchvision.models.get_model(name, **kwargs)


class FPNWithContext(torch.nn.Module):
    """A timm backbone's features plus a global-context level (pooled to 1x1: replicated) under torchvision's
    FPN, whose top-down pass resizes that level to the next one's size and adds it to the sharded lateral."""

    def __init__(self, backbone: str):
        super().__init__()
        self.body = timm.create_model(backbone, features_only=True, out_indices=(-4, -3, -2, -1), pretrained=False)
        channels = self.body.feature_info.channels()
        self.fpn = FeaturePyramidNetwork([*channels, channels[-1]], 16)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        levels = self.body(x)
        levels.append(F.adaptive_avg_pool2d(levels[-1], 1))
        return self.fpn({str(i): level for i, level in enumerate(levels)})


def _case(layout: str, build, name: str) -> None:
    torch.manual_seed(0)
    model = build(name).double().train()
    models = {False: model, True: copy.deepcopy(model)}  # BatchNorm buffers: one copy per side
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)

    def run(x):
        torch.manual_seed(1)  # dropout (DeepLabV3, FCN) draws the same global mask on both sides
        out = models[isinstance(x, SpatialTensor)](x)
        return tuple(out.values()) if isinstance(out, dict) else out

    with fallback_mode("error"):
        check(run, [x], sharded=[0], axes=axes(layout), modules=(models[False], models[True]), rtol=RTOL.get(name))


# The ResNet-101 models run on 2 ranks: on 2 x 2 tiles their ops are their ResNet-50 versions' (25 and 20 s saved)
SEGMENTATION_CASES = [(n, layout) for n in SEGMENTATION for layout in ("w2", "2x2") if layout == "w2" or "101" not in n]


@pytest.mark.parametrize("name, layout", SEGMENTATION_CASES)
def test_torchvision_segmentation_models_train_spatially_and_exactly(name, layout):
    run_spmd(_case, LAYOUTS[layout][0], layout, _segmentation, name, timeout=600)


@pytest.mark.parametrize("layout", ["w2", "2x2"])
@pytest.mark.parametrize("backbone", ["resnet18", "convnext_atto"])
def test_timm_features_under_a_torchvision_fpn_train_spatially_and_exactly(backbone, layout):
    run_spmd(_case, LAYOUTS[layout][0], layout, FPNWithContext, backbone)


def _efficientnet(name: str) -> torch.nn.Module:
    """lukemelas' EfficientNet-PyTorch, the trunk of Lift-Splat-Shoot and Simple-BEV: its default activation is a
    memory-efficient Swish written as a ``torch.autograd.Function`` (``SwishImplementation``)."""
    from efficientnet_pytorch import EfficientNet

    return EfficientNet.from_name(name, num_classes=3)


@pytest.mark.parametrize("layout", ["w2", "2x2"])
def test_efficientnet_pytorch_with_its_autograd_function_swish_trains_spatially_and_exactly(layout):
    run_spmd(_case, LAYOUTS[layout][0], layout, _efficientnet, "efficientnet-b0", timeout=600)


# EfficientDet computes its losses in float32 whatever the model's dtype (effdet's ``loss_fn`` casts the head outputs
# with ``.float()``): in a float64 model the loss and every gradient behind it carry float32 rounding (one process,
# contiguous vs channels_last, differs by 2.0e-8 relative in the worst parameter gradient), so it is held to the
# fp32 tolerance.
EFFDET_RTOL = RTOL_FP32


def _effdet_case(layout: str) -> None:
    """Ross Wightman's EfficientDet (``effdet``: EfficientNet-B0 trunk, BiFPN, class and box nets, its anchor
    labeler, focal and Huber losses) trained as its ``DetBenchTrain`` does, unchanged: the loss, every parameter's
    gradient and every BatchNorm buffer equal one process's, no op gathers."""
    from effdet import create_model

    torch.manual_seed(0)
    size = (256, 512) if layout == "2x2" else (128, 256)  # the coarsest level (stride 128): a row per rank
    model = create_model(
        "efficientdet_d0", bench_task="train", bench_labeler=True, pretrained=False, pretrained_backbone=False,
        num_classes=3, image_size=size,
    ).double()  # fmt: skip
    model.anchors.boxes = model.anchors.boxes.float()  # its box labeler takes float32 boxes only
    models = {False: model, True: copy.deepcopy(model)}
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    boxes = torch.tensor([[[10.0, 20.0, 60.0, 90.0], [40.0, 100.0, 120.0, 200.0]], [[5.0, 5.0, 50.0, 50.0], [-1] * 4]])
    target = {"bbox": boxes, "cls": torch.tensor([[1.0, 2.0], [3.0, -1.0]])}  # yxyx; -1: padding

    def loss(x):
        torch.manual_seed(1)  # its backbone's DropPath draws the same per-sample masks on both sides
        out = models[isinstance(x, SpatialTensor)](x, target)
        return out["loss"], out["class_loss"], out["box_loss"]

    with fallback_mode("error"):
        check(loss, [x], sharded=[0], axes=axes(layout), modules=(models[False], models[True]), rtol=EFFDET_RTOL)


@pytest.mark.parametrize("layout", ["w2", "2x2"])
def test_efficientdet_trains_spatially_and_exactly(layout):
    run_spmd(_effdet_case, LAYOUTS[layout][0], layout, timeout=600)


def _detector(name: str) -> torch.nn.Module:
    """torchvision's one-stage detector ``name`` (``FCOS``, ``RetinaNet``) as its builders make it, smaller: a
    ResNet-18 trunk under torchvision's ``BackboneWithFPN`` (64 channels, strides 8 to 64: at 128 x 128 the coarsest
    level is 2 x 2, a row and a column per rank on 2x2), anchors for those four levels, three classes."""
    from torchvision.models.detection import FCOS, RetinaNet
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.backbone_utils import BackboneWithFPN
    from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

    trunk = torchvision.models.resnet18(weights=None)
    layers = {"layer2": "0", "layer3": "1", "layer4": "2"}
    backbone = BackboneWithFPN(trunk, layers, [128, 256, 512], 64, extra_blocks=LastLevelMaxPool())
    if name == "fcos":  # one anchor a location, its size the level's stride (torchvision's FCOS default, 4 levels)
        anchors = AnchorGenerator(((8,), (16,), (32,), (64,)), ((1.0,),) * 4)
        return FCOS(backbone, num_classes=3, anchor_generator=anchors)
    sizes = tuple((s, int(s * 2 ** (1 / 3)), int(s * 2 ** (2 / 3))) for s in (16, 32, 64, 128))  # its default, 4 levels
    return RetinaNet(backbone, num_classes=3, anchor_generator=AnchorGenerator(sizes, ((0.5, 1.0, 2.0),) * 4))


def _detector_case(layout: str, name: str) -> None:
    """The training loss of torchvision's ``FCOS`` / ``RetinaNet``, unchanged: the backbone on a sharded batch, the
    head's token outputs ``(N, HWA, K)`` (every level's flattened map, level after level: token sets), replicated
    anchors and targets, and torchvision's own ``compute_loss``: foreground masks over the tokens (``x[fg]``,
    ``gt[fg, labels[fg]] = 1``), ``sigmoid_focal_loss``, GIoU (FCOS) or L1 (RetinaNet) box losses and FCOS's
    centerness BCE on the selected rows. The model's ``GeneralizedRCNNTransform`` (resizing a list of images) is left
    out: the lines of ``loss`` below from ``features = ...`` to ``compute_loss`` are those of torchvision's
    ``FCOS.forward`` / ``RetinaNet.forward`` in training, with ``images.tensors`` the batch ``x`` and ``images`` an
    ``ImageList`` of it. The loss terms, every parameter's gradient and every BatchNorm buffer equal one process's,
    no op gathers."""
    from torchvision.models.detection.image_list import ImageList

    torch.manual_seed(0)
    model = _detector(name).double().train()
    models = {False: model, True: copy.deepcopy(model)}
    x = torch.randn(2, 3, 128, 128, dtype=torch.float64)
    targets = [  # x1, y1, x2, y2; the second image has no objects
        {
            "boxes": torch.tensor([[10.0, 20.0, 60.0, 90.0], [40.0, 30.0, 120.0, 100.0], [70.0, 5.0, 90.0, 40.0]]),
            "labels": torch.tensor([1, 2, 0]),
        },
        {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)},
    ]
    targets = [{"boxes": t["boxes"].double(), "labels": t["labels"]} for t in targets]

    def loss(x):
        model = models[isinstance(x, SpatialTensor)]
        images = ImageList(x, [tuple(x.shape[-2:])] * x.shape[0])
        # torchvision's forward from here (images.tensors: x)
        features = model.backbone(images.tensors)
        features = list(features.values())
        head_outputs = model.head(features)
        anchors = model.anchor_generator(images, features)
        if name == "fcos":
            num_anchors_per_level = [x.size(2) * x.size(3) for x in features]
            losses = model.compute_loss(targets, head_outputs, anchors, num_anchors_per_level)
        else:
            losses = model.compute_loss(targets, head_outputs, anchors)
        return tuple(losses.values())

    with fallback_mode("error"):
        check(loss, [x], sharded=[0], axes=axes(layout), modules=(models[False], models[True]))


@pytest.mark.parametrize("layout", ["w2", "2x2"])
@pytest.mark.parametrize("name", ["fcos", "retinanet"])
def test_torchvision_one_stage_detector_losses_train_spatially_and_exactly(name, layout):
    run_spmd(_detector_case, LAYOUTS[layout][0], layout, name, timeout=600)
