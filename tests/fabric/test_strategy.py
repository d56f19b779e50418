"""Fabric under ``spatial_tp`` beyond equivalence: checkpoints, collectives over the right axis, precision plugins, the
run's state, and bad input failing before training with the Trainer strategy's messages.

The ranks are ``tests.spmd``'s gloo processes, each looking like a torchrun process to Fabric, so several ``Fabric``
objects run in one process group, one after the other.
"""

from __future__ import annotations

import itertools
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.plugins import MixedPrecision
from torch.utils.data import DataLoader
from torchmetrics.aggregation import SumMetric

from lightning_spatial import SpatialFallbackWarning, SpatialTensor, mesh, run
from lightning_spatial.fabric import SpatialParallelStrategy
from lightning_spatial.fabric.strategy import _FirstTrainingStep
from lightning_spatial.graphs import CUDAGraphed
from tests.spmd import as_torchrun, run_spmd
from tests.strategy.lit import Images, SegNet, make_model
from tests.strategy.test_equivalence import assert_same_buffers_in_every_rank, assert_same_weights
from tests.strategy.test_fallback import Cumprod
from tests.strategy.test_strategy import BAD_ARGUMENTS


def launched(devices: int, spatial, **options) -> Fabric:
    """A launched Fabric in this rank (the processes exist: torchrun's, here ``run_spmd``'s)."""
    as_torchrun()
    precision = options.pop("precision", None)
    plugins = options.pop("plugins", None)
    strategy = SpatialParallelStrategy(spatial, **options)
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision=precision, plugins=plugins)
    fabric.launch()
    return fabric


def segnet(fabric: Fabric, lr: float = 0.05):
    torch.manual_seed(0)
    model = SegNet()
    return fabric.setup(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))


