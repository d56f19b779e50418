"""``torch.compile`` through shards: dynamo traces the op layer, halo exchanges and collectives become graph ops,
and compiled code trains exactly as the eager module does on one device (docs/design.md, "torch.compile")."""

from __future__ import annotations

import copy
import functools
import warnings

import lightning as L
import pytest
import timm
import torch
import torch.nn.functional as F
from torch._dynamo.backends.registry import lookup_backend

from lightning_spatial import SpatialParallelStrategy, SpatialTensor, gather, shard
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


_graphs = []  # graphs compiled by ``recording`` in this process (each forked rank has its own)


def recording(backend: str = "aot_eager"):
    """A backend that keeps every graph dynamo hands it, then compiles it with ``backend``."""

    def compile_graph(gm, inputs):
        _graphs.append(gm)
        return lookup_backend(backend)(gm, inputs)

    return compile_graph


def _ops(graph) -> set[str]:
    return {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}


def _compiled_case(layout, name, backend, eager_first=False):
    torch.manual_seed(0)
    model = Tiny() if name == "tiny" else timm.create_model(name, pretrained=False, num_classes=3)
    model = model.double().train()
    ours = copy.deepcopy(model)
    compiled = torch.compile(ours, backend=recording(backend), fullgraph=True)
    x = torch.randn(2, 3, 64, 66 if layout == "w3" else 64, dtype=torch.float64)
    # the second compiled step replays the graph: no recompilation; an eager step first fills the op layer's caches
    for step in [ours] * eager_first + [compiled, compiled]:
        check(
            lambda x, step=step: step(x) if isinstance(x, SpatialTensor) else model(x),
            [x],
            sharded=[0],
            axes=axes(layout),
            modules=(model, ours),
        )
    assert len(_graphs) == 1, f"{len(_graphs)} graphs: one whole graph expected, compiled once"
    assert "lightning_spatial.exchange.default" in _ops(_graphs[0]), _ops(_graphs[0])  # halos are graph ops


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,name,backend,eager_first",
    [
        ("w3", "tiny", "aot_eager", False),
        ("2x2", "resnet10t", "aot_eager", False),
        ("h2", "convnext_atto", "aot_eager", False),
        ("w2", "tiny", "aot_eager", True),
        ("w2", "tiny", "inductor", False),
    ],
)
def test_a_compiled_model_gives_the_eager_outputs_and_gradients_on_shards(layout, name, backend, eager_first):
    """Compiled once as one whole graph, halos graph ops; also after an eager step (caches the op layer filled
    then were met by dynamo: a graph break that sent shards into a later graph at their global sizes)."""
    run_spmd(_compiled_case, LAYOUTS[layout][0], layout, name, backend, eager_first, timeout=600)


def _message_case():
    torch.manual_seed(4)
    model = torch.nn.Sequential(  # a pointwise producer, then a depthwise convolution (halos), channels_last
        torch.nn.Conv2d(4, 8, 1), torch.nn.GELU(), torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
    ).to(memory_format=torch.channels_last)
    ours = copy.deepcopy(model)
    compiled = torch.compile(ours, backend=recording("inductor"), fullgraph=True)
    x = torch.randn(2, 4, 6, 12)  # the activations are channels_last (the weights are), as in ConvNeXt
    run = lambda x: compiled(x) if isinstance(x, SpatialTensor) else model(x)  # noqa: E731
    check(run, [x], sharded=[0], axes=axes("w2"), modules=(model, ours))

    def step():
        compiled(shard(x, axes("w2")).requires_grad_()).to_local().sum().backward()

    step()  # compiles for a shard that is itself the leaf
    with torch.profiler.profile() as prof:
        step()
    exchanges = [e for e in prof.events() if e.name == "lightning_spatial::exchange"]
    outermost = [e for e in exchanges if e.cpu_parent is None or e.cpu_parent.name != e.name]  # dispatch nests them
    assert len(outermost) == 2, [e.name for e in prof.events()]  # the forward's and the backward's

    def copies(event):
        return [c.name for c in event.cpu_children if c.name in ("aten::copy_", "aten::clone")] + [
            name for c in event.cpu_children for name in copies(c)
        ]

    assert not [name for e in exchanges for name in copies(e)], "a message was copied inside the exchange"


