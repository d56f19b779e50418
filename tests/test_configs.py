"""Every option of every config group composes with conf/train.yaml and instantiates; bad configs fail with an
error that names the key and, where there is a list, the allowed values (Hydra's own where it has one)."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, InstantiationException, MissingConfigException
from hydra.utils import instantiate
from omegaconf.errors import MissingMandatoryValue
from PIL import Image

import lightning_spatial  # noqa: F401 - registers the strategies
from lightning_spatial.callbacks import SpatialSummary

CONF = Path(__file__).resolve().parents[1] / "conf"
OPTIONS = [
    (group, path.stem)
    for group in ("model", "data", "strategy", "trainer", "experiment", "strategy/comm_hook")
    for path in sorted((CONF / group).glob("*.yaml"))
]


@pytest.fixture
def folder(tmp_path) -> list[str]:
    """An image folder for data=image_folder (its root is required)."""
    for sub in ("images", "masks"):
        (tmp_path / sub).mkdir()
        Image.new("RGB" if sub == "images" else "L", (8, 4)).save(tmp_path / sub / "a.png")
    return [f"data.root={tmp_path / 'images'}", f"data.masks={tmp_path / 'masks'}"]


def _compose(*overrides: str, out: Path) -> dict:
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=[*overrides, f"out={out}"])


def _instantiate(cfg) -> dict:
    """Each node as the recipe instantiates it; models on the meta device (ConvNeXt-XL without 1.4 GB)."""
    with torch.device("meta"):
        model = instantiate(cfg.model)
    strategy = instantiate(cfg.strategy)
    if cfg.trainer.accelerator == "gpu" and not torch.cuda.is_available():
        cfg.trainer.accelerator, cfg.trainer.devices = "cpu", 1  # the rest of a GPU trainer still instantiates
    trainer = instantiate(cfg.trainer, strategy="auto" if cfg.trainer.devices == 1 else strategy)
    return {"model": model, "data": instantiate(cfg.data), "strategy": strategy, "trainer": trainer}


@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_instantiates(group, option, folder, tmp_path):
    plus = "+" if group == "strategy/comm_hook" else ""
    needs_folder = option in ("image_folder", "image_folder_demo")
    root = [f"data.root={tmp_path}"] if option == "nuscenes" else []  # your copy: read at setup, not here
    cfg = _compose(f"{plus}{group}={option}", *(folder if needs_folder else ()), *root, out=tmp_path)
    built = _instantiate(cfg)
    assert isinstance(built["model"], L.LightningModule) and isinstance(built["data"], L.LightningDataModule)
    callbacks = built["trainer"].callbacks
    assert any(isinstance(c, SpatialSummary) for c in callbacks) and built["trainer"].checkpoint_callback
    assert {type(lg).__name__ for lg in built["trainer"].loggers} == {"CSVLogger", "TensorBoardLogger"}


def test_spatial_variants_reach_the_strategy(tmp_path):
    names = ("spatial_height", "spatial_2x2", "spatial_auto")
    cfgs = {name: _compose(f"strategy={name}", out=tmp_path).strategy for name in names}
    assert instantiate(cfgs["spatial_height"])._shard_dim == "height"
    assert instantiate(cfgs["spatial_2x2"])._spatial_size == [2, 2]  # a list, not a ListConfig
    auto = _compose("strategy=spatial_auto", "strategy.memory_budget=70GiB", out=tmp_path).strategy
    assert instantiate(cfgs["spatial_auto"])._spatial_size == "auto"
    assert instantiate(auto)._memory_budget == 70 * 2**30
    fixed = _compose("strategy=spatial_auto", "strategy.global_batch_size=64", out=tmp_path).strategy
    assert instantiate(fixed)._global_batch_size == 64 and instantiate(auto)._global_batch_size is None


@pytest.mark.parametrize("strategy", ["spatial_tp", "ddp"])
@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_gradient_compression_is_a_ddp_comm_hook(strategy, hook, tmp_path):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    cfg = _compose(f"strategy={strategy}", f"+strategy/comm_hook={hook}", out=tmp_path)
    built = instantiate(cfg.strategy)
    requested = built._user_comm_hook[1] if strategy == "spatial_tp" else built._ddp_comm_hook  # ours wraps it later
    assert requested is getattr(default_hooks, f"{hook}_compress_hook")


def test_the_gpu_experiment_is_what_its_comment_says(tmp_path):
    cfg = _compose("experiment=convnext_xl_4096", out=tmp_path)
    assert (cfg.model.backbone, cfg.data.height, cfg.data.width, cfg.data.batch_size) == (
        "convnext_xlarge",
        512,
        4096,
        7,
    )
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.strategy.spatial_size) == ("gpu", 8, 4)


# The overrides of the run in docs/bev.md (2026-11-30, 330fa4b) that made petr_convnext learn on one H200.
CARS_RUN = (
    "model.embed_dims=32 model.num_layers=2 model.num_heads=4 model.ffn_dims=64 model.num_queries=100 model.lr=5e-4 "
    "model.num_classes=1 model.metric.classes=[car] data.classes=[car] data.max_objects=10 data.distance=[4.0,24.0] "
    "data.num_samples=256 data.val_samples=32 trainer.max_epochs=-1 ++trainer.check_val_every_n_epoch=null"
)


def test_the_gpu_bev_experiment_that_learns_is_the_run_in_the_docs(tmp_path):
    """experiment=petr_convnext_cars is petr_convnext with the command-line overrides of the documented run."""
    named = _compose("experiment=petr_convnext_cars", out=tmp_path)
    run = _compose("experiment=petr_convnext", *CARS_RUN.split(), out=tmp_path)
    assert named == run


@pytest.mark.parametrize(
    "override, error, words",
    [
        ("strategy=spatial_3d", MissingConfigException, ["strategy/spatial_3d", "spatial_tp", "spatial_auto"]),
        ("trainer=tpu", MissingConfigException, ["trainer/tpu", "cpu", "gpu_bf16"]),
        ("trainer.max_epoch=3", ConfigCompositionException, ["trainer.max_epoch"]),
        ("strategy.shard_dim=depth", InstantiationException, ["shard_dim", "'width', 'height'", "full_key: strategy"]),
        ("model.task=detection", InstantiationException, ["task", "'classification', 'segmentation'", "model"]),
        ("model.optimizer=lamb", InstantiationException, ["optimizer", "'adamw', 'sgd'", "full_key: model"]),
        ("trainer.precision=17", InstantiationException, ["Precision 17", "bf16-mixed", "full_key: trainer"]),
        ("data=image_folder", MissingMandatoryValue, ["data.root"]),
        ("data.height=-64", InstantiationException, ["height must be an integer >= 1, got -64", "full_key: data"]),
        ("model=petr model.num_classes=0", InstantiationException, ["num_classes must be", "full_key: model"]),
        ("model=petr model.num_queries=-1", InstantiationException, ["num_queries must be an integer >= 0, got -1"]),
    ],
)
def test_bad_config_names_the_key_and_the_allowed_values(override, error, words, tmp_path):
    with pytest.raises(error) as raised:
        _instantiate(_compose(*override.split(), out=tmp_path))
    assert all(word in str(raised.value) for word in words), str(raised.value)


class WorseningLoss(L.LightningModule):
    """A module whose validation loss grows every epoch: the best checkpoint stays at the first epoch."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", float(self.current_epoch) + self.layer(batch).mean().detach() * 0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_last_checkpoint_is_the_latest_state_when_the_loss_gets_worse(tmp_path):
    """The trainer config's last.ckpt (what ckpt_path= resumes from) holds the latest step, not the best one:
    Lightning's own save_last only rewrites last.ckpt when the monitored value improves, so a resume after
    a worse validation silently went back to the best epoch's state."""
    cfg = _compose("trainer.max_epochs=3", "trainer.devices=1", "trainer.logger=null", out=tmp_path)
    trainer = instantiate(cfg.trainer, strategy="auto", enable_progress_bar=False)
    data = torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2)
    trainer.fit(WorseningLoss(), data, data)
    checkpoints = tmp_path / "checkpoints"
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 6
    (best,) = [p for p in checkpoints.iterdir() if p.name != "last.ckpt"]
    assert best.name == "epoch=0-step=2.ckpt"


