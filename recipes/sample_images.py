"""Write scikit-image's bundled sample photos (no download) as an image folder with segmentation masks, for
the image-folder demo:

python recipes/sample_images.py sample_images          # sample_images/images/*.png, sample_images/masks/*.png
python recipes/train.py experiment=image_folder_demo   # trains on them at full resolution, 2 CPU ranks

Masks: three intensity classes per photo (multi-Otsu thresholds of its grey levels), a learnable dense task.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image
from skimage import color, data, filters

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "colorwheel", "hubble_deep_field")


def write(out: Path, scale: float = 1.0) -> list[Path]:
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "masks").mkdir(parents=True, exist_ok=True)
    written = []
    for name in PHOTOS:
        image = Image.fromarray(getattr(data, name)())
        if scale != 1:
            image = image.resize((max(8, round(image.width * scale)), max(8, round(image.height * scale))))
        grey = color.rgb2gray(np.asarray(image))
        mask = np.digitize(grey, filters.threshold_multiotsu(grey, classes=3)).astype(np.uint8)
        image.save(out / "images" / f"{name}.png")
        Image.fromarray(mask).save(out / "masks" / f"{name}.png")
        written.append(out / "images" / f"{name}.png")
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, nargs="?", default=Path("sample_images"))
    p.add_argument("--scale", type=float, default=1.0, help="resize factor (tests use small images)")
    args = p.parse_args()
    for path in write(args.out, args.scale):
        print(path)


if __name__ == "__main__":
    main()
