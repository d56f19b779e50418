"""Train a timm backbone with spatial parallelism, configured by Hydra (conf/train.yaml).

python recipes/train.py                                   # 2 CPU ranks, width-sharded, a few minutes
python recipes/train.py model=resnet18_seg                # dense segmentation, sharded logits and loss
python recipes/train.py strategy=single trainer.devices=1 # the single-device baseline
python recipes/train.py -m strategy.spatial_size=1,2 model=convnext_atto,resnet18_seg
"""

from __future__ import annotations

import hydra
import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig

import lightning_spatial  # noqa: F401 - registers the "spatial_tp" strategy


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, float]:
    L.seed_everything(cfg.seed, workers=True)
    model = instantiate(cfg.model)
    data = instantiate(cfg.data)
    trainer = instantiate(cfg.trainer, strategy=instantiate(cfg.strategy))
    trainer.fit(model, data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    print("final metrics:", {k: round(v, 4) for k, v in sorted(metrics.items())})
    return metrics


if __name__ == "__main__":
    main()
