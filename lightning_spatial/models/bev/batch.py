"""Validation of a surround-camera batch (the shared BEV batch contract), before any network runs.

``check_shapes`` reads shapes and dtypes only, so it costs no wait for a device; ``check_contents`` reads values
(calibration, boxes, labels) and runs on the host (``BEVDetector.check_batch`` says when).
"""

from __future__ import annotations

from typing import Any

import torch

from ...data.batch import check_boxes


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], what: str):
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} must be {what} = {expected} to match images, got {tuple(tensor.shape)}")


def _check_calibration(name: str, lidar2img: torch.Tensor, height: int, width: int):
    """lidar2img must be invertible (the models invert it without a check of their own). The principal point of K
    in lidar2img[:3, :3] = K R is (KK^T)[:2, 2] / (KK^T)[2, 2] for any rotation R; outside the image it means
    calibration for another image size (e.g. not rescaled with the images)."""
    singular = torch.linalg.inv_ex(lidar2img.double()).info != 0
    m = lidar2img[..., :3, :3].double()
    kkt = m @ m.mT
    centre = kkt[..., :2, 2] / kkt[..., 2:, 2]
    limit = torch.tensor([width, height], dtype=centre.dtype, device=centre.device) - 0.5
    outside = ((centre < -0.5) | (centre > limit)).any(-1)
    if singular.any():
        b, n = (int(i) for i in singular.nonzero()[0])
        raise ValueError(f"{name}[{b}, {n}] is singular, so no pixel maps back to a ray: {lidar2img[b, n].tolist()}")
    if outside.any():
        b, n = (int(i) for i in outside.nonzero()[0])
        cx, cy = centre[b, n].tolist()
        raise ValueError(
            f"{name}[{b}, {n}] has its principal point at (u, v) = ({cx:.1f}, {cy:.1f}), outside the {width}x{height}"
            " images: the calibration is for another image size (rescale lidar2img when resizing images)"
        )


def _camera_fields(temporal: bool) -> list[str]:
    return ["lidar2img", "prev_lidar2img"] if temporal else ["lidar2img"]


def check_shapes(batch: dict[str, Any], temporal: bool = False, dtype: torch.dtype | None = None) -> None:
    """Raise ValueError naming the field and sizes when cameras, image sizes or boxes disagree, or (given the
    model's ``dtype``) images are not of it (any float under autocast)."""
    images = batch["images"]
    if images.dim() != 5 or images.shape[2] != 3:
        raise ValueError(f"images must be (B, N, 3, H, W), got {tuple(images.shape)}")
    autocast = torch.is_autocast_enabled(images.device.type)
    if dtype is not None and (not images.is_floating_point() or (images.dtype != dtype and not autocast)):
        raise ValueError(
            f"images are {images.dtype} but the model's parameters are {dtype}: give {dtype} images (collate_surround "
            "normalises the samples' uint8 images to float32; Trainer(precision=...) converts a batch to its dtype)"
        )
    b, n, _, h, w = images.shape
    if temporal:
        for name in ("prev_images", "prev_lidar2img"):
            if name not in batch:
                raise ValueError(f"temporal=True needs batch[{name!r}] (the previous frame); it is missing")
        _check_shape("prev_images", batch["prev_images"], tuple(images.shape), "(B, N, 3, H, W)")
        if batch["prev_images"].dtype != images.dtype:
            raise ValueError(f"prev_images are {batch['prev_images'].dtype} but images are {images.dtype}")
    for name in _camera_fields(temporal):
        _check_shape(name, batch[name], (b, n, 4, 4), "(B, N, 4, 4)")
    if "intrinsics" in batch:
        _check_shape("intrinsics", batch["intrinsics"], (b, n, 3, 3), "(B, N, 3, 3)")
    if "boxes" in batch:
        boxes, labels = batch["boxes"], batch["labels"]
        if len(boxes) != b or len(labels) != b:
            raise ValueError(f"boxes and labels must be lists of B={b} tensors, got {len(boxes)} and {len(labels)}")
        for i, (box, label) in enumerate(zip(boxes, labels)):
            if box.dim() != 2 or box.shape[1] != 9 or tuple(label.shape) != (box.shape[0],):
                raise ValueError(
                    f"boxes[{i}] must be (m, 9) and labels[{i}] (m,), got {tuple(box.shape)} and {tuple(label.shape)}"
                )


def check_contents(batch: dict[str, Any], num_classes: int, temporal: bool = False) -> None:
    """Raise ValueError naming the field and the sample of a singular or mis-sized calibration, a box the contract
    refuses or a label outside the model's ``num_classes`` (see ``data.batch.check_boxes``)."""
    h, w = batch["images"].shape[-2:]
    for name in _camera_fields(temporal):
        _check_calibration(name, batch[name], h, w)
    for i, (boxes, labels) in enumerate(zip(batch.get("boxes", ()), batch.get("labels", ()))):
        fix = f"the model has num_classes={num_classes} (set it to the data's class count)"
        check_boxes(boxes, labels, f"batch sample {i}", num_classes, fix)
