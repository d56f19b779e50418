"""The surround-camera sample and batch contract shared by every source (synthetic, nuScenes, packed records).

A *sample* holds ``images`` as uint8 ``(N, 3, H, W)`` (what cameras and JPEGs give: 4x less to store, pickle
between DataLoader workers and pin than float32), ``lidar2img``/``cam2ego`` float32 ``(N, 4, 4)``,
``intrinsics`` float32 ``(N, 3, 3)``, ``boxes`` float32 ``(m, 9)`` (``BOX_FIELDS``: finite, sizes > 0, NaN in vx, vy
only: velocity unknown, as the nuScenes devkit has it for a lone annotation) and ``labels`` int64 ``(m,)``; temporal
samples add ``prev_images``/``prev_lidar2img``. Samples may add what the detection metric scores and filters by:
``attributes`` int64 ``(m,)`` indexing ``ATTRIBUTES`` (-1: none) and ``ignore_regions`` float32 ``(k, 7)``
boxes (x, y, z, w, l, h, yaw; e.g. bike racks). ``collate_surround`` turns samples into the batch the models
read: images normalised to float32, camera tensors stacked, the per-box and per-region fields kept as
per-sample lists.
"""

from __future__ import annotations

import math

import torch

CLASSES = (
    "car",
    "truck",
    "bus",
    "trailer",
    "construction_vehicle",
    "pedestrian",
    "motorcycle",
    "bicycle",
    "traffic_cone",
    "barrier",
)
# The nuScenes devkit's detection attributes, in its order (attribute ids index them).
ATTRIBUTES = (
    "pedestrian.moving",
    "pedestrian.sitting_lying_down",
    "pedestrian.standing",
    "cycle.with_rider",
    "cycle.without_rider",
    "vehicle.moving",
    "vehicle.parked",
    "vehicle.stopped",
)
CAMERAS = ("CAM_FRONT", "CAM_FRONT_LEFT", "CAM_FRONT_RIGHT", "CAM_BACK", "CAM_BACK_LEFT", "CAM_BACK_RIGHT")
BOX_FIELDS = ("x", "y", "z", "w", "l", "h", "yaw", "vx", "vy")
POINT_CLOUD_RANGE = (-51.2, -51.2, -5.0, 51.2, 51.2, 3.0)
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
_SCALE, _SHIFT = 1 / (255 * STD), -MEAN / STD  # normalise as one multiply-add

_CAMERA_FIELDS = {"lidar2img": (4, 4), "intrinsics": (3, 3), "cam2ego": (4, 4), "prev_lidar2img": (4, 4)}
REGION_FIELDS = BOX_FIELDS[:7]
_LISTS = ("boxes", "labels", "attributes", "ignore_regions")  # per-sample lengths: kept as lists in a batch
_MAY_BE_NAN = torch.tensor([f in ("vx", "vy") for f in BOX_FIELDS])  # velocity unknown: the devkit's lone annotation


def normalise(images: torch.Tensor) -> torch.Tensor:
    """uint8 RGB ``(..., 3, H, W)`` -> float32, ImageNet mean/std (roughly zero mean, unit std)."""
    return torch.addcmul(_SHIFT, images.float(), _SCALE)


