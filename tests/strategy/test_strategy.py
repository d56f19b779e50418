"""Strategy behaviour beyond equivalence: data path, logging and metrics, checkpoints, precision, errors."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins import MixedPrecision

from lightning_spatial import SpatialParallelStrategy, SpatialTensor, gather, mesh, run
from lightning_spatial.graphs import CUDAGraphed
from lightning_spatial.primitives import SpatialDims
from tests.spmd import as_torchrun, run_spmd
from tests.strategy.lit import Images, LitModel, loader
from tests.strategy.test_equivalence import assert_same_weights


def trainer(devices=2, spatial=2, shard_dim="width", max_epochs=2, strategy=None, **kwargs):
    kwargs = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        **kwargs,
    }
    if strategy is None:
        strategy = SpatialParallelStrategy(spatial, shard_dim, start_method="fork") if spatial else "auto"
    kwargs.setdefault("accelerator", "cpu")
    return L.Trainer(devices=devices if spatial else 1, strategy=strategy, max_epochs=max_epochs, **kwargs)


class CheckBatches(L.Callback):
    """Runs inside every rank: the batch is sharded as promised and a spatial group sees the same samples."""

    def __init__(self, spatial: int, width: int):
        self.spatial, self.width = spatial, width

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        image, mask, label = batch["image"], batch["mask"], batch["label"]
        assert isinstance(image, SpatialTensor) and isinstance(mask, SpatialTensor)
        assert type(label) is torch.Tensor
        assert image.shape[-1] == self.width  # global shape
        assert image.to_local().shape[-1] == self.width // self.spatial  # only our slice was loaded
        labels = [torch.empty_like(label) for _ in range(dist.get_world_size())]
        dist.all_gather(labels, label)
        group = trainer.global_rank // self.spatial * self.spatial
        assert all(torch.equal(labels[group + i], label) for i in range(self.spatial))
        if dist.get_world_size() > self.spatial:  # another data replica: other samples (the same columns of them)
            sums = [torch.zeros(()) for _ in range(dist.get_world_size())]
            dist.all_gather(sums, image.to_local().sum())
            me = trainer.global_rank
            assert sums[(me + self.spatial) % dist.get_world_size()] != sums[me]

    def setup(self, trainer, pl_module, stage):
        self.log = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.log.append(record.getMessage())
        logging.getLogger("lightning.pytorch").addHandler(self.handler)

    def on_train_end(self, trainer, pl_module):
        for p in pl_module.parameters():
            q = p.detach().clone()
            dist.broadcast(q, 0)
            assert torch.equal(q, p.detach()), "weights differ between ranks"
        logging.getLogger("lightning.pytorch").removeHandler(self.handler)
        described = [m for m in self.log if m.startswith("lightning_spatial: sharded")]
        expected = "sharded batch tensors: ['image'] (2, 3, 16, 24), ['mask'] (2, 16, 24); replicated: ['label'] (2,)"
        assert described == ([f"lightning_spatial: {expected}"] if trainer.global_rank == 0 else []), described


@pytest.mark.parametrize("devices", [2, 4])
def test_batches_are_sharded_and_sampled_per_data_replica(devices):
    model = LitModel("segnet")
    trainer(devices, 2, callbacks=[CheckBatches(2, 24)]).fit(model, loader(Images(8, 16, 24), 2))


def test_one_process_trains_in_this_process():
    """A fork of one rank is not needed, and can hang: a child forked after OpenMP ran in its parent (libgomp)
    waited forever in its first parallel op (seen with experiment=bev_cpu strategy.spatial_size=1)."""
    pids = []

    class RecordPid(L.Callback):
        def on_train_start(self, trainer, pl_module):
            pids.append(os.getpid())

    environ, groups = dict(os.environ), dict(mesh._GROUPS)
    trainer(1, 1, max_epochs=1, callbacks=[RecordPid()]).fit(LitModel("segnet"), loader(Images(4, 16, 24), 2))
    assert pids == [os.getpid()]
    # Its world of one ended with it, and the launcher's LOCAL_RANK, MASTER_PORT, ... left os.environ (with them
    # the next Trainer took itself for a torchrun rank and waited for a second rank); no group of it stays
    # behind for forked ranks to free (a gloo group's destructor hung there). The next Trainer may fork two.
    assert not dist.is_initialized() and dict(os.environ) == environ and mesh._GROUPS == groups
    fork_two = SpatialParallelStrategy(2, start_method="fork", timeout=timedelta(seconds=60))
    trainer(2, strategy=fork_two, max_epochs=1).fit(LitModel("segnet"), loader(Images(4, 16, 24), 2))


@pytest.mark.slow
def test_validation_and_test_loops_log_what_single_device_logs():
    data = Images(8, 32, 64)
    reference, ours = LitModel("convnext_atto"), LitModel("convnext_atto")
    expected = trainer(spatial=None).validate(reference, loader(data, 4), verbose=False)[0]
    got = trainer(4, 2).validate(ours, loader(data, 2), verbose=False)[0]
    assert set(got) == {"val_loss", "val_acc"}
    for key in expected:
        assert abs(got[key] - expected[key]) <= 1e-5 * max(1.0, abs(expected[key])), (key, got[key], expected[key])
    expected = trainer(spatial=None).test(LitModel("convnext_atto"), loader(data, 4), verbose=False)[0]
    got = trainer(4, 2).test(LitModel("convnext_atto"), loader(data, 2), verbose=False)[0]
    assert abs(got["test_loss"] - expected["test_loss"]) <= 1e-5 * max(1.0, abs(expected["test_loss"]))


def _predict_in_rank():
    as_torchrun()
    data, model = Images(8, 16, 24), LitModel("segnet")
    strategy = SpatialParallelStrategy(2)  # popen, as under torchrun: no launcher, every rank returns
    t = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False, enable_progress_bar=False)
    predictions = t.predict(model, loader(data, 2))
    assert [type(p) for p in predictions] == [torch.Tensor, torch.Tensor]
    replica = dist.get_rank() // 2  # Lightning's distributed sampler gives replica r samples r, r + 2, ...
    with torch.no_grad():
        expected = model.eval().model(data.images[replica::2])
    got = torch.cat(predictions)
    assert got.shape == expected.shape == (4, 3, 16, 24)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_predict_returns_full_predictions_of_each_data_replica():
    """trainer.predict's return value, in every rank: 2 data replicas x 2 spatial ranks."""
    run_spmd(_predict_in_rank, 4)