@pytest.mark.slow
def test_compiled_messages_are_written_by_their_producers():
    """Messages reach the exchange as one flat buffer written by the kernels that compute them, in the forward and
    the backward: no copy of its own inside the op (inductor lays out a traced ``contiguous()`` as it likes: a
    channels_last strip then cost the op a copy per message, 0.7 ms of a bf16 ConvNeXt-XL step at S = 8 on the
    H200), and the results are the eager ones."""
    run_spmd(_message_case, 2, timeout=600)


def _global_size_case():
    def f(x):
        return x * torch.arange(x.shape[-1], dtype=x.dtype)  # the global width, read from the shard

    compiled = torch.compile(f, backend=recording(), fullgraph=True)
    for width in (8, 9):  # shards 4 + 4, then 5 + 4: rank 1's shard is 4 wide both times
        full = torch.randn(1, 2, 3, width)
        ours = compiled(shard(full, axes("w2")))
        torch.testing.assert_close(gather(ours), f(full), rtol=0, atol=0)
    assert len(_graphs) == 2, "each global width needs its own graph"


def test_a_graph_is_guarded_on_the_global_size_it_read():
    """Dynamo guards the layout it read the global width from, not only the shard's size: rank 1's graph for width
    8 is not reused for width 9, whose shard on rank 1 is as wide (what made graphs of opaque shards unsafe)."""
    run_spmd(_global_size_case, 2)


def _nested_case(layout, op):
    torch.manual_seed(3)
    ops = {
        "topk": lambda x: x.flatten(2).topk(5).values,  # values taken along global indices: a nested take_along_dim
        "attention": lambda x: F.scaled_dot_product_attention(*[x.flatten(2).transpose(1, 2)] * 3),  # tokens
    }
    compiled = torch.compile(ops[op], backend=recording(), fullgraph=True)
    x = torch.randn(2, 4, 6, 10, dtype=torch.float64)
    check(lambda x: compiled(x) if isinstance(x, SpatialTensor) else ops[op](x), [x], sharded=[0], axes=axes(layout))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["w3", "2x2"])
@pytest.mark.parametrize("op", ["topk", "attention"])
def test_handlers_that_call_torch_on_shards_are_traced_through(layout, op):
    """Dynamo would trace a handler's own torch calls on shards as plain ops (lightning_spatial.compiling)."""
    run_spmd(_nested_case, LAYOUTS[layout][0], layout, op)


def _fallback_case():
    op = lambda x: x.cumprod(-1) * 2  # noqa: E731
    compiled = torch.compile(op, backend=recording())
    x = torch.randn(2, 3, 4, 10, dtype=torch.float64)
    with pytest.warns(UserWarning, match="cumprod has no spatial handler"):
        check(
            lambda x: compiled(x) if isinstance(x, SpatialTensor) else op(x),
            [x],
            sharded=[0],
            axes=axes("w2"),
            allow_fallback=True,
        )
    assert _graphs


def test_an_op_without_a_handler_falls_back_exactly_between_graphs():
    run_spmd(_fallback_case, 2)