def train(fabric: Fabric, model, optimizer, loader, steps: int, skip: int = 0) -> None:
    for batch in itertools.islice(loader, skip, skip + steps):
        with fabric.autocast():
            loss = F.cross_entropy(model(batch["image"]), batch["mask"])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def _save_and_resume(path: Path) -> None:
    fabric = launched(2, 2, fallback="error", cuda_graphs=["enc1"], precision="64-true")
    loader = fabric.setup_dataloaders(DataLoader(Images(8, 16, 24), batch_size=2))
    never_stopped, optimizer = segnet(fabric)
    assert isinstance(never_stopped.module.enc1, CUDAGraphed)  # eager off CUDA; checkpoints must not see it
    train(fabric, never_stopped, optimizer, loader, 4)

    stopped, optimizer = segnet(fabric)
    train(fabric, stopped, optimizer, loader, 2)
    fabric.save(path, {"model": stopped, "optimizer": optimizer, "step": 2})
    resumed, optimizer = segnet(fabric)
    state = {"model": resumed, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    assert state["step"] == 2
    train(fabric, resumed, optimizer, loader, 2, skip=2)
    assert_same_weights(resumed.module, never_stopped.module, tolerance=0)  # bit for bit

    saved = torch.load(path, weights_only=True)  # rank 0 wrote the plain model's state dict: it loads strictly
    plain = SegNet().double()
    plain.load_state_dict(saved["model"])
    assert_same_weights(plain, stopped.module, tolerance=0)
    fabric.strategy.teardown()


def test_a_checkpoint_resumes_exactly_and_loads_into_the_plain_model(tmp_path):
    run_spmd(_save_and_resume, 2, tmp_path / "state.ckpt")


def _collectives() -> None:
    """2 data replicas x 2 spatial ranks, values that differ per replica."""
    fabric = launched(4, 2)
    replica = dist.get_rank() // 2

    def value():  # a new tensor each time: Lightning reduces in place
        return torch.tensor(float(replica + 1))

    assert fabric.all_reduce(value(), reduce_op="sum") == 3  # 1 + 2 over the replicas, not 1 + 1 + 2 + 2
    assert fabric.all_reduce(value()) == 1.5
    assert torch.equal(fabric.all_gather(value()), torch.tensor([1.0, 2.0]))
    assert fabric.broadcast(dist.get_rank(), src=3) == 3  # over every rank
    assert fabric.strategy.reduce_boolean_decision(dist.get_rank() != 3) is False
    assert fabric.strategy.reduce_boolean_decision(dist.get_rank() == 3, all=False) is True
    fabric.barrier()

    data = Images(4, 16, 24)
    batch = next(iter(fabric.setup_dataloaders(DataLoader(data, batch_size=1))))  # replica r: sample r
    image = batch["image"]
    assert isinstance(image, SpatialTensor) and image.to_local().shape[-1] == 12
    torch.testing.assert_close(fabric.all_gather(image), data.images[:2, None])  # whole images, a row per replica
    torch.testing.assert_close(fabric.all_reduce(image, reduce_op="sum"), data.images[:2].sum(0, keepdim=True))

    model = SegNet()
    model.count = SumMetric()  # the set-up module's metrics sync over the data replicas
    model = fabric.setup(model)
    model.module.count.update(torch.tensor(1.0))
    assert model.module.count.compute() == 2
    fabric.strategy.teardown()
    assert run.current() is run._RUNS[0] and torch._dynamo.config.optimize_ddp is True, "the run outlived teardown"
    assert torch._dynamo.config.automatic_dynamic_shapes is True, "dynamo's automatic dynamic shapes were left off"
    assert model.module.count.process_group is None


def test_collectives_span_the_data_replicas_and_votes_every_rank():
    run_spmd(_collectives, 4)


def _buffers(devices: int, broadcasts: bool) -> None:
    fabric = launched(devices, 2, sync_batchnorm=True, fallback="error")
    model, optimizer = segnet(fabric)
    assert model._forward_module.broadcast_buffers is broadcasts  # the DistributedDataParallel
    loader = fabric.setup_dataloaders(DataLoader(Images(4, 16, 24), batch_size=4 // (devices // 2)))
    train(fabric, model, optimizer, loader, 2)
    assert_same_buffers_in_every_rank(model.module, devices)  # Fabric's all_gather would span the replicas only


@pytest.mark.parametrize("devices,broadcasts", [(2, False), (4, True)])
def test_buffers_are_broadcast_only_between_replicas(devices, broadcasts):
    """One spatial group leaves out DDP's buffer broadcast before each forward (its ranks compute the same BatchNorm
    statistics, to the bit); data-parallel replicas keep it."""
    run_spmd(_buffers, devices, devices, broadcasts)


def _precisions() -> None:
    """2 steps under every precision plugin, the loss under ``fabric.autocast()``, no fallback."""
    for precision in ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true"):
        options = {"precision": precision}
        if precision == "16-mixed":  # on CPU Fabric reads "16-mixed" as bf16: fp16 with a scaler is a plugin
            options = {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}
        fabric = launched(2, 2, fallback="error", **options)
        loader = fabric.setup_dataloaders(DataLoader(Images(4, 16, 24), batch_size=2))
        model, optimizer = segnet(fabric)
        before = [p.detach().clone() for p in model.parameters()]
        train(fabric, model, optimizer, loader, 2)
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), precision
        assert all(torch.isfinite(p).all() for p in model.parameters()), precision
        fabric.strategy.teardown()


def test_every_precision_plugin_trains_without_a_fallback():
    run_spmd(_precisions, 2)


BAD_INPUT = {  # case: what the error says
    "too narrow": "dim -1 has size 1, smaller than its 2 ranks",
    "layer output too small": r"max_pool2d: output size 1 .* \[in module 'enc2.0' \(MaxPool2d\)\]",
    "no image": "no image-sized tensor in the batch",
    "cuda_graphs": r"cuda_graphs names 'backbone', which is not a submodule of SegNet \(its children: enc1,",
    "fallback": r"Tensor.cumprod in module 'head.1' \(Cumprod\) has no spatial handler, and fallbacks are errors",
}


def _bad_input() -> None:
    """Every case raises in the first forward or before it: no backward runs."""
    for case, match in BAD_INPUT.items():
        data = {"too narrow": Images(4, 16, 1), "layer output too small": Images(4, 16, 3)}.get(case, Images(4, 16, 24))
        if case == "no image":
            data = [{"label": torch.tensor(1), "vector": torch.randn(5)}] * 4
        fabric = launched(2, 2, fallback="error", cuda_graphs=["backbone"] if case == "cuda_graphs" else False)
        with pytest.raises(Exception, match=match):
            model = SegNet()
            if case == "fallback":
                model.head = torch.nn.Sequential(model.head, Cumprod())
            model = fabric.setup(model)
            batch = next(iter(fabric.setup_dataloaders(DataLoader(data, batch_size=2))))
            model(batch["image"])
        fabric.strategy.teardown()


def test_bad_input_fails_before_training():
    run_spmd(_bad_input, 2)


def test_a_spatial_size_that_does_not_divide_the_processes_fails_before_any_starts():
    with pytest.raises(ValueError, match="spatial_size 1x3=3 does not divide the world size 2"):
        Fabric(accelerator="cpu", devices=2, strategy=SpatialParallelStrategy(3, start_method="fork"))


@pytest.mark.parametrize("kwargs,match", [*BAD_ARGUMENTS, ({"spatial_size": "auto"}, "Trainer's first training step")])
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpatialParallelStrategy(**kwargs)


def test_spatial_tp_names_the_strategy_in_fabric():
    fabric = Fabric(accelerator="cpu", devices=2, strategy="spatial_tp_fork")
    assert type(fabric.strategy) is SpatialParallelStrategy and fabric.strategy.dims.spatial_size == 2


def test_one_process_trains_in_this_process():
    """No fork for one rank (a child forked after OpenMP ran in its parent can hang); the launcher's LOCAL_RANK,
    MASTER_PORT, ... leave ``os.environ`` with it, and its world of one ends at teardown."""
    environ, groups, pid = dict(os.environ), dict(mesh._GROUPS), os.getpid()
    fabric = Fabric(accelerator="cpu", devices=1, strategy=SpatialParallelStrategy(1, start_method="fork"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpatialFallbackWarning)
        assert fabric.launch(lambda fabric: os.getpid()) == pid
    model, optimizer = segnet(fabric)
    train(fabric, model, optimizer, fabric.setup_dataloaders(DataLoader(Images(4, 16, 24), batch_size=2)), 1)
    assert dict(os.environ) == environ
    fabric.strategy.teardown()
    assert not dist.is_initialized() and mesh._GROUPS == groups


def _first_step_chooses_graphs() -> None:
    """``cuda_graphs="auto"``'s choice, on CPU (where the strategy watches nothing, and replays run eagerly): a
    validation forward does not count, the first training forward is watched, and the first backward wraps the
    chosen submodules for the run."""
    fabric = launched(2, 2, cuda_graphs=False)
    loader = fabric.setup_dataloaders(DataLoader(Images(4, 16, 24), batch_size=2))
    model, optimizer = segnet(fabric)
    step = _FirstTrainingStep(model.module)
    fabric.strategy._first_steps.append(step)
    batch = next(iter(loader))
    with torch.no_grad():
        model.eval()(batch["image"])
    assert not step.ran and not step.watch.seen
    train(fabric, model.train(), optimizer, loader, 2)
    chosen = [name for name, m in model.module.named_children() if isinstance(m, CUDAGraphed)]
    assert chosen == ["enc1", "enc2", "head"], chosen  # "up" holds no weights
    assert not fabric.strategy._first_steps and not step.watch._handles
    fabric.strategy.teardown()
    assert not any(isinstance(m, CUDAGraphed) for m in model.module.children()), "the graphs outlived the run"


def test_the_first_training_step_chooses_the_modules_to_replay():
    run_spmd(_first_step_chooses_graphs, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replays_train_to_the_eager_weights_on_one_gpu():
    """One GPU through Fabric: the named submodule replays as CUDA graphs under DDP from its third step, its
    gradients written into DDP's buckets; the same weights as eager training under the same strategy."""
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    weights = []
    for cuda_graphs in (False, ["stages"]):
        fabric = Fabric(accelerator="cuda", devices=1, strategy=SpatialParallelStrategy(1, cuda_graphs=cuda_graphs))
        fabric.launch()
        model = make_model("convnext_atto")
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        loader = fabric.setup_dataloaders(DataLoader(Images(12, 32, 64), batch_size=2))
        for batch in loader:
            fabric.backward(F.cross_entropy(model(batch["image"]), batch["label"]))
            optimizer.step()
            optimizer.zero_grad()
        if cuda_graphs:
            assert len(model.module.stages._graphs) == 1, "the stages never replayed"
        weights.append(model.module.cpu())
        fabric.strategy.teardown()
    assert_same_weights(weights[1], weights[0])