class CheckPredictions(L.Callback):
    def __init__(self):
        self.batches = 0

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        assert type(outputs) is torch.Tensor and outputs.shape == (2, 3, 16, 24)
        expected = pl_module.model(gather(batch["image"]))  # the plain model on the full image
        assert type(expected) is torch.Tensor
        torch.testing.assert_close(outputs, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
        self.batches += 1

    def on_predict_end(self, trainer, pl_module):
        assert self.batches == 2


def test_predict_returns_full_tensors():
    """With fork, predictions stay in the workers: check them there against the plain model."""
    trainer(2, 2, callbacks=[CheckPredictions()]).predict(
        LitModel("segnet"), loader(Images(4, 16, 24), 2), return_predictions=False
    )


@pytest.mark.slow
def test_checkpoint_round_trip_and_resume(tmp_path):
    data = Images(4, 32, 64)
    uninterrupted = LitModel("convnext_atto")
    trainer(2, 2, max_epochs=4).fit(uninterrupted, loader(data, 4))

    first = LitModel("convnext_atto")
    t = trainer(2, 2, max_epochs=2, default_root_dir=tmp_path, enable_checkpointing=True)
    t.fit(first, loader(data, 4))
    path = t.checkpoint_callback.best_model_path or t.checkpoint_callback.last_model_path
    checkpoint = torch.load(path, weights_only=False)
    # a spatial checkpoint loads into the plain model on one device
    plain = LitModel("convnext_atto")
    plain.load_state_dict(checkpoint["state_dict"])
    assert_same_weights(plain, first, tolerance=0)
    # resuming gives the trajectory of not stopping
    resumed = LitModel("convnext_atto")
    trainer(2, 2, max_epochs=4).fit(resumed, loader(data, 4), ckpt_path=path)
    assert_same_weights(resumed, uninterrupted, tolerance=1e-5)


class SeesGraphs(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        assert isinstance(pl_module.model, CUDAGraphed)
        assert "model.stem.0.weight" in pl_module.state_dict()


@pytest.mark.slow
def test_cuda_graphs_wrap_for_the_run_and_checkpoints_keep_the_module_names(tmp_path):
    """Off CUDA the wrapped module runs eagerly: the same weights as without; checkpoints and the weights sent
    back to this process carry the module's own names; the module is put back after the run. (The replay itself:
    tests/test_graphs.py on one GPU, tests/strategy/test_nccl.py on two.)"""
    data = Images(4, 32, 64)
    plain = LitModel("convnext_atto")
    trainer(2, 2).fit(plain, loader(data, 4))
    ours = LitModel("convnext_atto")
    strategy = SpatialParallelStrategy(2, start_method="fork", cuda_graphs=["model"])
    t = trainer(2, 2, strategy=strategy, callbacks=[SeesGraphs()], default_root_dir=tmp_path, enable_checkpointing=True)
    t.fit(ours, loader(data, 4))
    assert type(ours.model) is not CUDAGraphed
    assert_same_weights(ours, plain, tolerance=0)
    saved = torch.load(
        t.checkpoint_callback.best_model_path or t.checkpoint_callback.last_model_path, weights_only=False
    )
    assert saved["state_dict"].keys() == plain.state_dict().keys()


class CountsNotedBuckets(L.Callback):
    def __init__(self):
        self.noted = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.noted.append(sum(p in run.current().bucket_views for p in pl_module.parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("cuda_graphs", [(), ("model",)])
def test_bucket_views_are_noted_for_replays_and_forgotten_after_the_run(cuda_graphs):
    """With ``cuda_graphs`` the comm hook notes every parameter's bucket view, where a replayed backward writes its
    gradient (lightning_spatial.graphs; off CUDA the module runs eagerly, the hook alike); without, nothing (the
    walk costs host time). After the run nothing of the model is kept: the views hold DDP's buckets alive."""
    model = LitModel("convnext_atto")
    counts = CountsNotedBuckets()
    strategy = SpatialParallelStrategy(1, cuda_graphs=cuda_graphs)
    trainer(1, 1, strategy=strategy, callbacks=[counts]).fit(model, loader(Images(4, 32, 64), 2))
    everyone = len(list(model.parameters()))
    assert counts.noted == ([everyone] * 4 if cuda_graphs else [0] * 4)
    assert not [p for r in run._RUNS for p in model.parameters() if p in r.bucket_views]


class Replayed(L.Callback):
    def on_train_end(self, trainer, pl_module):
        assert len(pl_module.model._graphs) == 1, "the model never replayed"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("accumulate", [1, 2])
def test_replays_under_ddp_train_to_the_eager_weights_on_one_gpu(accumulate):
    """One GPU through the Trainer: the model replays as CUDA graphs under DDP from its third backward, its
    gradients written straight into DDP's buckets; with accumulation the second backward adds to them. Same
    weights as eager training under the same strategy. (Two GPUs over NCCL: tests/strategy/test_nccl.py.)"""
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    data = Images(8 * accumulate, 32, 64)
    weights = []
    for cuda_graphs, callbacks in (((), []), (("model",), [Replayed()])):
        model = LitModel("convnext_atto")
        strategy = SpatialParallelStrategy(1, cuda_graphs=cuda_graphs)
        t = trainer(1, 1, strategy=strategy, accelerator="gpu", callbacks=callbacks, accumulate_grad_batches=accumulate)
        L.seed_everything(1234)
        t.fit(model, loader(data, 2))
        weights.append(model.cpu())
    assert_same_weights(weights[1], weights[0])


@pytest.mark.slow
def test_plain_checkpoint_loads_into_a_spatial_run(tmp_path):
    data = Images(4, 32, 64)
    t = trainer(spatial=None, max_epochs=1, default_root_dir=tmp_path, enable_checkpointing=True)
    t.fit(LitModel("convnext_atto"), loader(data, 4))
    reference = LitModel("convnext_atto")
    trainer(spatial=None, max_epochs=2).fit(
        reference,
        loader(data, 4),
        ckpt_path=t.checkpoint_callback.last_model_path or t.checkpoint_callback.best_model_path,
    )
    ours = LitModel("convnext_atto")
    trainer(2, 2, max_epochs=2).fit(
        ours, loader(data, 4), ckpt_path=t.checkpoint_callback.last_model_path or t.checkpoint_callback.best_model_path
    )
    assert_same_weights(ours, reference)


@pytest.mark.parametrize(
    "options",
    [
        {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"},
        {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
        {"accumulate_grad_batches": 2},
    ],
)
def test_clipping_and_accumulation_match_single_device(options):
    data = Images(4, 16, 24)
    reference, ours = LitModel("segnet"), LitModel("segnet")
    trainer(spatial=None, **options).fit(reference, loader(data, 2))
    # one data replica: keep the loader's sequential order (Lightning's sampler would shuffle training data)
    trainer(2, 2, use_distributed_sampler=False, **options).fit(ours, loader(data, 2))
    assert_same_weights(ours, reference)


def _max_relative_difference(a, b) -> float:
    return max(
        ((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item()
        for x, y in zip(a.state_dict().values(), b.state_dict().values())
        if y.is_floating_point()
    )


def _half(precision: str) -> dict:
    """Trainer arguments for mixed precision on CPU. Lightning turns the string "16-mixed" on CPU into
    bf16-mixed, so fp16 autocast with a gradient scaler is requested as an explicit plugin."""
    if precision == "bf16-mixed":
        return {"precision": precision}
    return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_is_as_close_to_single_device_as_it_is_to_fp32(precision):
    """Half precision rounds differently per tile size, so the yardstick is its own error on one device."""
    data = Images(4, 32, 64)
    fp32, half, ours = LitModel("convnext_atto"), LitModel("convnext_atto"), LitModel("convnext_atto")
    trainer(spatial=None).fit(fp32, loader(data, 4))
    trainer(spatial=None, **_half(precision)).fit(half, loader(data, 4))
    trainer(2, 2, **_half(precision)).fit(ours, loader(data, 4))
    yardstick = _max_relative_difference(half, fp32)
    assert 0 < yardstick < 0.5
    assert _max_relative_difference(ours, half) <= 2 * yardstick


class SavedTensorHooks(L.Callback):
    """A saved-tensor hook pair around every training step's forward, as memory accounting or offloading installs:
    under any such hook torch hands a checkpoint's saved inputs back as plain tensors."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        self.hooks.__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        self.hooks.__exit__(None, None, None)


@pytest.mark.slow
@pytest.mark.parametrize("hooks", [False, True], ids=["plain", "saved-tensor-hooks"])
def test_activation_checkpointing_matches_single_device(hooks):
    """timm's gradient checkpointing (torch's non-reentrant checkpoint): the recomputed forward runs on shards,
    with or without saved-tensor hooks around the step (with them, the recompute once ran on the bare local
    shards: convolutions without halos)."""
    data = Images(4, 32, 64)
    reference, ours = LitModel("convnext_atto"), LitModel("convnext_atto")
    for m in (reference, ours):
        m.model.set_grad_checkpointing(True)
    trainer(spatial=None).fit(reference, loader(data, 4))
    trainer(2, 2, callbacks=[SavedTensorHooks()] if hooks else []).fit(ours, loader(data, 4))
    assert_same_weights(ours, reference)


def _stalled_neighbour():
    mesh = SpatialDims(2, 1, 2).build("cpu", timedelta(seconds=2))
    if dist.get_rank() == 1:
        time.sleep(8)  # never joins the exchange
        return
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="[Tt]imed out"):
        dist.all_reduce(torch.ones(1), group=mesh.get_group("spatial_w"))
    assert time.monotonic() - start < 6


@pytest.mark.slow
def test_a_stalled_neighbour_raises_after_the_timeout():
    """Every mesh group gets the strategy's timeout (init_device_mesh's subgroups waited 30 min)."""
    run_spmd(_stalled_neighbour, 2, timeout=30)


def test_spatial_dims_validate_without_processes():
    dims = SpatialDims.from_strategy_args(8, (2, 2), "width", default=8)
    assert (dims.data, dims.spatial_h, dims.spatial_w) == (2, 2, 2)
    assert dims.coordinates(5) == (1, 0, 1)
    assert SpatialDims.from_strategy_args(4, 4, "height", default=4).shape == (1, 4, 1)
    with pytest.raises(ValueError, match="spatial_size 1x3=3 does not divide the world size 4"):
        SpatialDims.from_strategy_args(4, 3, "width", default=4)
    with pytest.raises(ValueError, match="shard_dim must be one of"):
        SpatialDims.from_strategy_args(4, 2, "depth", default=4)


class NoStep(L.Callback):
    """Runs in every rank: the first backward means training started before the error; fail with that."""

    def on_before_backward(self, trainer, pl_module, loss):
        raise AssertionError("a training step ran before the error")


@pytest.mark.parametrize(
    "case,match",
    [
        ("indivisible", "spatial_size 1x3=3 does not divide the world size 2"),
        ("too narrow", "dim -1 has size 1, smaller than its 2 ranks"),
        ("layer output too small", r"max_pool2d: output size 1 .* \[in module 'model.enc2.0' \(MaxPool2d\)\]"),
        ("no image", "no image-sized tensor in the batch"),
        ("cuda_graphs", r"cuda_graphs names 'backbone', which is not a submodule of LitModel \(its children: model,"),
    ],
)
def test_bad_input_fails_before_training(case, match):
    t, data = trainer(2, 2, callbacks=[NoStep()]), Images(4, 16, 24)
    if case == "cuda_graphs":
        strategy = SpatialParallelStrategy(2, start_method="fork", cuda_graphs=["backbone"])
        t = trainer(2, 2, strategy=strategy, callbacks=[NoStep()])
    if case == "indivisible":
        t = trainer(2, 3, callbacks=[NoStep()])
    elif case == "too narrow":
        data = Images(4, 16, 1)
    elif case == "layer output too small":
        data = Images(4, 16, 3)  # 2 + 1 columns; SegNet's first max pool leaves 1 column for 2 ranks
    else:
        data = [{"label": torch.tensor(1), "vector": torch.randn(5)}] * 4
    with pytest.raises(Exception, match=match):
        t.fit(LitModel("segnet"), loader(data, 2))


BAD_ARGUMENTS = [  # (constructor arguments, the error), the same for the Fabric strategy (tests/fabric)
    ({"spatial_size": (2, 2, 1)}, r"spatial_size must be .* got \(2, 2, 1\)"),
    ({"spatial_size": 2.5}, "spatial_size must be .* got 2.5"),
    ({"spatial_size": True}, "spatial_size must be .* got True"),
    ({"spatial_size": (2, 0)}, "spatial_w must be a positive int, got 0"),
    ({"spatial_size": 2, "shard_dim": "channels"}, "shard_dim must be one of .'width', 'height'., got 'channels'"),
    ({"fallback": "loud"}, "fallback must be 'warn', 'error' or 'silent', got 'loud'"),
    ({"cuda_graphs": "model"}, "cuda_graphs must be 'auto' \\(the default\\), False, or a list of submodule names"),
    ({"bev_planes": {"bev_queries": (0, 1)}}, "bev_planes=.* set bev_shard \\('x', 'y' or 'xy'\\) too"),
    ({"bev_shard": "x", "bev_planes": {"bev_queries": 0}}, "bev_planes maps a parameter's name to the dims of its"),
    ({"bev_shard": "x", "bev_planes": {"bev_queries": (0, 1, 2)}}, "got {'bev_queries': \\(0, 1, 2\\)}"),
    ({"bev_shard": "x", "bev_planes": ["bev_queries"]}, "e.g. {'bev_queries': \\(0, 1\\)} .*; got \\['bev_queries'\\]"),
]


@pytest.mark.parametrize("kwargs,match", BAD_ARGUMENTS)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpatialParallelStrategy(**kwargs)
