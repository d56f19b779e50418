"""What benchmarks/spatial_step.py trains: a timm classifier on (B, 3, H, W) images, or a BEV detector on
(B, N, 3, H, W) surround cameras (``--model petr``, ``lift_splat``, ``simple_bev``, ``bevformer``: the modules'
defaults, paper-sized with ConvNeXt-B, Lift-Splat and Simple-BEV with the ResNet-18 BEV encoder; ``petr_tiny``
etc.: their ``tiny()``; ``--cameras``, ``--bev-size``, ``--bev-encoder``).

A task builds the model, turns this rank's image block into the model's input (sharded images plus the
replicated calibration and boxes a detector needs) and computes a loss. For a classifier the natural baseline
is its shard alone (``shard``); a detector's decoder attends to every camera token, so its baseline is the
whole input on one device (``one device``).
"""

from __future__ import annotations

import timm
import torch


class ImageTask:
    baseline = "shard"
    bev_planes: dict = {}

    def __init__(self, args):
        self.name, self.batch = args.model, args.batch

    def image_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (self.batch, 3, height, width)

    def build(self, device: torch.device, ckpt: bool) -> torch.nn.Module:
        model = timm.create_model(self.name, pretrained=False, num_classes=10).to(device)
        model.set_grad_checkpointing(ckpt)
        return model

    def input(self, images: torch.Tensor, height: int, width: int):
        return images

    def loss(self, model, x) -> torch.Tensor:
        return model(x).float().square().mean()


class DetectorTask:
    baseline = "one device"

    def __init__(self, args):
        from lightning_spatial.models.bev import PETR, BEVFormer, LiftSplat, SimpleBEV

        name, tiny = args.model.removesuffix("_tiny"), args.model.endswith("_tiny")
        module = {"petr": PETR, "lift_splat": LiftSplat, "simple_bev": SimpleBEV, "bevformer": BEVFormer}[name]
        self.make = module.tiny if tiny else module
        self.options = {"num_cameras": args.cameras} if module is BEVFormer else {}  # its camera embedding
        if getattr(args, "bev_size", None):
            self.options["bev_size"] = tuple(int(n) for n in args.bev_size.split(","))
        if getattr(args, "bev_encoder", None):
            self.options["bev_encoder"] = args.bev_encoder
        self.batch, self.cameras = args.batch, args.cameras
        # parameters that are a BEV grid themselves, as conf/experiment/bevformer_*.yaml give bev_planes
        self.bev_planes = {"bev_queries": (0, 1)} if module is BEVFormer else {}

    def image_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (self.batch, self.cameras, 3, height, width)

    def build(self, device: torch.device, ckpt: bool) -> torch.nn.Module:
        model = self.make(**self.options).to(device)
        model.encoder.backbone.set_grad_checkpointing(ckpt)
        return model

    def input(self, images: torch.Tensor, height: int, width: int) -> dict:
        from lightning_spatial.data.geometry import projection
        from lightning_spatial.data.surround import CAMERAS, camera_rig

        intrinsics, cam2ego = camera_rig(CAMERAS[: self.cameras], (height, width))
        g = torch.Generator().manual_seed(0)
        centres = torch.rand(self.batch, 10, 2, generator=g) * 80 - 40
        boxes = [torch.cat([c, torch.tensor([[0.9, 1.9, 4.6, 1.7, 0.3, 2.0, 0.0]]).expand(10, -1)], 1) for c in centres]
        return {
            "images": images,
            "lidar2img": projection(intrinsics, cam2ego).expand(self.batch, -1, -1, -1).to(images.device),
            "boxes": [b.to(images.device) for b in boxes],
            "labels": [torch.zeros(10, dtype=torch.long, device=images.device) for _ in boxes],
        }

    def loss(self, model, x) -> torch.Tensor:
        return getattr(model, "module", model).loss(model(x), x)["loss"]


DETECTORS = ("petr", "lift_splat", "simple_bev", "bevformer")


def bev_encoder(model: torch.nn.Module) -> str | None:
    """The BEV encoder a Lift-Splat or Simple-BEV was built with (``"resnet18"``, ``"convs"``); None for others."""
    hparams = getattr(getattr(model, "module", model), "hparams", None)
    return None if hparams is None else hparams.get("bev_encoder")


def task(args):
    return DetectorTask(args) if args.model.removesuffix("_tiny") in DETECTORS else ImageTask(args)


__all__ = ["DETECTORS", "DetectorTask", "ImageTask", "bev_encoder", "task"]
