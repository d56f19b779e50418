"""Train with Lightning Fabric in a loop of your own, spatially sharded (conf/fabric_train.yaml).

python recipes/fabric_train.py                                  # 2 CPU ranks, width-sharded, about a minute
python recipes/fabric_train.py strategy.spatial_size=[2,2] devices=4
python recipes/fabric_train.py model=convnext_atto precision=bf16-mixed
torchrun --nproc-per-node 8 recipes/fabric_train.py accelerator=gpu devices=8 strategy.spatial_size=4

The loop is Fabric's own: ``fabric.setup`` wraps the model (its weights replicated, DDP reducing the gradient
shares), ``fabric.setup_dataloaders`` gives each rank its rows of every image (the same samples across a spatial
group, other samples across data replicas), ``fabric.backward`` and ``fabric.all_reduce`` do the rest. Nothing in the
model or the loop knows about shards. At the end rank 0 writes ``<out>/checkpoints/last.ckpt`` with
``fabric.save``: its ``"model"`` entry is the plain model's state dict.
"""

from __future__ import annotations

from pathlib import Path

import hydra
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from lightning.fabric import Fabric
from omegaconf import DictConfig

from lightning_spatial.sharding import describe  # importing lightning_spatial registers "spatial_tp" for Fabric


@hydra.main(config_path="../conf", config_name="fabric_train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    strategy = instantiate(cfg.strategy)
    fabric = Fabric(accelerator=cfg.accelerator, devices=cfg.devices, strategy=strategy, precision=cfg.precision)
    fabric.launch(train, cfg)


def train(fabric: Fabric, cfg: DictConfig) -> None:
    fabric.seed_everything(cfg.seed)
    model = instantiate(cfg.model, _convert_="all")  # a LightningModule: its training_step runs through DDP
    data = instantiate(cfg.data, _convert_="all")
    model, optimizer = fabric.setup(model, model.configure_optimizers())
    train_loader, val_loader = fabric.setup_dataloaders(data.train_dataloader(), data.val_dataloader())
    d = fabric.strategy.dims
    fabric.print(f"mesh: {d.world_size} ranks = {d.data} data replica(s) x {d.spatial_h}x{d.spatial_w} spatial tiles")

    step = 0
    for epoch in range(cfg.epochs):
        model.train()
        set_epoch(train_loader, epoch)  # another order each epoch, the same across a spatial group
        for batch_idx, batch in enumerate(train_loader):
            if step == 0:
                fabric.print(describe(batch))  # which tensors were cut to this rank's rows
            loss = model.training_step(batch, batch_idx)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
        train_loss, val_loss = float(fabric.all_reduce(loss.detach())), validate(fabric, model, val_loader)
        fabric.print(f"epoch {epoch}: train_loss {train_loss:.4f}, val_loss {val_loss:.4f}")

    path = Path(cfg.out) / "checkpoints" / "last.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})
    fabric.print(f"checkpoint: {path}")
    fabric.print("final metrics:", {"train_loss": round(train_loss, 4), "val_loss": round(val_loss, 4)})


def set_epoch(loader, epoch: int) -> None:
    """The distributed sampler's epoch: Fabric put it where the loader draws from (a batch sampler's ``sampler``
    for torchdata's ``StatefulDataLoader``, which the data modules return)."""
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)


@torch.no_grad()
def validate(fabric: Fabric, model, loader) -> float:
    """The mean loss over the validation samples of every data replica (Fabric's sampler pads a set the replicas
    do not divide with repeats, as under DDP)."""
    model.eval()
    total, count = torch.zeros((), device=fabric.device), torch.zeros((), device=fabric.device)
    for batch in loader:
        logits = model(batch["image"])
        target = batch["mask"] if "mask" in batch and logits.dim() == 4 else batch["label"]
        total += F.cross_entropy(logits, target, reduction="sum").float()
        count += target.numel()
    return float(fabric.all_reduce(total, reduce_op="sum") / fabric.all_reduce(count, reduce_op="sum"))


if __name__ == "__main__":
    main()
