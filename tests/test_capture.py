"""``cuda_graphs="auto"``: which submodules a watched training step picks (CPU: the choice itself; the replays are
GPU tests in tests/test_graphs.py), and the strategy's checks of ``cuda_graphs``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lightning_spatial
from lightning_spatial import SpatialParallelStrategy
from lightning_spatial.capture import Watch, choose, describe
from lightning_spatial.models.bev import PETR, BEVFormer, LiftSplat, SimpleBEV
from lightning_spatial.run import Run, entered
from tests.host import HostRoundTrips, waits
from tests.models.surround import surround_batch
from tests.spmd import axes, run_spmd


class Camera(nn.Module):
    """The shape of a camera detector: an image encoder, a layer run twice, layers over its tokens called one by one
    from a ``ModuleList``, a head over their (replicated) mean, an unused branch."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.twice = nn.Conv2d(4, 4, 1)
        self.gate = nn.Sigmoid()  # sharded input, no weights
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 2)
        self.unused = nn.Linear(2, 2)

    def forward(self, images):
        features = self.gate(self.twice(self.twice(self.encoder(images))))
        tokens = features.flatten(2).transpose(1, 2)
        for layer in self.layers:
            tokens = layer(tokens)
        return self.head(tokens.mean(1))


def _choice_case(layout):
    model = Camera()
    with Watch(model) as watch:
        model(lightning_spatial.shard(torch.randn(2, 3, 8, 12), axes(layout))).sum().backward()
    chosen, left = choose(model, watch.seen)
    # the largest: not the encoder's convolutions one by one; the layers over sharded tokens one by one
    assert chosen == ["encoder", "layers.0", "layers.1"], chosen
    assert left == {
        "twice": "run 2 times a step (a capture replays one call)",
        "gate": "no trainable weights",
        "head": "its inputs are replicated values, not sharded activations",
        "unused": "not run in a training step",
    }, left
    assert not any(m._forward_pre_hooks for m in model.modules())  # the watch leaves nothing behind
    message = describe(chosen, left)
    assert "replays 'encoder'" in message and "'twice' (run 2 times" in message and "cuda_graphs=False" in message


@pytest.mark.parametrize("layout", ["w2", "2x2"])
def test_the_watched_step_picks_the_largest_modules_run_once_on_shards(layout):
    run_spmd(_choice_case, 2 if layout == "w2" else 4, layout)


class Splat(nn.Module):
    """A camera-to-BEV model: an image encoder, a ``grid_sample`` of its features into a BEV grid, a BEV encoder."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Conv2d(3, 4, 3, padding=1)
        self.bev_encoder = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())

    def forward(self, images):
        grid = torch.rand(images.shape[0], 6, 5, 2, generator=torch.Generator().manual_seed(0)) * 2 - 1
        return self.bev_encoder(F.grid_sample(self.encoder(images), grid, align_corners=False))


def _bev_choice_case(layout, bev_shard):
    model = Splat()
    with entered(Run(bev_shard=bev_shard)), Watch(model) as watch:
        model(lightning_spatial.shard(torch.randn(2, 3, 8, 12), axes(layout))).sum().backward()
    chosen, left = choose(model, watch.seen)
    if bev_shard is None:  # the grid is summed over the ranks and replicated: nothing sharded to replay
        assert chosen == ["encoder"], chosen
        assert left == {"bev_encoder": "its inputs are replicated values, not sharded activations"}
    else:  # its input is the splat's sums, which its first op reduce-scatters over the BEV plane
        assert chosen == ["encoder", "bev_encoder"], (chosen, left)


@pytest.mark.parametrize("bev_shard", [None, "x"])
@pytest.mark.parametrize("layout", ["w2", "2x2"])
def test_with_bev_shard_the_bev_encoder_is_chosen_too(layout, bev_shard):
    run_spmd(_bev_choice_case, 2 if layout == "w2" else 4, layout, bev_shard)


DETECTORS = {"petr": PETR, "lift_splat": LiftSplat, "simple_bev": SimpleBEV, "bevformer": BEVFormer}


def _detector_capture_case(name):
    torch.manual_seed(0)
    model = DETECTORS[name].tiny()
    batch = surround_batch(batch=1, cameras=2, height=32, width=96, boxes=[3])
    batch["images"] = lightning_spatial.shard(batch["images"], axes("w2"))

    def step():
        model.loss(model(batch), batch)["loss"].backward()

    with entered(Run(bev_shard="x", fallback="error")):  # every op of the step on a spatial handler
        with Watch(model) as watch:
            step()
        chosen, _ = choose(model, watch.seen)
        with HostRoundTrips({c: model.get_submodule(c) for c in chosen}) as host:
            step()
    assert "encoder" in chosen, chosen
    if name in ("petr", "bevformer"):  # the decoder layers attend to sharded camera tokens or a sharded BEV
        assert {"layers.0", "layers.1"} <= set(chosen), chosen
    found = waits(host.made, by_design=set())
    assert not found, f"{name}: (module, op) {found} need the host"


@pytest.mark.parametrize("name", list(DETECTORS))
def test_the_modules_chosen_in_a_bev_detector_need_no_host(name):
    """What the default replays in each BEV detector (the BEV side with ``bev_shard``, the decoder layers) can be
    captured: no copy between host and device inside (BEVFormer's layers once divided by ``new_tensor`` sizes, and
    ran eagerly)."""
    run_spmd(_detector_capture_case, 2, name, timeout=300)


def test_unsharded_runs_choose_nothing():
    model = Camera()
    with Watch(model) as watch:
        model(torch.randn(2, 3, 8, 12))
    assert choose(model, watch.seen)[0] == []


@pytest.mark.parametrize("value", ["backbone", True, "AUTO"])
def test_cuda_graphs_takes_auto_false_or_names(value):
    with pytest.raises(ValueError, match="cuda_graphs must be 'auto' \\(the default\\), False, or a list"):
        SpatialParallelStrategy(2, cuda_graphs=value)
    for fine in ("auto", False, None, [], ["model"]):
        SpatialParallelStrategy(2, cuda_graphs=fine)
