"""The four BEV modules, unchanged, train under ``spatial_tp`` (width 2 and 2x2 tiles) to the weights one device
reaches on the same batches, with fallbacks turned into errors (no op may gather); float64, where the Hungarian
matching and the heatmap peaks see the same numbers on both sides. PETR and BEVFormer under Horovod:
tests/horovod. (Lift-Splat and Simple-BEV have BatchNorm in their BEV encoders: plain data parallelism changes their
statistics, as for any BatchNorm network; spatial ranks share one sample's statistics exactly.)"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_spatial import SpatialParallelStrategy, SpatialTensor
from lightning_spatial.data import SurroundScenes, collate_surround
from lightning_spatial.mesh import Axis
from lightning_spatial.models.bev import PETR, BEVFormer, LiftSplat, SimpleBEV
from lightning_spatial.strategies._scopes import cutting_bev_planes
from tests.strategy.lit import Images
from tests.strategy.test_equivalence import assert_same_weights

MODELS = {
    "petr": PETR.tiny,
    # query denoising draws its jitter from the global RNG: every rank of a spatial group must draw the same
    "petr_denoise": lambda: PETR.tiny(denoise_groups=2),
    "lift_splat": LiftSplat.tiny,
    "simple_bev": SimpleBEV.tiny,
    "bevformer": BEVFormer.tiny,
}


def loader(replica: tuple[int, int] = (0, 1)) -> torch.utils.data.DataLoader:
    """2 samples per step; data replica ``r`` of ``n`` gets every n-th sample from the r-th, 2 // n per step."""
    scenes = SurroundScenes(4, 64, 96, cameras=2, max_objects=4, seed=3)  # 2 rows per rank at stride 32
    r, n = replica
    return torch.utils.data.DataLoader(
        torch.utils.data.Subset(scenes, range(r, len(scenes), n)), batch_size=2 // n, collate_fn=collate_surround
    )


def train(
    name: str, strategy, devices: int, replica: tuple[int, int] = (0, 1), sharded_head: bool = False
) -> L.LightningModule:
    """Two epochs in float64 on this data replica's samples (the loader's order: no sampler is injected);
    ``sharded_head``: every rank checks that the BEV plane is sharded (the CenterPoint head's outputs, BEVFormer's
    encoder input and output)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    if sharded_head and isinstance(model, BEVFormer):  # its queries cut to the rank's cells before the first layer
        model.bev_layers[0].register_forward_pre_hook(lambda m, args: _sharded(args[0]))
        model.bev_layers[-1].register_forward_hook(lambda m, args, out: _sharded(out))
    elif sharded_head:
        model.head.register_forward_hook(lambda m, args, out: _sharded(out["heatmap"]))
    # SGD: AdamW divides each step by the gradient's running norm, so a parameter whose true gradient is zero
    # (PETR's position-embedding bias shifts every key alike: softmax ignores it) would move by +-lr on rounding
    # noise alone, and runs that only sum in another order would drift apart
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision="64-true",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    ).fit(model, loader(replica))
    return model


def _sharded(bev: torch.Tensor) -> None:
    if not isinstance(bev, SpatialTensor) or not bev.shard_layout.shards:
        raise AssertionError(f"the BEV grid is replicated: {type(bev)}")


@pytest.mark.slow
@pytest.mark.parametrize("spatial", [2, (2, 2)], ids=["w2", "2x2"])
@pytest.mark.parametrize("name", list(MODELS))
def test_bev_module_trains_to_the_single_device_weights(name, spatial):
    reference = train(name, "auto", 1)
    devices = 2 if spatial == 2 else 4
    ours = train(name, SpatialParallelStrategy(spatial, fallback="error", start_method="fork"), devices)
    # the fork launcher hands the float64 weights back into this process's float32 model: both sides are rounded
    # to float32 once, so 2 float32 ulps is the float64 agreement seen through that rounding
    assert_same_weights(ours, reference.float(), tolerance=2e-7, zero_floor=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("spatial,bev_shard", [(2, "x"), ((2, 2), "xy")], ids=["w2-x", "2x2-xy"])
@pytest.mark.parametrize("name", ["lift_splat", "simple_bev", "bevformer"])
def test_bev_plane_sharded_trains_to_the_single_device_weights(name, spatial, bev_shard):
    """``bev_shard``: the BEV encoder and head run on the rank's cells of the grid, and training still reaches the
    single-device weights (the module cannot tell: no fallback, no change to it); BEVFormer's learned queries are
    read as the rank's cells from the start (``bev_planes``)."""
    reference = train(name, "auto", 1)
    devices = 2 if spatial == 2 else 4
    planes = {"bev_queries": (0, 1)} if name == "bevformer" else None
    strategy = SpatialParallelStrategy(
        spatial, fallback="error", bev_shard=bev_shard, bev_planes=planes, start_method="fork"
    )
    ours = train(name, strategy, devices, sharded_head=True)
    assert_same_weights(ours, reference.float(), tolerance=2e-7, zero_floor=1e-12)


