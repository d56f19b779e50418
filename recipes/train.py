"""Train a timm backbone with spatial parallelism, configured by Hydra (conf/train.yaml).

python recipes/train.py                                   # 2 CPU ranks, width-sharded, under two minutes
python recipes/train.py model=convnext_atto               # classification: replicated logits after pooling
python recipes/train.py strategy=single trainer.devices=1 # the single-device baseline
python recipes/train.py experiment=convnext_xl_4096       # 8 GPUs; more configs in docs/recipes.md
python recipes/train.py -m strategy.spatial_size=1,2 model=convnext_atto,resnet18_seg
python recipes/train.py experiment=bev_cpu                # PETR on synthetic surround cameras (docs/bev.md)

The run directory (``out``) receives checkpoints/, csv/metrics.csv, tensorboard/ and plots/metrics.png; the
``SpatialSummary`` callback prints the mesh and shards at the start and speed, memory and paths at the end.
``validate_first=true`` validates the untrained model first (the baseline for the final metrics);
``ckpt_path=<out>/checkpoints/last.ckpt`` resumes an earlier run (weights, optimizer, step, loops, and the
data's place in the epoch: docs/recipes.md, "Resuming a run").
"""

from __future__ import annotations

import csv
from pathlib import Path

import hydra
import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

import lightning_spatial  # noqa: F401 - registers the "spatial_tp" strategy


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, float]:
    L.seed_everything(cfg.seed, workers=True)
    # plain lists and dicts (not Hydra's containers) reach save_hyperparameters: checkpoints then load with
    # torch.load's default weights_only=True, which resuming (ckpt_path=) uses
    model = instantiate(cfg.model, _convert_="all")
    data = instantiate(cfg.data, _convert_="all")
    trainer = instantiate(cfg.trainer, strategy=instantiate(cfg.strategy))
    if cfg.validate_first:  # the untrained model's metrics: the baseline to read the final ones against
        trainer.callbacks.append(ValidateFirst())
    csv_logs = [Path(lg.log_dir) / "metrics.csv" for lg in trainer.loggers if isinstance(lg, CSVLogger)]
    earlier = read_rows(csv_logs[0]) if cfg.ckpt_path and csv_logs and rank_zero_only.rank == 0 else []
    trainer.fit(model, data, ckpt_path=cfg.ckpt_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.is_global_zero and csv_logs and csv_logs[0].exists():
        if earlier:
            prepend_rows(csv_logs[0], earlier)
        print(f"plots: {plot_metrics(csv_logs[0], Path(cfg.out) / 'plots' / 'metrics.png')}")
    # one write of a whole line: under torchrun every process shares the launcher's stdout
    print("final metrics:", {k: round(v, 4) for k, v in sorted(metrics.items())}, flush=True)
    return metrics


class ValidateFirst(L.Callback):
    """Runs the validation loop once before the first training step, as the fit loop runs it after an epoch, so
    its metrics reach every logger at step 0 (a separate ``trainer.validate`` launches its own processes, and
    the CSV logger of ``fit`` then starts a fresh metrics.csv without them)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loop = trainer.fit_loop.epoch_loop.val_loop
        # resumed from a checkpoint saved at a validation's end, the loop would count those batches as run and
        # validate only what it thinks is left (one batch of two: other metrics than the saved weights give)
        loop.restarting = False
        trainer.validating = True
        loop.run()
        trainer.training = True
        if trainer.is_global_zero:
            what = f"metrics at step {trainer.global_step} (resumed)" if trainer.global_step else "untrained metrics"
            print(f"{what}:", {k: round(float(v), 4) for k, v in sorted(trainer.callback_metrics.items())})


def read_rows(metrics_csv: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(metrics_csv.open())) if metrics_csv.exists() else []


def prepend_rows(metrics_csv: Path, earlier: list[dict[str, str]]) -> None:
    """A resumed run's CSVLogger starts metrics.csv afresh (Lightning deletes the old one): put the earlier
    run's rows back in front, up to the resumed run's first step (later ones were trained again)."""
    rows = read_rows(metrics_csv)
    first = min((int(r["step"]) for r in rows), default=None)
    rows = [r for r in earlier if first is None or int(r["step"]) <= first] + rows
    keys = sorted({k for r in rows for k in r} - {"epoch", "step"})
    with metrics_csv.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=["epoch", "step", *keys])
        writer.writeheader()
        writer.writerows(rows)


def plot_metrics(metrics_csv: Path, png: Path) -> Path:
    """Every logged loss, accuracy and detection score (mAP, NDS) against the training step, from Lightning's
    CSV log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(metrics_csv.open()))
    keys = sorted(k for k in (rows[0] if rows else {}) if k.endswith(("_loss", "_acc", "_mAP", "_NDS")))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for key in keys:
        points = [(int(r["step"]), float(r[key])) for r in rows if r.get(key) not in (None, "")]
        ax = axes[0] if key.endswith("_loss") else axes[1]
        ax.plot(*zip(*points), marker="o" if key.startswith("val") else None, label=key)
    for ax, title in zip(axes, ("loss", "accuracy, detection score")):
        ax.set(title=title, xlabel="step")
        ax.legend() if ax.has_data() else ax.set_visible(False)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


if __name__ == "__main__":
    main()
