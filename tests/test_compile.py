"""``torch.compile`` under ``spatial_tp``: compiled modules train exactly as the eager module does on one device.

Dynamo cannot trace a ``SpatialTensor`` (docs/design.md, "torch.compile"), so for the length of a run the
strategy makes compiled code run its original eager code where activations are sharded
(``_scopes.compiling_eagerly``); a compiled module met by a shard otherwise raises.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import timm
import torch

from lightning_spatial import SpatialParallelStrategy, SpatialTensor, shard, tensor
from lightning_spatial.strategies._scopes import compiling_eagerly
from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd
from tests.strategy.lit import Images, LitModel
from tests.strategy.test_equivalence import SameWeightsInTheRanks, assert_same_weights, fit, single_device


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2)
        )
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.features(x).mean((-2, -1)))


_graphs = []  # compiled by ``_counting`` in this process (each forked rank has its own; the parent compiles nothing)


def _counting(gm, inputs):
    _graphs.append(gm)
    return gm.forward


def _never(gm, inputs):
    raise AssertionError("a graph was compiled from code that met a SpatialTensor")


def _compiled_case(layout, name):
    torch.manual_seed(0)
    model = Tiny() if name == "tiny" else timm.create_model(name, pretrained=False, num_classes=3)
    model = model.double().train()
    ours = copy.deepcopy(model)
    compiled = torch.compile(ours, backend=_never)
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    with compiling_eagerly(ours):
        check(
            lambda x: compiled(x) if isinstance(x, SpatialTensor) else model(x),
            [x],
            sharded=[0],
            axes=axes(layout),
            modules=(model, ours),
        )


@pytest.mark.parametrize("layout,name", [("w2", "tiny"), ("2x2", "tiny"), ("w2", "resnet10t")])
def test_a_compiled_model_gives_the_eager_outputs_and_gradients_on_shards(layout, name):
    run_spmd(_compiled_case, LAYOUTS[layout][0], layout, name)


def _eager_scope_case():
    root = torch.nn.Sequential(torch.compile(torch.nn.Linear(2, 2), backend=_counting))
    with pytest.warns(UserWarning, match="torch.compile is off under spatial_tp: '0' runs its original eager code"):
        with compiling_eagerly(root):
            root(torch.ones(1, 2))
    assert not _graphs
    root(torch.ones(1, 2))
    assert len(_graphs) == 1


def test_compiled_code_runs_eagerly_for_the_run_only_and_is_named():
    run_spmd(_eager_scope_case, 1)  # in a child: compiling here would keep later tests from forking ranks


class CompiledInside(LitModel):
    """The backbone compiled inside the module, the other common way to use ``torch.compile``."""

    def __init__(self, name: str, backend="inductor"):
        super().__init__(name)
        self.model = torch.compile(self.model, backend=backend)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["module", "submodule"])
def test_trainer_fits_a_compiled_module_to_the_single_device_weights(how):
    data = Images(4, 16, 24)
    reference = single_device("segnet", data, 4)
    ours = LitModel("segnet") if how == "module" else CompiledInside("segnet")
    fit(torch.compile(ours) if how == "module" else ours, SpatialParallelStrategy(2, start_method="fork"), 2, data, 4)
    assert_same_weights(ours, reference, tolerance=1e-5)


@pytest.mark.slow
def test_trainer_fits_a_compiled_timm_model_in_float64_on_2x2_tiles():
    data = Images(4, 64, 64)
    reference = LitModel("resnet10t")
    fit(reference, "auto", 1, data, 4, precision="64-true")
    check = SameWeightsInTheRanks(reference.double(), tolerance=1e-12, zero_floor=1e-12)
    strategy = SpatialParallelStrategy((2, 2), start_method="fork")
    fit(torch.compile(LitModel("resnet10t")), strategy, 4, data, 4, precision="64-true", callbacks=[check])


class Compiled(L.Callback):
    def on_train_end(self, trainer, pl_module):
        assert all(e.bytes for e in trainer.strategy.plan.estimates), trainer.strategy.plan.describe()
        assert _graphs, "nothing is sharded, yet the compiled module ran eagerly"


@pytest.mark.slow
def test_a_plan_without_spatial_axes_compiles_and_its_probe_steps_a_copy():
    """Every layout fits 1 TiB, so the automatic plan is 2 data replicas of one rank: nothing is sharded and the
    module compiles as under DDP; both replicas see all 4 images, as one device does. The probe runs every
    candidate, sharded ones too, eagerly and on a copy: Lightning sets a compiled module's steps on the module
    itself, bound to it, which a copy would step."""
    data = Images(4, 16, 24)
    reference = single_device("segnet", data, 4)
    ours = CompiledInside("segnet", backend=_counting)
    strategy = SpatialParallelStrategy("auto", memory_budget="1TiB", start_method="fork")
    compiled = torch.compile(ours, backend=_counting)
    fit(compiled, strategy, 2, data, 4, use_distributed_sampler=False, callbacks=[Compiled()])
    assert_same_weights(ours, reference, tolerance=1e-5)


def _outside_case():
    compiled = torch.compile(torch.nn.Conv2d(1, 1, 3, padding=1))
    with pytest.raises(RuntimeError, match=r"cannot trace a SpatialTensor.*set_stance\('force_eager'\)"):
        compiled(shard(torch.zeros(1, 1, 4, 8), axes("w2")))


def test_compiling_over_a_shard_outside_the_strategy_says_what_to_do():
    run_spmd(_outside_case, 2)


def _opaque_case():
    torch._dynamo.config.nontraceable_tensor_subclasses.add(SpatialTensor)  # this forked rank only
    tensor._compiling = lambda: False  # dynamo may read the shard (our refusal off)
    width = torch.compile(lambda x: torch.full((1,), float(x.shape[-1])), backend="eager")
    try:
        seen = [width(shard(torch.zeros(1, 1, 1, w), axes("w2"))).item() for w in (8, 9)]
    except AssertionError as err:  # torch 2.11: its guard x.shape[3] == 8 fails on the shard it was built from
        assert "Guard failed on the same frame it was created" in str(err), err
        return
    assert seen == ([8.0, 9.0] if torch.distributed.get_rank() == 0 else [8.0, 8.0]), seen


def test_why_not_graph_breaks_dynamo_guards_the_shard_size_where_it_read_the_global_one():
    """The canary of docs/design.md ("torch.compile"): with a SpatialTensor opaque to dynamo, a graph built from
    the global width 8 (shards 4 + 4) is reused on rank 1 for width 9 (shards 5 + 4), whose shard is 4 wide too.
    (torch 2.11's dynamo notices its guard failing at once and raises.) When this fails, dynamo guards what it
    read, and graph breaks at sharded ops may be worth their cost."""
    run_spmd(_opaque_case, 2)
