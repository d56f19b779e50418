"""A Fabric loop under ``spatial_tp`` reaches the weights and buffers the same loop reaches on one device on the same
global batches: float64, fallbacks as errors, compared in the ranks (the weights never leave float64).

Layouts: width over 2 ranks, 2x2 tiles, and 2 data replicas of 2 width ranks (a sampler over the data replicas,
BatchNorm statistics over the whole global batch with ``sync_batchnorm=True``). Models: a timm ConvNeXt, a timm
ResNet with BatchNorm, and a BEV detector (PETR: 3-D position embedding, attention over camera tokens, Hungarian
matching, a loss normalised by the box count averaged over the data replicas); with the BEV plane sharded, Lift-Splat
and BEVFormer (its learned queries cut by ``bev_planes``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Dataset

from lightning_spatial import SpatialTensor
from lightning_spatial.data import SurroundScenes, collate_surround
from lightning_spatial.fabric import SpatialParallelStrategy
from lightning_spatial.models.bev import PETR, BEVFormer, LiftSplat
from tests.oracle import RTOL_FLOAT64
from tests.strategy.lit import Images, make_model
from tests.strategy.test_equivalence import assert_same_weights

LAYOUTS = {  # name: (devices, spatial_size)
    "w2": (2, 2),
    "2x2": (4, (2, 2)),
    "data2_w2": (4, 2),
}
GLOBAL_BATCH, STEPS = 4, 2


class Classifier:
    """A timm image classifier on random images with random labels."""

    def __init__(self, name: str, height: int, width: int):
        self.name, self.data = name, Images(GLOBAL_BATCH * STEPS, height, width)

    def model(self) -> torch.nn.Module:
        return make_model(self.name)

    def loss(self, fabric: Fabric, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return F.cross_entropy(model(batch["image"]), batch["label"])

    def loader(self, batch_size: int) -> DataLoader:
        return DataLoader(self.data, batch_size=batch_size)


class Detector:
    """PETR (tiny) on synthetic surround scenes: 2 cameras of 64 x 96, up to 4 boxes a scene."""

    data: Dataset = SurroundScenes(GLOBAL_BATCH * STEPS, 64, 96, cameras=2, max_objects=4, seed=3)

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return PETR.tiny()

    def loss(self, fabric: Fabric, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """The module's ``training_step`` (through DDP's forward on several ranks) with the batch in the precision's
        dtype and under its context, as the Trainer runs it: one device calls it directly, outside ``forward``."""
        with fabric.autocast():
            return model.training_step(fabric.strategy.precision.convert_input(batch), 0)

    def loader(self, batch_size: int) -> DataLoader:
        return DataLoader(self.data, batch_size=batch_size, collate_fn=collate_surround)


CASES = {
    "convnext": lambda layout: Classifier("convnext_atto", 64 if layout == "2x2" else 32, 64),
    "resnet_batchnorm": lambda layout: Classifier("resnet18", 64 if layout == "2x2" else 32, 64),
    "petr": lambda layout: Detector(),
}
TOLERANCE = 1e-13  # relative, per tensor; measured: below 1e-14 for every case


def train(fabric: Fabric, case) -> torch.nn.Module:
    """The loop, the same on one device and in every rank: global batches of ``GLOBAL_BATCH`` samples."""
    model = case.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    replicas = getattr(fabric.strategy, "dims", None)
    loader = fabric.setup_dataloaders(case.loader(GLOBAL_BATCH // (replicas.data if replicas else 1)))
    steps = 0
    for batch in loader:
        fabric.call("on_batch", batch=batch)
        fabric.backward(case.loss(fabric, model, batch))
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    assert steps == STEPS and next(model.parameters()).dtype == torch.float64
    return model.module


class Sharded:
    """A Fabric callback, in the ranks: the images arrive sharded, this rank holding a part of them."""

    def on_batch(self, batch: dict) -> None:
        image = batch.get("image", batch.get("images"))
        assert isinstance(image, SpatialTensor) and image.to_local().numel() < image.numel()


def _in_rank(fabric: Fabric, case, reference: torch.nn.Module, tolerance: float = TOLERANCE) -> None:
    assert_same_weights(train(fabric, case), reference, tolerance, zero_floor=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(CASES))
def test_fabric_loop_reaches_the_single_process_weights(name, layout):
    case = CASES[name](layout)
    reference = train(Fabric(accelerator="cpu", devices=1, precision="64-true"), case)
    devices, spatial = LAYOUTS[layout]
    strategy = SpatialParallelStrategy(spatial, fallback="error", sync_batchnorm=True, start_method="fork")
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision="64-true", callbacks=[Sharded()])
    fabric.launch(_in_rank, case, reference)


class ShardedBEVDetector(Detector):
    """Lift-Splat (tiny), whose CenterPoint head must run on a BEV grid sharded over its cells (``bev_shard``)."""

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        model = LiftSplat.tiny()
        model.head.register_forward_hook(lambda m, args, out: self.check_sharded(out["heatmap"]))
        return model

    @staticmethod
    def check_sharded(bev: torch.Tensor) -> None:
        if torch.distributed.is_initialized() and not isinstance(bev, SpatialTensor):
            raise AssertionError("a BEV module ran on a replicated BEV grid")


class ShardedBEVFormer(ShardedBEVDetector):
    """BEVFormer (tiny), whose first encoder layer must read its learned queries sharded (``bev_planes``)."""

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        model = BEVFormer.tiny()
        model.bev_layers[0].register_forward_pre_hook(lambda m, args: self.check_sharded(args[0]))
        return model


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,layout", [("lift_splat", "w2"), ("lift_splat", "2x2"), ("lift_splat", "data2_w2"), ("bevformer", "2x2")]
)
def test_fabric_loop_with_the_bev_plane_sharded(name, layout):
    case = ShardedBEVDetector() if name == "lift_splat" else ShardedBEVFormer()  # float64 rounding: sums of partials
    reference = train(Fabric(accelerator="cpu", devices=1, precision="64-true"), case)
    devices, spatial = LAYOUTS[layout]
    planes = {"bev_queries": (0, 1)} if name == "bevformer" else None
    strategy = SpatialParallelStrategy(
        spatial, fallback="error", sync_batchnorm=True, bev_shard="xy", bev_planes=planes, start_method="fork"
    )
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision="64-true", callbacks=[Sharded()])
    fabric.launch(_in_rank, case, reference, RTOL_FLOAT64)