def check_sample(sample: dict, where: str, size: tuple[int, int] | None = None, cameras: int | None = None) -> dict:
    """Raise ``ValueError`` naming ``where`` and the field if ``sample`` breaks the contract; return it."""

    def fail(message: str):
        raise ValueError(f"{where}: {message}")

    for key in ("images", "prev_images"):
        images = sample.get(key)
        if images is None:
            continue
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            fail(f"{key} must be uint8 (N, 3, H, W), got {images.dtype} {tuple(images.shape)}")
        if size is not None and tuple(images.shape[-2:]) != tuple(size):
            fail(f"{key} are {tuple(images.shape[-2:])} (H, W) but the calibration is for {tuple(size)}")
    n = sample["images"].shape[0]
    if cameras is not None and n != cameras:
        fail(f"images hold {n} cameras but the calibration has {cameras}")
    for key, shape in _CAMERA_FIELDS.items():
        value = sample.get(key)
        if value is None:
            continue
        if tuple(value.shape) != (n, *shape):
            fail(f"{key} is {tuple(value.shape)}, expected {(n, *shape)} for {n} cameras")
        if not torch.isfinite(value).all():
            fail(f"{key} has NaN or inf entries")
    check_boxes(sample["boxes"], sample["labels"], where, len(CLASSES), "labels index CLASSES (or the classes chosen)")
    labels = sample["labels"]
    attributes = sample.get("attributes")
    if attributes is not None:
        if attributes.dtype != torch.int64 or attributes.shape != labels.shape:
            got = f"{attributes.dtype} {tuple(attributes.shape)}"
            fail(f"attributes must be int64 ({len(labels)},) to match the boxes, got {got}")
        if attributes.numel() and not (-1 <= attributes.min() and attributes.max() < len(ATTRIBUTES)):
            fail(f"attributes must lie in [-1, {len(ATTRIBUTES)}) (-1: none), got {attributes.tolist()}")
    regions = sample.get("ignore_regions")
    if regions is not None and (
        not regions.is_floating_point() or regions.dim() != 2 or regions.shape[1] != len(REGION_FIELDS)
    ):
        fail(f"ignore_regions must be float (k, {len(REGION_FIELDS)}) {REGION_FIELDS}, got {regions.dtype} "
             f"{tuple(regions.shape)}")  # fmt: skip
    return sample


def check_boxes(boxes: torch.Tensor, labels: torch.Tensor, where: str, num_classes: int, classes: str) -> None:
    """Raise ``ValueError`` naming ``where``, the row and the field of what the contract refuses: boxes floating point
    ``(m, 9)``, finite (NaN only in vx, vy: velocity unknown), sizes w, l, h > 0; labels int64 ``(m,)`` in
    ``[0, num_classes)`` (``classes`` says where that count comes from). Reads the values: for host tensors."""

    def fail(message: str):
        raise ValueError(f"{where}: {message}")

    if not boxes.is_floating_point() or boxes.dim() != 2 or boxes.shape[1] != len(BOX_FIELDS):
        fail(
            f"boxes must be floating point (m, {len(BOX_FIELDS)}) {BOX_FIELDS}, got {boxes.dtype} {tuple(boxes.shape)}"
        )
    if labels.dtype != torch.int64 or tuple(labels.shape) != (boxes.shape[0],):
        fail(f"labels must be int64 ({boxes.shape[0]},) to match the boxes, got {labels.dtype} {tuple(labels.shape)}")
    bad = ~(boxes.isfinite() | (boxes.isnan() & _MAY_BE_NAN.to(boxes.device)))
    bad[:, 3:6] |= boxes[:, 3:6] <= 0
    if bad.any():
        row, col = bad.nonzero()[0].tolist()
        field, value = BOX_FIELDS[col], boxes[row, col].item()
        rule = "sizes w, l, h must be > 0 (metres)" if math.isfinite(value) else "only vx, vy may be NaN (unknown)"
        fail(f"boxes row {row} has {field} = {value}: {rule}; repair or drop that box in the data")
    outside = (labels < 0) | (labels >= num_classes)
    if outside.any():
        row = int(outside.nonzero()[0])
        fail(f"labels row {row} is {int(labels[row])}, outside [0, {num_classes}): {classes}")


def collate_surround(samples: list[dict]) -> dict:
    """Samples -> batch: normalised float32 images, stacked camera tensors, per-sample lists of boxes, labels,
    attributes and ignore regions (those the samples have)."""
    shapes = {tuple(s["images"].shape) for s in samples}
    if len(shapes) > 1:
        raise ValueError(f"collate_surround: samples disagree on images (N, 3, H, W): {sorted(shapes)}")
    batch = {key: [s[key] for s in samples] for key in _LISTS if key in samples[0]}
    for key in (k for k in samples[0] if k not in _LISTS):  # the sample's order: the same in every process
        stacked = torch.stack([s[key] for s in samples])
        batch[key] = normalise(stacked) if key.endswith("images") else stacked
    return batch


__all__ = [
    "ATTRIBUTES",
    "BOX_FIELDS",
    "CAMERAS",
    "CLASSES",
    "POINT_CLOUD_RANGE",
    "REGION_FIELDS",
    "check_boxes",
    "check_sample",
    "collate_surround",
    "normalise",
]
