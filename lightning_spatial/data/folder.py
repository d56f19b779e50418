"""Your own images: a folder of image files at any resolution, optional per-pixel masks, optional labels.

    root/a.jpg, root/b.png, ...              or  root/<class>/a.jpg, ...  (labels: sorted subfolder names)
    masks/a.png, masks/b.png, ...            (optional; same relative path and stem, one class index per pixel)

Samples are ``{"image": (3, H, W) float, normalised with ImageNet statistics, "mask": (H, W) int64,
"label": int64}`` (mask and label when present), the keys ``ImageTask`` reads. ``size=[H, W]`` resizes
every image (bilinear, antialiased) and mask (nearest); ``size=None`` keeps each file's resolution, which
needs ``batch_size=1`` unless all images have one size. Nothing here knows about sharding: under
``spatial_tp`` the strategy's collate hook shards images and masks.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from .._arguments import integers, sizes
from .loading import resumable_loader

SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


class FolderImages(Dataset):
    """``files[i]`` (with ``masks[i]`` and ``labels[i]`` where given), resized to ``size`` if set."""

    def __init__(
        self,
        files: list[Path],
        masks: list[Path] | None = None,
        labels: list[int] | None = None,
        size: tuple[int, int] | None = None,
    ):
        self.files, self.masks, self.labels, self.size = files, masks, labels, size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        rgb = np.asarray(Image.open(self.files[i]).convert("RGB"))
        image = torch.from_numpy(rgb.copy()).permute(2, 0, 1).float().div(255)
        if self.size is not None:
            image = F.interpolate(image[None], size=self.size, mode="bilinear", antialias=True)[0]
        sample = {"image": (image - MEAN) / STD}
        if self.masks is not None:
            sample["mask"] = self._mask(i, rgb.shape[:2])
        if self.labels is not None:
            sample["label"] = torch.tensor(self.labels[i])
        return sample

    def _mask(self, i: int, image_size: tuple[int, int]) -> torch.Tensor:
        mask = np.asarray(Image.open(self.masks[i]))
        if mask.ndim != 2 or mask.shape != image_size:
            raise ValueError(
                f"mask {self.masks[i]} has shape {mask.shape}; expected one class index per pixel of its image "
                f"{self.files[i]}, shape {image_size} (a single-channel PNG, mode L, P or I)"
            )
        mask = torch.from_numpy(mask.astype(np.int64))
        if self.size is not None:
            mask = F.interpolate(mask[None, None].float(), size=self.size, mode="nearest")[0, 0].long()
        return mask


class ImageFolderData(L.LightningDataModule):
    """Train/val splits of a folder of images (see the module docstring for the layout).

    Args:
        root: folder of images, or of one subfolder per class (then samples carry a ``label``).
        masks: folder of per-pixel class masks mirroring ``root`` (``a.jpg`` -> ``masks/a.png``).
        size: ``[H, W]`` to resize to, or ``None`` for each file's own resolution.
        val_fraction: share of the files held out for validation (a fixed random split, ``seed``).
    """

    def __init__(
        self,
        root: str,
        masks: str | None = None,
        size: tuple[int, int] | None = None,
        batch_size: int = 1,
        val_fraction: float = 0.25,
        num_workers: int = 0,
        seed: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"root {str(root)!r} is not a folder of images")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        integers(1, batch_size=batch_size)
        integers(0, num_workers=num_workers)
        self.size = None if size is None else sizes("size", size)
        self.files = sorted(p for p in self.root.rglob("*") if p.suffix.lower() in SUFFIXES)
        if not self.files:
            raise FileNotFoundError(f"root {str(root)!r} holds no images ({', '.join(SUFFIXES)})")
        self.classes = sorted({p.parent.relative_to(self.root).as_posix() for p in self.files} - {"."})
        if self.classes and any(p.parent == self.root for p in self.files):
            raise ValueError(f"root {str(root)!r} mixes images and class subfolders: use one or the other")
        self.masks = [self._mask_path(p) for p in self.files] if masks is not None else None
        self._check_sizes()

    def _mask_path(self, image: Path) -> Path:
        path = (Path(self.hparams.masks) / image.relative_to(self.root)).with_suffix(".png")
        if not path.is_file():
            raise FileNotFoundError(f"no mask for image {image}: expected {path} (masks mirror root, as .png)")
        return path

    def _check_sizes(self) -> None:
        if self.size is not None or self.hparams.batch_size == 1:
            return
        sizes = {}
        for path in self.files:
            with Image.open(path) as image:
                sizes.setdefault(image.size[::-1], path)
        if len(sizes) > 1:
            seen = ", ".join(f"{p.name} {h}x{w}" for (h, w), p in list(sizes.items())[:3])
            raise ValueError(
                f"images differ in size ({seen}) and size=None keeps each one's resolution, which needs "
                f"batch_size=1 (got {self.hparams.batch_size}); or set size=[H, W] to resize them"
            )

    def _split(self, train: bool) -> FolderImages:
        order = torch.randperm(len(self.files), generator=torch.Generator().manual_seed(self.hparams.seed))
        n_val = round(len(self.files) * self.hparams.val_fraction)
        n_val = min(max(n_val, self.hparams.val_fraction > 0), len(self.files) - 1)
        keep = order[n_val:] if train else order[:n_val]
        files = [self.files[i] for i in keep]
        masks = None if self.masks is None else [self.masks[i] for i in keep]
        labels = (
            [self.classes.index(p.parent.relative_to(self.root).as_posix()) for p in files] if self.classes else None
        )
        return FolderImages(files, masks, labels, self.size)

    def train_dataloader(self) -> StatefulDataLoader:
        return resumable_loader(self._split(True), self.hparams.batch_size, True, self.hparams.num_workers)

    def val_dataloader(self) -> StatefulDataLoader:
        return resumable_loader(self._split(False), self.hparams.batch_size, False, self.hparams.num_workers)