def test_bad_bev_shard_fails_at_construction():
    with pytest.raises(ValueError, match=r"bev_shard must be None, 'x', 'y' or 'xy', got 'z'"):
        SpatialParallelStrategy(2, bev_shard="z")


def test_bev_planes_naming_no_parameter_fails_before_training_with_the_names():
    strategy = SpatialParallelStrategy(
        2, fallback="error", bev_shard="x", bev_planes={"bev_query": (0, 1)}, start_method="fork"
    )
    with pytest.raises(Exception, match=r"bev_planes names 'bev_query', which is not a parameter of BEVFormer .*"
                       r"bev_queries, bev_rows, bev_columns, level_embedding, camera_embedding"):  # fmt: skip
        train("bevformer", strategy, 2)


@pytest.mark.parametrize(
    "bev_size,mode,dims,match",
    [
        ((1, 8), "x", (0, 1), r"'bev_queries' has 1 cells along dim 0 \(shape \(1, 8, 32\)\), fewer than its 2 ranks"),
        ((8, 1), "y", (0, 1), r"'bev_queries' has 1 cells along dim 1 \(shape \(8, 1, 32\)\), fewer than its 2"),
        ((8, 8), "x", (0, 3), r"gives 'bev_queries' \(shape \(8, 8, 32\)\) the X, Y dims \(0, 3\): name two"),
        ((8, 8), "x", (1, -2), r"the X, Y dims \(1, -2\): name two different dims"),
    ],
)
def test_a_bev_plane_that_cannot_be_cut_fails_naming_its_sizes(bev_size, mode, dims, match):
    model = BEVFormer.tiny(bev_size=bev_size)
    axes = {-1: Axis(ranks=(0, 1), index=0)}  # the ranks' sizes are all the checks read: no process group
    with pytest.raises(ValueError, match=match), cutting_bev_planes(model, {"bev_queries": dims}, axes, mode):
        pass


def test_bev_planes_are_checked_on_one_rank_too():
    """A misspelt name fails on a single rank as on several (no axes: nothing is cut, nothing hooked)."""
    model = BEVFormer.tiny()
    with (
        pytest.raises(ValueError, match="bev_planes names 'bev_query'"),
        cutting_bev_planes(model, {"bev_query": (0, 1)}, {}, "x"),
    ):
        pass
    with cutting_bev_planes(model, {"bev_queries": (0, 1)}, {}, "x"):
        assert not model._forward_pre_hooks and not model._forward_hooks


class _QueriesInGraphedModule(L.LightningModule):
    """A BEV plane held by a submodule that ``cuda_graphs`` names (wrapped for the run): its queries must still be
    found, and read sharded inside the wrapper."""

    def __init__(self):
        super().__init__()
        self.bev = _Queries()

    def training_step(self, batch, batch_idx):
        return self.bev(batch["image"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Queries(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.queries = torch.nn.Parameter(torch.randn(4, 6, 3))

    def forward(self, image):
        _sharded(self.queries)
        return self.queries.square().sum() + image.mean()


def test_bev_planes_in_a_module_cuda_graphs_names():
    strategy = SpatialParallelStrategy(
        2, fallback="error", bev_shard="x", bev_planes={"bev.queries": (0, 1)}, cuda_graphs=["bev"], start_method="fork"
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(_QueriesInGraphedModule(), DataLoader(Images(2, 8, 16), batch_size=2))