def test_last_checkpoint_holds_the_step_where_training_stopped_between_validations(tmp_path):
    """A run stopped by max_steps after step 5 validated last at step 4 (Lightning does not validate at that
    stop): last.ckpt still holds step 5, and resuming from it continues there (one more step, mid-epoch)."""
    cfg = _compose("trainer.max_epochs=3", "trainer.devices=1", "trainer.logger=null", out=tmp_path)
    data = torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2)
    first = instantiate(cfg.trainer, strategy="auto", enable_progress_bar=False, max_steps=5)
    first.fit(WorseningLoss(), data, data)
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 5
    second = instantiate(cfg.trainer, strategy="auto", enable_progress_bar=False, max_steps=6)
    model = WorseningLoss()
    second.fit(model, data, data, ckpt_path=last)
    assert (second.global_step, second.current_epoch) == (6, 3)
    assert torch.load(last, weights_only=True)["global_step"] == 6


class SlowSteps(WorseningLoss):
    def training_step(self, batch, batch_idx):
        time.sleep(0.2)
        return super().training_step(batch, batch_idx)


def test_last_checkpoint_holds_the_step_where_the_time_limit_stopped(tmp_path):
    """max_time stops inside the first epoch (10 steps of 0.2 s, 1 s allowed): Lightning validates as it stops,
    so last.ckpt holds that step (a time-limited job, on SLURM or elsewhere, resumes where it stopped)."""
    cfg = _compose("trainer.devices=1", "trainer.logger=null", out=tmp_path)
    data = torch.utils.data.DataLoader(torch.randn(20, 2), batch_size=2)
    trainer = instantiate(cfg.trainer, strategy="auto", enable_progress_bar=False, max_time="00:00:00:01")
    trainer.fit(SlowSteps(), data, data)
    assert 0 < trainer.global_step < 10
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == trainer.global_step
