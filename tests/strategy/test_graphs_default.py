"""GPU: training through the Trainer with the default ``cuda_graphs="auto"`` equals eager training, for timm models and
the BEV detectors, on one rank of a width split (w2) and of 2x2 tiles, checkpoints included.

One GPU plays one rank (``FakeRank``: PyTorch's fake backend, halos read as zeros), so the graphed and the eager run
compute the same function of the same data on the same shard: any difference is the capture's. fp32 with TF32 off and
deterministic algorithms (the splat's ``index_add`` otherwise adds with atomics, in an order that differs from run to
run), the oracle's fp32 tolerance. ``grid_sample``'s CUDA backward has no deterministic kernel: its rounding differs
from run to run, and AdamW makes a full step of a rounding difference in a gradient that is zero in exact arithmetic
(two eager fp32 runs of the tiny Simple-BEV and BEVFormer differ by 2% and 10% in such parameters, on an H200). The
models that sample (``SAMPLING``) train in float64, where that rounding is 1e-16, against the same tolerance; so does
PETR, whose replayed decoder layers round otherwise than its eager ones (fp32 on an H100: its position embedding's
first bias 1.1e-5 and 6e-5 off at a scale of 0.2 in two runs; float64: within the tolerance). Run in a pytest
invocation of its own on a GPU machine (README).
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch

from lightning_spatial import LatestCheckpoint, SpatialParallelStrategy
from lightning_spatial.data.loading import resumable_loader
from lightning_spatial.fake_rank import FakeRank
from lightning_spatial.graphs import CUDAGraphed
from tests.oracle import RTOL, assert_rel_close
from tests.strategy.lit import Images, LitModel, loader

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (read when its handle is made)

LAYOUTS = {"w2": (2, 2, 1), "2x2": (4, (2, 2), 3)}  # world, spatial_size, the rank played (an interior one)
STEPS = 6  # step 1 watched, 2-3 the wrapper's eager warm-up, 4 captured, 5-6 replayed


@pytest.fixture(autouse=True)
def exact_fp32():
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.are_deterministic_algorithms_enabled(),
    )
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        deterministic,
    ) = saved
    torch.use_deterministic_algorithms(deterministic)


def _image_model(name: str):
    def build():
        model = LitModel(name)
        if name == "convnext_atto":  # DropPath and dropout: random numbers inside the replayed graph
            torch.manual_seed(0)
            import timm

            model.model = timm.create_model(name, pretrained=False, num_classes=3, drop_path_rate=0.2, drop_rate=0.3)
        return model

    return build, lambda: loader(Images(2 * STEPS, 64, 96), 2)


def _bev_model(kind: str):
    from lightning_spatial.data import SurroundSynthetic
    from lightning_spatial.models import bev

    def build():
        torch.manual_seed(0)
        return getattr(bev, kind).tiny()

    def data():
        module = SurroundSynthetic(num_samples=STEPS, val_samples=1, height=64, width=176, cameras=2, batch_size=1)
        module.setup("fit")
        return module.train_dataloader()

    return build, data


MODELS = {
    "convnext_dropout": _image_model("convnext_atto"),
    "resnet_batchnorm": _image_model("resnet10t"),
    "segnet": _image_model("segnet"),
    "petr": _bev_model("PETR"),
    "lift_splat": _bev_model("LiftSplat"),
    "simple_bev": _bev_model("SimpleBEV"),
    "bevformer": _bev_model("BEVFormer"),
}
SAMPLING = {"simple_bev", "bevformer"}  # grid_sample: trained in float64 (module docstring)
FLOAT64 = SAMPLING | {"petr"}  # PETR: its replayed decoder layers round otherwise than eager ones (module docstring)


def _fit(model, data, layout: str, graphs, steps: int, ckpt=None, save=None, rank=None, callbacks=(), **options):
    """One rank of ``layout`` (the interior one unless ``rank``) fits ``steps`` steps; ``graphs``: the strategy's
    ``cuda_graphs``, ``None`` for its default. ``save``: a folder that ``LatestCheckpoint`` keeps last.ckpt in
    (written at the step that stops the run). ``options``: more of the strategy's arguments, and ``precision``."""
    precision = options.pop("precision", "32-true")
    world, spatial, interior = LAYOUTS[layout]
    if graphs is not None:
        options["cuda_graphs"] = graphs
    with FakeRank(world, interior if rank is None else rank) as env:
        trainer = L.Trainer(
            accelerator="gpu",
            devices=1,
            strategy=SpatialParallelStrategy(spatial, fallback="error", **options),
            plugins=[env],
            max_steps=steps,
            precision=precision,
            logger=False,
            enable_checkpointing=save is not None,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[*callbacks, *([] if save is None else [LatestCheckpoint(save)])],
        )
        trainer.fit(model, data, ckpt_path=ckpt)
    return model, trainer


