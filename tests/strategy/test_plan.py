"""``spatial_size="auto"``: the estimate against a real rank's measured memory, the choice on made-up budgets, the
plan in the log, the probe leaving the module and the random streams as they were, and the errors."""

from __future__ import annotations

import json
import logging
import random

import lightning as L
import numpy as np
import pytest
import torch

from lightning_spatial import SpatialParallelStrategy, SpatialTensor, collectives, halo
from lightning_spatial.mesh import Axis
from lightning_spatial.plan import Estimate, choose, layouts, parse_budget
from lightning_spatial.primitives import SpatialDims
from lightning_spatial.run import Run, entered
from lightning_spatial.saved import SavedActivations
from tests.spmd import as_torchrun, run_spmd
from tests.strategy.lit import Images, LitModel, loader, make_model


def _fit(devices: int, spatial, callbacks, data, memory_budget=None, shuffle=False) -> None:
    budget = {"memory_budget": memory_budget} if spatial == "auto" else {}
    L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=SpatialParallelStrategy(spatial, start_method="fork", **budget),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    ).fit(LitModel(data.name), torch.utils.data.DataLoader(data, batch_size=2, shuffle=shuffle))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _state_bytes(module: torch.nn.Module, optimizers) -> int:
    """Parameters, buffers, gradients (every trainable parameter: DDP's buckets hold them) and optimizer state."""
    params = list(module.parameters())
    state = sum(_nbytes(t) for t in (*params, *module.buffers())) + sum(_nbytes(p) for p in params if p.requires_grad)
    moments = [t for opt in optimizers for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return state + sum(_nbytes(t) for t in moments)


class Measure(L.Callback):
    """In every rank: the bytes of its first training step, as the CPU estimate counts them (model state after the
    step, its batch shard, and the tensors autograd saved in its forward), written to ``<out>/<rank>.json``; rank 0
    of an automatic plan also writes every candidate's estimate."""

    def __init__(self, out):
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.inputs = sum(_nbytes(t.to_local() if isinstance(t, SpatialTensor) else t) for t in batch.values())
        self.saved = SavedActivations(pl_module)
        self.saved.__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        self.saved.__exit__(None, None, None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        state = _state_bytes(pl_module, trainer.optimizers)
        record = {"state": state, "measured": state + self.inputs + self.saved.nbytes}
        plan = trainer.strategy.plan
        if plan is not None:
            record["estimates"] = {f"{e.tiles[0]}x{e.tiles[1]}": e.bytes for e in plan.estimates}
        (self.out / f"{trainer.global_rank}.json").write_text(json.dumps(record))


def _read(path, ranks: int) -> list[dict]:
    return [json.loads((path / f"{r}.json").read_text()) for r in range(ranks)]


class Data(Images):
    def __init__(self, name: str, height: int, width: int):
        super().__init__(4, height, width)
        self.name = name


@pytest.mark.parametrize(
    "model, height, width",
    [("segnet", 32, 96), pytest.param("convnext_atto", 128, 256, marks=pytest.mark.slow)],
)
def test_estimate_is_within_15_percent_of_a_real_rank(model, height, width, tmp_path):
    """Rank 0's estimate for each layout of 2 ranks against the bytes measured in every rank of a real run of it,
    the whole and the part above the model state (the activations, which the test's sizes make the larger part)."""
    data = Data(model, height, width)
    (tmp_path / "auto").mkdir()
    _fit(2, "auto", [Measure(tmp_path / "auto")], data, memory_budget="1TiB")  # everything fits: all probed
    estimates = _read(tmp_path / "auto", 2)[0]["estimates"]
    assert set(estimates) == {"1x2", "2x1", "1x1"}
    for name, spatial in (("1x2", 2), ("2x1", (2, 1)), ("1x1", 1)):
        (tmp_path / name).mkdir()
        _fit(2, spatial, [Measure(tmp_path / name)], data)
        ranks = _read(tmp_path / name, 2)
        measured, state = max(r["measured"] for r in ranks), ranks[0]["state"]
        assert measured - state > 0.4 * state  # the activations are a large part of what is compared
        estimate = estimates[name]
        print(f"{model} {name}: estimate {estimate} B, measured {measured} B (state {state} B)")
        assert abs(estimate - measured) <= 0.15 * measured, (name, estimate, measured)
        assert abs((estimate - state) - (measured - state)) <= 0.15 * (measured - state), (name, estimate, measured)


def _one_device_bytes(data: Data) -> int:
    """The plain model's first step on one device, measured here: model state, batch, tensors saved for backward."""
    module = LitModel(data.name)
    optimizer = module.configure_optimizers()
    batch = next(iter(loader(data, 2)))
    inputs = sum(_nbytes(t) for t in batch.values())
    saved = SavedActivations(module)
    with saved:
        loss = module._loss(batch)[0]
    loss.backward()
    optimizer.step()
    return _state_bytes(module, [optimizer]) + inputs + saved.nbytes


class Shuffled(Data):
    """Draws from Python's and NumPy's random streams too, as augmentations do."""

    def __getitem__(self, i):
        random.random(), np.random.rand()
        return super().__getitem__(i)


class CheckPlan(L.Callback):
    """In every rank: the mesh is the expected one, the probe left the module and every random stream as they
    were, and rank 0 logged the plan."""

    def __init__(self, tiles: tuple[int, int]):
        self.tiles = tiles

    def setup(self, trainer, pl_module, stage):  # before the strategy's setup, where the probe runs
        self.streams = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        self.log = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.log.append(record.getMessage())
        logging.getLogger("lightning.pytorch").addHandler(self.handler)

    def on_fit_start(self, trainer, pl_module):
        logging.getLogger("lightning.pytorch").removeHandler(self.handler)
        assert trainer.strategy.dims == SpatialDims(4, *self.tiles)
        plans = [m for m in self.log if m.startswith("lightning_spatial: plan:")]
        h, w = self.tiles
        expected = f"lightning_spatial: plan: data {4 // (h * w)} x spatial {h * w} (tiles {h}x{w}, height x width)"
        assert [p.startswith(expected) for p in plans] == ([True] if trainer.global_rank == 0 else []), plans
        if trainer.global_rank == 0:  # the leader: its streams are the spatial group's
            (chosen,) = [line for line in plans[0].splitlines() if line.endswith("<- chosen")]
            assert chosen.startswith(f"  {h}x{w} (") and "fits" in chosen, plans[0]
            assert torch.equal(torch.get_rng_state(), self.streams[0]), "the probe moved torch's random stream"
            _, keys, position, *_ = np.random.get_state()
            assert np.array_equal(keys, self.streams[1][1]) and position == self.streams[1][2], "NumPy's stream moved"
            assert random.getstate() == self.streams[2], "the probe moved Python's random stream"
        fresh = make_model(pl_module.name)
        for (name, got), want in zip(pl_module.model.state_dict().items(), fresh.state_dict().values()):
            assert torch.equal(got, want), f"the probe changed {name}"  # weights and BatchNorm statistics
        assert all(p.grad is None for p in pl_module.parameters())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        image = batch["image"]
        h, w = self.tiles
        assert image.to_local().shape[-2:] == (image.shape[-2] // h, image.shape[-1] // w)


@pytest.mark.parametrize(
    "height, width, fraction, tiles",
    [
        (32, 96, 0.8, (1, 2)),  # wide: a width split cuts the short side
        (96, 32, 0.8, (2, 1)),  # tall: a height split
        pytest.param(64, 64, 0.38, (2, 2), marks=pytest.mark.slow),  # square, and only 4 ranks fit: 2x2 tiles
    ],
)
def test_a_made_up_budget_chooses_the_smallest_spatial_size_that_fits(height, width, fraction, tiles):
    """4 processes; the budget is a fraction of what one device needs, measured here without the strategy: one
    device does not fit, so 2 data replicas x 2 spatial ranks (or 1 x 4), along the dim with the fewest halo bytes."""
    data = Shuffled("segnet", height, width)
    budget = int(fraction * _one_device_bytes(data))
    _fit(4, "auto", [CheckPlan(tiles)], data, memory_budget=budget, shuffle=True)


def test_nothing_fits_names_every_candidate_and_what_to_do():
    message = r"RuntimeError: lightning_spatial: no spatial layout fits the memory budget of 1\.00 KiB per rank"
    with pytest.raises(Exception, match=message) as raised:
        _fit(2, "auto", [], Data("segnet", 32, 96), memory_budget="1KiB")
    text = str(raised.value)
    assert "1x2 (width): " in text and "2x1 (height): " in text and text.count("over budget") == 2, text
    assert "1x1 (one device): not probed: a larger spatial size did not fit" in text  # the search stopped
    assert "memory_budget=" in text


def test_choice_on_made_up_estimates():
    """The smallest size with a layout that fits; among its layouts the fewest halo bytes; layouts that did not run
    are no candidates."""
    estimates = [
        Estimate((1, 4), 10, 40),
        Estimate((4, 1), 10, 30),
        Estimate((2, 2), note="does not run: LayoutError: too thin"),
        Estimate((1, 2), 50, 20),
        Estimate((2, 1), 45, 10),
        Estimate((1, 1), 90),
    ]
    plan = choose(8, estimates, 60, "made up")
    assert plan.dims == SpatialDims(8, 2, 1) and plan.chosen is estimates[4]
    assert choose(8, estimates, 100, "made up").dims == SpatialDims(8, 1, 1)
    assert choose(8, estimates, 20, "made up").dims == SpatialDims(8, 4, 1)  # fewer halo bytes than 1x4
    assert "2x1 (height): 45 B, halo 10 B/step, fits  <- chosen" in plan.describe()
    with pytest.raises(RuntimeError, match="no spatial layout fits") as raised:
        choose(8, estimates, 5, "made up")
    assert "2x2 (tiles): does not run: LayoutError: too thin" in str(raised.value)


def test_candidates_are_the_sizes_dividing_a_node_largest_first():
    assert layouts(4) == [(1, 4), (4, 1), (2, 2), (1, 2), (2, 1), (1, 1)]
    assert layouts(6)[:4] == [(1, 6), (6, 1), (2, 3), (3, 2)] and layouts(6)[-3:] == [(1, 2), (2, 1), (1, 1)]
    assert (2, 4) in layouts(8) and (4, 2) in layouts(8) and len(layouts(8)) == 10
    assert layouts(1) == [(1, 1)]


def test_budgets_parse_and_bad_ones_raise_before_any_process():
    assert parse_budget("70GiB") == 70 * 2**30 and parse_budget("500 MB") == 500 * 10**6
    assert parse_budget(12345) == 12345 and parse_budget(None) is None
    for bad in ("lots", "12 parsecs", -1, 0, True):
        with pytest.raises(ValueError, match="memory_budget must be a positive number"):
            SpatialParallelStrategy("auto", memory_budget=bad)
    with pytest.raises(ValueError, match="memory_budget is for spatial_size='auto'"):
        SpatialParallelStrategy(2, memory_budget="1GiB")


def test_validate_alone_has_no_training_batch_to_plan_from():
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SpatialParallelStrategy("auto", start_method="fork"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(Exception, match="plans from the first training batch, and this Trainer has no training data"):
        trainer.validate(LitModel("segnet"), loader(Images(4, 16, 32), 2), verbose=False)


def _fit_then_validate_in_rank():
    as_torchrun()
    data = loader(Images(4, 16, 32), 2)
    strategy = SpatialParallelStrategy("auto", memory_budget="1TiB")  # popen, as under torchrun: every rank returns
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, enable_progress_bar=False
    )
    trainer.fit(LitModel("segnet"), data)
    plan = strategy.plan
    assert plan is not None and plan.dims == SpatialDims(2, 1, 1)  # everything fits: the smallest size
    assert trainer.validate(trainer.lightning_module, data, verbose=False)[0]["val_loss"] > 0
    assert strategy.plan is plan  # validate reuses the plan: no training step to probe there


def test_other_stages_reuse_the_plan_of_the_fit():
    run_spmd(_fit_then_validate_in_rank, 2)


def _halos_read_as_zeros():
    fake = torch.distributed.new_group([0, 1], backend="fake")
    if torch.distributed.get_rank() != 0:
        return
    for inside in (False, True):
        received, pieces = torch.full((3,), float("nan")), [torch.full((2,), float("nan")) for _ in range(2)]
        with entered(Run(zero_undelivered=inside)):
            halo._p2p(fake, [], [(1, received)])
            torch.distributed.all_gather(pieces, torch.ones(2), group=fake)
        assert torch.equal(received, torch.zeros(3)) == inside, received  # nothing arrives
        assert torch.equal(torch.stack(pieces), torch.ones(2, 2))  # the fake all-gather copies this rank's piece


def test_halos_the_fake_groups_never_deliver_read_as_zeros():
    """A NaN in a halo would stop a detector's Hungarian matching in the probe."""
    run_spmd(_halos_read_as_zeros, 2)


def _collectives_read_as_zeros():
    fake = Axis.from_group(torch.distributed.new_group([0, 1], backend="fake"))
    if torch.distributed.get_rank() != 0:
        return
    uninitialised = torch.empty_like
    torch.empty_like = lambda t, **kw: uninitialised(t, **kw).fill_(float("nan"))  # memory as a GPU may hand it out
    try:
        with entered(Run(zero_undelivered=True)):
            received = collectives._receiving(torch.ones(3))
            summed = collectives.reduce_scatter(torch.ones(4, 2), 0, fake)  # torch 2.11's fake group writes nothing
            gathered = collectives.all_gather(torch.ones(2, 2), 0, fake, 4)
        with entered(Run(zero_undelivered=False)):
            assert collectives._receiving(torch.ones(3)).isnan().all()  # a real group's buffer: written by it
    finally:
        torch.empty_like = uninitialised
    assert torch.equal(received, torch.zeros(3))
    assert not summed.isnan().any() and not gathered.isnan().any(), (summed, gathered)


def test_what_the_fake_collectives_never_deliver_reads_as_zeros():
    """A reduce-scatter's buffer (a sharded BEV grid's sums) that a fake group leaves unwritten would put NaN into
    every gradient of a ``FakeRank`` run: it reads as zeros."""
    run_spmd(_collectives_read_as_zeros, 2)


class CheckBatches(L.Callback):
    """In every rank: the accumulation the global batch asks for, and rank 0's log line of what the plan made of the
    batches (set up before the strategy's setup, read when training starts, after the strategy's line)."""

    def __init__(self, accumulation: int, line: str):
        self.accumulation, self.line = accumulation, line

    def setup(self, trainer, pl_module, stage):
        self.log = []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.log.append(record.getMessage())
        logging.getLogger("lightning.pytorch").addHandler(self.handler)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        logging.getLogger("lightning.pytorch").removeHandler(self.handler)
        assert trainer.accumulate_grad_batches == self.accumulation
        lines = [m for m in self.log if "global batch" in m]
        assert lines == ([self.line] if trainer.global_rank == 0 else []), lines

    def on_train_end(self, trainer, pl_module):
        assert trainer.global_step == 2  # 2 epochs of 8 samples, 8 per optimizer step


def _fit_global_batch(data, batch_size: int, global_batch_size: int | None, callbacks, model) -> None:
    strategy = SpatialParallelStrategy(
        "auto", memory_budget="1TiB", global_batch_size=global_batch_size, start_method="fork"
    )
    L.Trainer(
        accelerator="cpu",
        devices=2 if global_batch_size else 1,
        strategy=strategy if global_batch_size else "auto",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    ).fit(model, loader(data, batch_size))


def test_a_global_batch_is_kept_by_accumulating_gradients_to_the_single_device_weights():
    """2 processes, everything fits: 2 data replicas of batch 2, so global_batch_size=8 accumulates 2 batches per
    step, and training reaches the weights of one device on batches of 8 (ConvNeXt: no batch statistics; each step
    takes all 8 samples, whatever order the distributed sampler shuffles them in)."""
    from tests.strategy.test_equivalence import assert_same_weights

    data = Images(8, 32, 64)
    torch.manual_seed(0)
    reference = LitModel("convnext_atto")
    _fit_global_batch(data, 8, None, [], reference)
    torch.manual_seed(0)
    ours = LitModel("convnext_atto")
    line = (
        "lightning_spatial: plan: 2 data-parallel replica(s) x 2 samples per batch x 2 accumulated batch(es) = a "
        "global batch of 8 samples per optimizer step; 1 optimizer step(s) per epoch (2 batches per replica)"
    )
    _fit_global_batch(data, 2, 8, [CheckBatches(2, line)], ours)
    assert_same_weights(ours, reference)


def test_an_unreachable_global_batch_names_the_sizes_and_what_to_do():
    message = (
        r"global_batch_size=6 is not reachable: the plan has 2 data-parallel replica\(s\) \(spatial size 1 on 2 "
        r"processes\) of 2 samples per batch, so gradients accumulated over whole batches make multiples of 4\. Use a "
        r"multiple of 4 \(say global_batch_size=4\)"
    )
    with pytest.raises(Exception, match=message):
        _fit_global_batch(Images(8, 16, 32), 2, 6, [], LitModel("segnet"))


def test_global_batch_size_is_for_an_automatic_plan_and_positive():
    with pytest.raises(ValueError, match=r"global_batch_size is for spatial_size='auto', got spatial_size=2"):
        SpatialParallelStrategy(2, global_batch_size=8)
    with pytest.raises(ValueError, match=r"global_batch_size must be an integer >= 1, got 0"):
        SpatialParallelStrategy("auto", global_batch_size=0)


def test_a_module_that_checks_its_batches_plans_in_another_precision():
    """The probe hands the module's batch hooks the batch in the precision's dtype before the Trainer converts the
    module: a check of the images' dtype belongs in forward, which the probe runs on the converted copy."""
    from lightning_spatial.models import ImageTask

    L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SpatialParallelStrategy("auto", memory_budget="1TiB", start_method="fork"),
        precision="64-true",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    ).fit(ImageTask("resnet18", "segmentation"), loader(Images(4, 32, 64), 2))