def _input_write_case(layout, requires_grad):
    def scale_in_place(x):
        x.mul_(2)
        return x * 3

    compiled = torch.compile(scale_in_place, backend=recording(), fullgraph=True)
    full = torch.randn(2, 3, 4, 10, dtype=torch.float64)
    x = shard(full.clone(), axes(layout))  # its own memory (a shard may be a view of the full tensor)
    if requires_grad:  # a leaf may not be written in place: write a non-leaf
        x = x.requires_grad_() * 1
        full = full.requires_grad_() * 1
    out = compiled(x)
    expected = scale_in_place(full)
    assert type(x) is SpatialTensor and type(out) is SpatialTensor
    torch.testing.assert_close(gather(x), full, rtol=0, atol=0)
    torch.testing.assert_close(gather(out), expected, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("layout", ["w3", "2x2"])
def test_a_compiled_graph_writes_its_result_into_a_shard_it_was_given(layout, requires_grad):
    """Where aot_autograd applies an input's in-place update after the graph (torch 2.11 with a graph input that
    needs grad; 2.14 keeps the write in the graph), it copies the graph's local result into the shard: a write of
    local rows, not an element-wise ``copy_`` whose plain operand would be cut as a global tensor."""
    run_spmd(_input_write_case, LAYOUTS[layout][0], layout, requires_grad)


def _setitem_case():
    def write(x):
        y = x * 2
        y[..., 3:7] = 1.0
        return y

    with pytest.raises(NameError, match="__subclass_Tensor"):
        torch.compile(write, backend=recording())(shard(torch.randn(1, 2, 3, 10), axes("w2")))


def test_known_limit_an_index_assignment_into_a_shard_fails_in_dynamo():
    """Canary: ``y[...] = v`` on a shard in compiled code stops in dynamo's own bytecode (a NameError for the
    class it rebuilds the shard with); run such code eagerly (``torch.compiler.disable``)."""
    run_spmd(_setitem_case, 2)


def _relu_case():
    compiled = torch.compile(lambda x: torch.relu_(x * 1), backend=recording(), fullgraph=True)
    out = compiled(shard(torch.randn(1, 2, 3, 8), axes("w2")))
    assert type(out) is torch.Tensor, "torch.relu_ keeps the layout now: update docs/design.md's known limits"


def test_known_limit_dynamo_puts_functions_missing_from_torch_overrides_in_the_graph_as_they_are():
    """Canary: dynamo does not dispatch ``torch.relu_`` (absent from ``torch.overrides``) to ``__torch_function__``,
    so its result is the shard as a plain tensor. Its methods (``x.relu_()``) and ``F.relu`` are dispatched."""
    run_spmd(_relu_case, 2)


class CompiledInside(LitModel):
    """The backbone compiled inside the module, the other common way to use ``torch.compile``."""

    def __init__(self, name: str, backend="inductor"):
        super().__init__(name)
        self.model = torch.compile(self.model, backend=backend)


class Compiled(L.Callback):
    """Fails the run unless graphs were compiled in this rank (and, ``probed``, every candidate plan was run)."""

    def __init__(self, probed: bool = False):
        self.probed = probed

    def on_train_end(self, trainer, pl_module):
        assert _graphs, "nothing was compiled"
        plan = trainer.strategy.plan
        assert not self.probed or all(e.bytes for e in plan.estimates), plan.describe()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["module", "submodule"])
def test_trainer_fits_a_compiled_module_to_the_single_device_weights(how):
    data = Images(4, 16, 24)
    reference = single_device("segnet", data, 4)
    ours = LitModel("segnet") if how == "module" else CompiledInside("segnet", backend=recording("inductor"))
    compiled = torch.compile(ours, backend=recording()) if how == "module" else ours
    fit(compiled, SpatialParallelStrategy(2, start_method="fork"), 2, data, 4, callbacks=[Compiled()])
    assert_same_weights(ours, reference, tolerance=1e-5)


class _Block(torch.nn.Module):
    """Ends in a frame of its own (the graph break), which dynamo compiles again for each size it meets."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        torch._dynamo.graph_break()
        return h * h.sigmoid() + h.mean(-1, keepdim=True)


class TwoScales(LitModel):
    """Per-pixel logits from blocks at two scales, as a feature pyramid's heads run."""

    def __init__(self):
        super().__init__("segnet")
        torch.manual_seed(0)
        self.model = torch.nn.ModuleDict({"fine": _Block(), "coarse": _Block()})

    def forward(self, x):
        y = self.model.fine(x)
        return y + F.interpolate(self.model.coarse(F.avg_pool2d(y, 2)), scale_factor=2.0)