class Captures(L.Callback):
    """Which modules replay, seen inside the run (the strategy unwraps them at its teardown)."""

    def __init__(self):
        self.replaying: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, *args):
        for name, m in pl_module.named_modules():
            if isinstance(m, CUDAGraphed) and m.captured:
                self.replaying.add(name)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items() if v.is_floating_point()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(MODELS))
def test_the_default_replays_the_image_encoder_and_trains_to_the_eager_weights(name, layout):
    build, data = MODELS[name]
    precision = "64-true" if name in FLOAT64 else "32-true"
    eager, _ = _fit(build(), data(), layout, False, STEPS, precision=precision)
    seen = Captures()
    model, _ = _fit(build(), data(), layout, None, STEPS, callbacks=[seen], precision=precision)  # None: "auto"
    assert seen.replaying, "nothing was captured"
    if name in ("petr", "lift_splat", "simple_bev", "bevformer"):
        assert "encoder" in seen.replaying, seen.replaying
    if name == "petr":  # its decoder layers attend to the sharded camera tokens
        assert {"layers.0", "layers.1"} <= seen.replaying, seen.replaying
    assert not any(isinstance(m, CUDAGraphed) for m in model.modules()), "the wrapper outlived the run"
    a, b = _weights(eager), _weights(model)
    assert a.keys() == b.keys()
    for key in a:
        assert_rel_close(b[key], a[key], key, rtol=RTOL)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", sorted(SAMPLING))
def test_the_default_replays_the_sharded_bev_side_too(name, layout):
    """With ``bev_shard`` the modules after the splat run on a sharded BEV: the default replays them too (Simple-BEV's
    BEV encoder; BEVFormer's encoder layers, whose queries are cut to the rank's cells by ``bev_planes``, and its
    decoder layers), and the run trains to the eager weights."""
    build, data = MODELS[name]
    options = dict(bev_shard="x" if layout == "w2" else "xy", precision="64-true")
    if name == "bevformer":
        options["bev_planes"] = {"bev_queries": (0, 1)}
    eager, _ = _fit(build(), data(), layout, False, STEPS, **options)
    seen = Captures()
    model, _ = _fit(build(), data(), layout, None, STEPS, callbacks=[seen], **options)
    bev_side = {"bev_encoder"} if name == "simple_bev" else {"bev_layers.0", "bev_layers.1"}
    assert {"encoder", *bev_side} <= seen.replaying, seen.replaying
    a, b = _weights(eager), _weights(model)
    for key in a:
        assert_rel_close(b[key], a[key], key, rtol=RTOL)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_graphed_run_saved_and_resumed_equals_the_uninterrupted_one(layout, tmp_path):
    """Stopped at step 5 of 3-step epochs, after its graphs replayed, with last.ckpt written there
    (``LatestCheckpoint``), and resumed to step 10 from it (the loader resumes inside the epoch): the resumed run
    watches, warms up and captures again, and ends where the uninterrupted run does. Rank 0 writes checkpoints."""
    build = MODELS["resnet_batchnorm"][0]

    def data():
        return resumable_loader(Images(6, 64, 96), 2, shuffle=True)

    straight, _ = _fit(build(), data(), layout, None, 10, rank=0)
    _fit(build(), data(), layout, None, 5, save=tmp_path, rank=0)
    resumed, _ = _fit(build(), data(), layout, None, 10, ckpt=tmp_path / "last.ckpt", rank=0)
    a, b = _weights(straight), _weights(resumed)
    for key in a:
        assert_rel_close(b[key], a[key], key, rtol=RTOL)


@pytest.mark.parametrize("graphs", [None, ["bev_encoder"]], ids=["auto", "named"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_bev_encoder_replays_on_the_sharded_bev_plane(layout, graphs):
    """With ``bev_shard`` the encoder's input is a splat's sum still pending: the default chooses the encoder too (its
    input ends sharded), and named or chosen, the sum is reduced to this rank's cells before the capture copies it;
    the run trains to the eager weights."""
    build, data = MODELS["lift_splat"]
    bev_shard = "x" if layout == "w2" else "xy"
    eager, _ = _fit(build(), data(), layout, False, STEPS, bev_shard=bev_shard)
    seen = Captures()
    model, _ = _fit(build(), data(), layout, graphs, STEPS, callbacks=[seen], bev_shard=bev_shard)
    if graphs is None:
        assert {"encoder", "bev_encoder"} <= seen.replaying, seen.replaying
    else:
        assert seen.replaying == {"bev_encoder"}, seen.replaying
    a, b = _weights(eager), _weights(model)
    for key in a:
        assert_rel_close(b[key], a[key], key, rtol=RTOL)