@pytest.mark.slow
def test_trainer_fits_a_compiled_module_whose_code_meets_several_sizes():
    """Code compiled again at a second size keeps the shards' sizes static for the run (with dynamo's automatic
    dynamic shapes they became symbols and the run failed: a shard met its global size in a later graph, or dynamo
    stopped comparing layouts of symbolic sizes); the weights are one device's."""
    data = Images(4, 16, 24)
    reference = TwoScales()
    fit(reference, "auto", 1, data, 4)
    ours = TwoScales()
    strategy = SpatialParallelStrategy(2, fallback="error", start_method="fork")  # no op gathers
    fit(torch.compile(ours, backend=recording()), strategy, 2, data, 4)
    assert_same_weights(ours, reference, tolerance=1e-5)


@pytest.mark.slow
def test_trainer_fits_a_compiled_timm_model_in_float64_on_2x2_tiles():
    data = Images(4, 64, 64)
    reference = LitModel("resnet10t")
    fit(reference, "auto", 1, data, 4, precision="64-true")
    same = SameWeightsInTheRanks(reference.double(), tolerance=1e-12, zero_floor=1e-12)
    strategy = SpatialParallelStrategy((2, 2), start_method="fork")
    model = torch.compile(LitModel("resnet10t"), backend=recording())
    fit(model, strategy, 4, data, 4, precision="64-true", callbacks=[same, Compiled()])


@pytest.mark.slow
def test_a_plan_without_spatial_axes_compiles_and_its_probe_steps_a_copy():
    """Every layout fits 1 TiB, so the automatic plan is 2 data replicas of one rank: nothing is sharded and the
    module compiles as under DDP; both replicas see all 4 images, as one device does. The probe runs every
    candidate, sharded ones too, eagerly and on a copy: Lightning sets a compiled module's steps on the module
    itself, bound to it, which a copy would step."""
    data = Images(4, 16, 24)
    reference = single_device("segnet", data, 4)
    ours = CompiledInside("segnet", backend=recording())
    strategy = SpatialParallelStrategy("auto", memory_budget="1TiB", start_method="fork")
    compiled = torch.compile(ours, backend=recording())
    fit(compiled, strategy, 2, data, 4, use_distributed_sampler=False, callbacks=[Compiled(probed=True)])
    assert_same_weights(ours, reference, tolerance=1e-5)


def _outside_case():
    conv = torch.nn.Conv2d(2, 3, 3, padding=1).double()
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    compiled = torch.compile(conv, backend=recording(), fullgraph=True)
    check(lambda x: compiled(x) if isinstance(x, SpatialTensor) else conv(x), [x], sharded=[0], axes=axes("w2"))
    assert _graphs


@pytest.mark.slow
def test_compiling_over_shards_needs_no_strategy():
    run_spmd(_outside_case, 2)


@functools.lru_cache
def _factor(n: int) -> float:
    return 1.0 / n


def _quiet_case():
    from torch._dynamo.utils import warn_once_cache

    warn_once_cache.clear()  # dynamo warns once per message and process
    conv = torch.nn.Conv2d(2, 3, 3, padding=1)
    with warnings.catch_warnings(record=True) as caught:
        torch.compile(conv, backend="eager", fullgraph=True)(shard(torch.randn(1, 2, 5, 8), axes("w2")))
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message) for w in caught]
    with pytest.warns(UserWarning, match="lru_cache"):  # a user's cache: dynamo's warning stands
        torch.compile(lambda t: t * _factor(3), backend="eager", fullgraph=True)(torch.randn(3))


def test_dynamo_says_nothing_about_our_caches():
    """Dynamo warns once for every ``lru_cache``-wrapped function it traces; our plans (partitions, windows: pure
    functions of sizes) are computed while it traces, with no such warning; a user's cache still warns."""
    run_spmd(_quiet_case, 2)
