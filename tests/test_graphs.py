"""CUDAGraphed: a replayed forward and backward trains as the eager module does (GPU), and runs eagerly where a
graph cannot be captured (CPU, no autograd)."""

from __future__ import annotations

import copy
import gc
import warnings
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest
import timm
import torch
import torch.distributed as dist

from lightning_spatial import halo, run
from lightning_spatial.graphs import CUDAGraphed, _gradient_memory, _Pool, _Replay, noting_bucket_views
from lightning_spatial.primitives import Axis, DimShard, Layout
from lightning_spatial.tensor import SpatialTensor, wrap
from tests.spmd import run_spmd

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def make(name: str = "convnext_atto", device: str = "cuda") -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=5).to(device)


def train(model, inputs, precision=None, accumulate=1, validate=None):
    """AdamW steps over ``inputs`` (``accumulate`` backwards per step); the losses, and ``validate``'s no-grad
    outputs after each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, checks = [], []
    for i in range(0, len(inputs), accumulate):
        for x in inputs[i : i + accumulate]:
            with torch.autocast("cuda", dtype=precision, enabled=precision is not None):
                out = model(x)
                local = out.to_local() if isinstance(out, SpatialTensor) else out
                loss = (local.float() * torch.linspace(-1, 1, local.shape[-1], device=local.device)).square().mean()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if validate is not None:
            with torch.no_grad():
                checks.append(model(validate).clone())
    return torch.stack(losses), checks


def assert_close_weights(a: torch.nn.Module, b: torch.nn.Module, rtol: float) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    sb = {k.removeprefix("module."): v for k, v in sb.items()}
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=rtol, atol=rtol * sa[k].abs().max().item() + 1e-12, msg=k)


@pytest.fixture
def deterministic():
    before = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before


@gpu
@pytest.mark.parametrize("precision", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_replays_train_to_the_eager_weights(deterministic, precision, accumulate):
    """Six steps of a model with BatchNorm-free blocks (convnext) and one with BatchNorm (resnet: running stats
    are buffers the forward graph updates) from the same start: replayed equals eager, validation in between
    (eager, under no_grad) included; accumulating two backwards catches gradients aliasing the graph's memory."""
    g = torch.Generator(device="cuda").manual_seed(1)
    inputs = [torch.randn(2, 3, 64, 96, device="cuda", generator=g) for _ in range(6)]
    probe = torch.randn(1, 3, 64, 96, device="cuda", generator=g)
    for name in ("convnext_atto", "resnet10t"):
        eager, graphed = make(name), CUDAGraphed(make(name), warmup=1)
        loss_e, val_e = train(eager, inputs, precision, accumulate, probe)
        loss_g, val_g = train(graphed, inputs, precision, accumulate, probe)
        assert len(graphed._graphs) == 1  # it did replay
        rtol = 1e-5 if precision is None else 1e-2
        torch.testing.assert_close(loss_g, loss_e, rtol=rtol, atol=0)
        for a, b in zip(val_g, val_e):
            torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * b.abs().max().item())
        assert_close_weights(eager, graphed, rtol)


@contextmanager
def one_rank_of_two(rank: int, width: int, monkeypatch):
    """This process as rank ``rank`` of a width-2 group (PyTorch's fake process group; received halos read as
    zeros); yields the layout of a map ``width`` wide."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    monkeypatch.setattr(halo, "_p2p", lambda axis, sends, recvs: [t.zero_() for _, t in recvs])
    dist.init_process_group("fake", rank=rank, world_size=2, store=FakeStore())
    try:
        yield Layout((DimShard(-1, Axis.from_group(dist.group.WORLD), width),))
    finally:
        dist.destroy_process_group()


@gpu
def test_shards_replay_as_their_eager_op_layer(deterministic, monkeypatch):
    """One rank of a width-2 group: the op layer's halo windows, its reductions and the replicated result after
    global pooling replay as they ran eagerly."""
    with one_rank_of_two(1, 128, monkeypatch) as layout:
        g = torch.Generator(device="cuda").manual_seed(2)
        inputs = [wrap(torch.randn(2, 3, 64, 64, device="cuda", generator=g), layout) for _ in range(4)]
        for name in ("convnext_atto", "resnet10t"):
            eager, graphed = make(name), CUDAGraphed(make(name), warmup=1)
            loss_e, _ = train(eager, inputs)
            loss_g, _ = train(graphed, inputs)
            assert len(graphed._graphs) == 1
            torch.testing.assert_close(loss_g, loss_e, rtol=1e-5, atol=0)
            assert_close_weights(eager, graphed, 1e-5)


@gpu
def test_sharded_inputs_and_outputs_keep_their_layout_and_gradients(deterministic, monkeypatch):
    """A shard in, a shard out, and the input's gradient (a shard too) as the eager op layer gives them."""
    with one_rank_of_two(0, 64, monkeypatch) as layout:
        torch.manual_seed(3)
        eager = torch.nn.Conv2d(3, 4, 3, padding=1).cuda()
        graphed = CUDAGraphed(copy.deepcopy(eager), warmup=1)
        for _ in range(3):
            local = torch.randn(1, 3, 8, 32, device="cuda")
            weights = torch.randn(1, 4, 8, 32, device="cuda")
            results = []
            for module in (eager, graphed):
                x = wrap(local.clone(), layout).requires_grad_(True)
                y = module(x)
                assert isinstance(y, SpatialTensor) and y.shard_layout == layout and y.shape == (1, 4, 8, 64)
                (y.to_local() * weights).sum().backward()
                results.append((y.to_local().detach(), x.grad.to_local()))
            for a, b in zip(*results):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert len(graphed._graphs) == 1


class _ReadsOnHost(torch.autograd.Function):
    """The identity, reading a value on the host in its forward or its backward: no capture holds that (eager code
    can)."""

    @staticmethod
    def forward(ctx, x, phase):
        ctx.phase = phase
        return x * (x.abs().max().item() > -1) if phase == "forward" else x.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad * (grad.abs().max().item() > -1) if ctx.phase == "backward" else grad), None


class _Uncapturable(torch.nn.Module):
    def __init__(self, phase: str):
        super().__init__()
        self.a, self.drop, self.b = torch.nn.Linear(16, 32), torch.nn.Dropout(0.3), torch.nn.Linear(32, 16)
        self.phase = phase

    def forward(self, x):
        return self.b(_ReadsOnHost.apply(self.drop(self.a(x)), self.phase))


@gpu
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_module_that_cannot_be_captured_runs_eagerly_with_the_same_random_numbers(phase):
    """A forward that cannot be captured runs eagerly; a backward, captured when the step first reaches it, where
    that fails gives the step's gradients from an eager forward and backward with the random numbers the replayed
    forward drew (its dropout mask). Either way the module runs eagerly from then on with a warning, random numbers
    still draw after the failed capture, and training equals eager training. A module captured after it replays
    (the pool a capture failed in takes no more captures)."""
    torch.manual_seed(3)
    eager = _Uncapturable(phase).cuda()
    graphed = CUDAGraphed(copy.deepcopy(eager), warmup=1)
    results = []
    for model in (eager, graphed):
        torch.manual_seed(11)
        inputs = [torch.randn(8, 16, device="cuda") for _ in range(4)]
        with pytest.warns(UserWarning, match="runs eagerly: its capture failed") if model is graphed else nullcontext():
            results.append(train(model, inputs))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=0)
    assert_close_weights(eager, graphed, 1e-6)
    assert not graphed.captured
    after = CUDAGraphed(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.3)).cuda(), warmup=1)
    train(after, inputs)
    assert after.captured


@gpu
def test_parameters_moved_elsewhere_are_captured_again(deterministic):
    """A graph reads the parameters' memory: after a reload that reallocates them, it must not replay stale
    weights (it runs eagerly again, then captures anew)."""
    graphed, eager = CUDAGraphed(make(), warmup=1), make()
    x = torch.randn(1, 3, 64, 64, device="cuda")
    for _ in range(3):
        graphed(x).sum().backward()
    for p in graphed.parameters():
        p.data = p.data * 0.5
    for p in eager.parameters():
        p.data = p.data * 0.5
    for _ in range(3):
        torch.testing.assert_close(graphed(x), eager(x), rtol=1e-5, atol=1e-6)
    assert len(graphed._graphs) == 1


def blocks(seed: int) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)) for _ in range(3)
    ).cuda()


@gpu
def test_modules_captured_in_one_step_share_a_pool_and_replay_as_eager(deterministic):
    """Three wrapped blocks in a row, captured in the same step, share one memory pool; each block's temporaries may
    then sit where another's outputs, saved activations and gradients were, so the outputs a caller still holds after
    the backward, the weights and the input's gradient must all equal eager's."""
    eager = blocks(5)
    graphed = torch.nn.ModuleList(CUDAGraphed(b, warmup=1) for b in blocks(5))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, graphed)]
    g = torch.Generator(device="cuda").manual_seed(6)
    for _ in range(5):
        x = torch.randn(32, 64, device="cuda", generator=g)
        target = torch.randn(32, 64, device="cuda", generator=g)
        results = []
        for model, opt in zip((eager, graphed), opts):
            h, outs = x.clone().requires_grad_(True), []
            inp = h
            for block in model:
                h = block(h)
                outs.append(h)
            ((h - target).square().mean() + sum(o.sum() for o in outs[:-1]) * 1e-3).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            results.append([o.detach() for o in outs] + [inp.grad])  # read after the backward
        for a, b in zip(*results):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert_close_weights(eager, graphed, 1e-5)
    pools = {id(graphs.pool) for block in graphed for graphs in block._graphs.values()}
    assert len(pools) == 1 and all(block.captured for block in graphed)


@gpu
def test_a_capture_allocates_from_one_range_the_size_its_warmup_forward_kept(deterministic):
    """The capture reserves one range in its pool as large as the warm-up forward's saved activations and outputs
    (more than any one activation) and the replays still train as eager: the pool is not grown a block at a time."""
    eager, graphed = make(), CUDAGraphed(make(), warmup=1)
    g = torch.Generator(device="cuda").manual_seed(7)
    inputs = [torch.randn(8, 3, 256, 256, device="cuda", generator=g) for _ in range(3)]
    for model in (eager, graphed):
        train(model, inputs)
    assert_close_weights(eager, graphed, 1e-5)
    (graphs,) = graphed._graphs.values()
    pool = [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(graphs.pool.handle)]
    largest_activation = 8 * 40 * 64 * 64 * 4 * 4  # convnext_atto's stage-1 MLP hidden map, fp32
    assert graphs.reserved > 4 * largest_activation
    assert max(s["total_size"] for s in pool) >= graphs.reserved


@gpu
def test_branches_whose_backwards_run_in_forward_order_replay_as_eager(deterministic):
    """Two blocks on one input, each with a backward of its own, A's first: captured in that order (A's backward
    while B's saved activations are held), they share a pool and train to eager's weights, step after step."""
    eager = blocks(8)[:2]
    graphed = torch.nn.ModuleList(CUDAGraphed(b, warmup=1) for b in blocks(8)[:2])
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, graphed)]
    g = torch.Generator(device="cuda").manual_seed(8)
    for _ in range(4):
        x = torch.randn(16, 64, device="cuda", generator=g)
        for model, opt in zip((eager, graphed), opts):
            ya, yb = model[0](x), model[1](x)
            ya.square().mean().backward()
            yb.abs().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert_close_weights(eager, graphed, 1e-5)
    assert all(block.captured for block in graphed)
    assert len({id(graphs.pool) for block in graphed for graphs in block._graphs.values()}) == 1


class Reading(torch.nn.Module):
    """A layer that attends from its queries to tokens it is given, as a BEV encoder's layers read the cameras'."""

    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x, tokens):
        return x + torch.tanh(self.q(x) @ self.k(tokens).T / 8) @ tokens / 8


@gpu
def test_modules_given_the_same_tensor_read_one_copy_of_it(deterministic):
    """Layers that all read the same tokens read one copy of them, written once a step; a step that gives the last
    layer other tokens runs it eagerly, with a warning, instead of writing over the tokens the earlier layers
    saved for their backwards: the weights equal eager's either way."""
    torch.manual_seed(11)
    eager = torch.nn.ModuleDict(
        {"tokens": torch.nn.Linear(64, 64), "layers": torch.nn.ModuleList(Reading() for _ in range(3))}
    )
    graphed = copy.deepcopy(eager).cuda()
    eager.cuda()
    graphed.layers = torch.nn.ModuleList(CUDAGraphed(layer, warmup=1) for layer in graphed.layers)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, graphed)]
    g = torch.Generator(device="cuda").manual_seed(11)
    for step in range(5):
        x, raw = torch.randn(16, 64, device="cuda", generator=g), torch.randn(40, 64, device="cuda", generator=g)
        other = step == 4
        for model, opt in zip((eager, graphed), opts):
            tokens, h = model["tokens"](raw), x
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for i, layer in enumerate(model["layers"]):
                    h = layer(h, tokens * 0.5 if other and i == 2 else tokens)
            eagerly = [w for w in caught if "shares memory" in str(w.message)]
            assert len(eagerly) == (other and model is graphed), (step, [str(w.message) for w in caught])
            h.square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert_close_weights(eager, graphed, 1e-5)
    read = {id(graphs.inputs[1]) for layer in graphed.layers for graphs in layer._graphs.values()}
    assert len(read) == 1 and all(layer.captured for layer in graphed.layers)


@gpu
def test_replaying_out_of_capture_order_raises_before_wrong_gradients(deterministic):
    """Two blocks captured as A then B share a pool; a step that runs B's forward before A's replays A between B's
    forward and backward, over memory where B's saved activations may be: the backward raises, naming the fix."""
    a, b = (CUDAGraphed(block, warmup=1) for block in list(blocks(7))[:2])
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    for _ in range(2):
        b(a(x)).sum().backward()
    assert a.captured and b.captured
    loss = (b(x) + a(x)).sum()
    with pytest.raises(RuntimeError, match="order of the step they were captured in"):
        loss.backward()


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x, *, scale):
        return self.conv(x) * scale


@gpu
def test_keyword_inputs_and_a_bounded_number_of_captures():
    """Keyword tensors are inputs like positional ones; a third input shape beyond ``max_signatures=2`` runs eagerly
    with a warning instead of holding a third graph's memory."""
    torch.manual_seed(4)
    eager = Scaled().cuda()
    graphed = CUDAGraphed(copy.deepcopy(eager), warmup=1, max_signatures=2)
    for width in (8, 16, 24):
        beyond = pytest.warns(UserWarning, match="more than 2 shapes or layouts") if width == 24 else nullcontext()
        with beyond:
            for _ in range(3):
                x, scale = torch.randn(1, 3, 8, width, device="cuda"), torch.randn(4, 1, 1, device="cuda")
                torch.testing.assert_close(graphed(x, scale=scale), eager(x, scale=scale), rtol=1e-5, atol=1e-6)
    assert len(graphed._graphs) == 2


class CollectsWhileCaptured(torch.nn.Module):
    """Hands the last reference to another CUDA graph to a dead cycle, then allocates with the collector's threshold
    at 1, inside its capture: what an automatic collection does when it falls there."""

    def __init__(self, graph: torch.cuda.CUDAGraph):
        super().__init__()
        self.linear, self.graph = torch.nn.Linear(8, 8), [graph]

    def forward(self, x):
        if torch.cuda.is_current_stream_capturing() and self.graph:
            cycle = [self.graph.pop()]
            cycle.append(cycle)
            del cycle
            threshold = gc.get_threshold()
            gc.set_threshold(1)
            try:
                _ = [[] for _ in range(64)]
            finally:
                gc.set_threshold(*threshold)
        return self.linear(x)


@gpu
def test_an_earlier_graph_left_to_the_collector_does_not_fail_a_capture():
    """A model's dead graphs freed by a collection during another's capture would destroy a graph inside it, which
    CUDA refuses (the capture then fails): the capture holds automatic collection off."""
    old, x = torch.cuda.CUDAGraph(), torch.randn(4, device="cuda")
    with torch.cuda.graph(old):
        x.mul_(2)
    graphed = CUDAGraphed(CollectsWhileCaptured(old).cuda(), warmup=1)
    del old
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            graphed(torch.randn(2, 8, device="cuda", requires_grad=True)).sum().backward()
    assert graphed.captured, [str(w.message) for w in caught]
    assert not graphed.module.graph and gc.isenabled()


def test_off_cuda_and_without_autograd_it_runs_eagerly():
    model = make(device="cpu")
    graphed = CUDAGraphed(copy.deepcopy(model), warmup=1)
    x = torch.randn(1, 3, 32, 32)
    for _ in range(3):
        torch.testing.assert_close(graphed(x), model(x), rtol=0, atol=0)
    assert not graphed._graphs


class Head(torch.nn.Linear):
    """A head whose owner also calls its ``loss`` (CenterPoint's), and reads its attributes."""

    kind = "centerpoint"

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).square().mean()


def test_the_wrapped_modules_other_methods_and_attributes_stay_reachable():
    """``cuda_graphs="auto"`` may wrap a head its owner calls ``loss`` on: the wrapper passes them through."""
    graphed = CUDAGraphed(Head(3, 2), warmup=1)
    x, target = torch.randn(4, 3), torch.randn(4, 2)
    assert graphed.kind == "centerpoint" and graphed.out_features == 2
    torch.testing.assert_close(graphed.loss(graphed(x), target), graphed.module.loss(graphed.module(x), target))
    with pytest.raises(AttributeError, match="no_such_thing"):
        graphed.no_such_thing


def test_warmup_must_leave_an_eager_call_before_the_capture():
    with pytest.raises(ValueError, match="warmup=0"):
        CUDAGraphed(torch.nn.Linear(2, 2), warmup=0)


@gpu
@pytest.mark.parametrize("inputs_are", ["plain", "shards", "shard views"])
def test_a_compiled_module_is_captured_without_compiling_inside_the_capture(deterministic, monkeypatch, inputs_are):
    """``CUDAGraphed(torch.compile(model))`` replays and trains to the weights of the same compiled model run
    without graphs, in bf16. Compiling inside a capture fails there (on shards our traced code copies index tensors to
    the device, which a capture refuses), so: the capture's leaves and autocast state are those the warm-up showed
    the compiled code, and nothing compiles again (plain tensors, shards); where the capture's inputs differ anyway
    (views of shards, whose strides the capture's contiguous copies do not have), the rehearsal before the capture
    compiles for them. The reference trains on contiguous copies (torch 2.11 mis-traces a view of a shard met again
    after a recompile, with or without graphs)."""
    with one_rank_of_two(1, 128, monkeypatch) if inputs_are != "plain" else nullcontext() as layout:
        g = torch.Generator(device="cuda").manual_seed(5)
        wide = [torch.randn(2, 3, 64, 72, device="cuda", generator=g) for _ in range(4)]
        inputs = [x[..., 4:68].contiguous() for x in wide]
        views = [x[..., 4:68] for x in wide] if inputs_are == "shard views" else inputs
        if inputs_are != "plain":
            inputs, views = [wrap(x, layout) for x in inputs], [wrap(x, layout) for x in views]
        torch._dynamo.reset()
        graphed = CUDAGraphed(torch.compile(make()), warmup=1)
        with nullcontext() if inputs_are == "shard views" else torch._dynamo.config.patch(error_on_recompile=True):
            loss_g, _ = train(graphed, views, torch.bfloat16)
        assert len(graphed._graphs) == 1
        torch._dynamo.reset()
        eager = torch.compile(make())
        loss_e, _ = train(eager, inputs, torch.bfloat16)
        torch.testing.assert_close(loss_g, loss_e, rtol=1e-2, atol=0)
        assert_close_weights(eager, graphed, 1e-2)


class Holder(torch.nn.Module):
    def __init__(self, graphed: torch.nn.Module):
        super().__init__()
        self.stem, self.graphed, self.head = torch.nn.Conv2d(3, 4, 1), graphed, torch.nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(self.graphed(self.stem(x)).relu())


def test_a_compiled_caller_leaves_the_graphed_module_to_itself():
    """``torch.compile`` of a module holding a ``CUDAGraphed`` one (``Trainer.fit(torch.compile(module))`` with
    ``cuda_graphs``): dynamo does not trace the wrapper (it would trace a capture): the graphs it builds around it
    hold none of the wrapped module's ops, and a compiled module inside the wrapper still compiles."""
    torch.manual_seed(6)
    graphs = []

    def record(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    inner = torch.nn.Conv2d(4, 4, 3, padding=1)
    model = Holder(CUDAGraphed(torch.compile(inner, backend=record)))
    x = torch.randn(1, 3, 8, 8)
    torch.testing.assert_close(torch.compile(model, backend=record)(x), model(x), rtol=0, atol=0)
    convs = sorted(sum(n.target is torch.conv2d for n in g.graph.nodes) for g in graphs)
    assert convs == [1, 1, 1], convs  # the stem's graph, the head's, and the wrapped module's own


class _EagerGraphs:
    """What ``_Replay`` reads of a capture, filled by eager calls instead of graphs (CPU): its parameters' gradients
    are written into the memory a capture writes them to, each call; its backward is "captured" at its first call,
    as a real one is."""

    def __init__(self, model: torch.nn.Module, x: torch.Tensor, pool: _Pool | None = None):
        self.pool = _Pool(handle=None) if pool is None else pool
        self.index, self.name = self.pool.join(), type(model).__name__
        self.params = tuple(model.parameters())
        self.model, self.x = model, x
        self.out_needs_grad = [True]
        self.static_out = [model(x).detach()]
        self.static_grad_out = [torch.empty_like(self.static_out[0])]
        self.input_grads, self.param_grads = [], _gradient_memory(self.params)
        self.forward_graph = SimpleNamespace(replay=lambda: None)  # the output is computed once, above
        self.backward_graph = SimpleNamespace(replay=self.backward)  # not None: no random state to keep
        self.captured_backward = False

    def replay_backward(self) -> None:
        if not self.captured_backward:
            self.captured_backward = True
            self.pool.captured(self.index, "backward")
        self.backward()

    def backward(self) -> None:
        with torch.enable_grad():
            grads = torch.autograd.grad(self.model(self.x), self.params, self.static_grad_out)
        for memory, g in zip(self.param_grads, grads):
            memory.copy_(g)


class _Replayed(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, graphs: _EagerGraphs):
        super().__init__()
        self.model, self.graphs = model, graphs

    def forward(self, x):
        return _Replay.apply(self.graphs, *self.model.parameters())[0]


def _ddp_buckets_case():
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)  # strides DDP must keep
    x = torch.randn(2, 3, 8, 8)
    reference = [g for g in torch.autograd.grad(model(x).sum(), list(model.parameters()))]

    @noting_bucket_views
    def hook(state, bucket):
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, hook)
    ddp(x).sum().backward()  # eager: DDP's buckets, their views noted
    model.zero_grad(set_to_none=True)
    replayed = DistributedDataParallel(_Replayed(model, _EagerGraphs(model, x)), gradient_as_bucket_view=True)
    replayed.register_comm_hook(None, hook)
    with torch.profiler.profile() as prof:
        replayed(x).sum().backward()
    accumulate = [e for e in prof.events() if e.name == "torch::autograd::AccumulateGrad"]

    def copies(event):
        return [c.name for c in event.cpu_children if c.name in ("aten::copy_", "aten::clone")] + [
            name for c in event.cpu_children for name in copies(c)
        ]

    assert accumulate and not [name for e in accumulate for name in copies(e)]
    for p, g in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=0)
        assert p.grad.data_ptr() == run.current().bucket_views[p].data_ptr() and p.grad.stride() == p.stride()
    (3 * replayed(x).sum()).backward()  # .grad set: added to, in the bucket
    for p, g in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad, 4 * g, rtol=1e-6, atol=0)


def test_replayed_gradients_land_in_ddp_buckets_with_one_copy():
    """A replayed backward writes the parameters' gradients into DDP's buckets (``noting_bucket_views`` wraps the
    comm hook), where autograd adopts them and DDP finds them: no copy under ``AccumulateGrad`` (there, autograd's
    copy out of the graph's memory into a new ``.grad``). Gradients equal, ``.grad`` in the bucket; with ``.grad``
    set (accumulation) they add as usual."""
    run_spmd(_ddp_buckets_case, 1)  # a rank of its own: the parent never initialises a process group


def _accumulation_case():
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    reference = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    replayed = _Replayed(model, _EagerGraphs(model, x))
    replayed(x).sum().backward()
    assert [p.grad.data_ptr() for p in model.parameters()] == [m.data_ptr() for m in replayed.graphs.param_grads]
    (3 * replayed(x).sum()).backward()
    for p, g in zip(model.parameters(), reference):
        torch.testing.assert_close(p.grad, 4 * g, rtol=1e-6, atol=0)


def test_accumulated_gradients_are_moved_out_of_the_next_replays_way():
    """Without DDP a replay's parameter gradients are memory of the capture's own, which autograd adopts as
    ``.grad``; a second backward before ``zero_grad`` (accumulation) writes that memory again, so the ``.grad``
    there is moved out of its way first and added to: both backwards' sum, as eagerly."""
    run_spmd(_accumulation_case, 1)  # a rank of its own: a backward in the parent breaks later forks


def test_captures_given_the_same_tensor_read_one_copy_written_once_a_step():
    """The bookkeeping of shared static inputs (``_Pool.static_input``, ``_Pool.load``), on CPU: captures of one
    step given the same tensor read one copy of it, written by the first call of each step only; memory that
    another member still needs (its forward replayed, its backward not yet) is not written over, for another
    tensor or for the same one changed in place: that call is refused."""
    pool, tokens, inputs = _Pool(handle=None), torch.randn(5, 4), []
    for _ in range(3):  # the capture step: each capture joins, gets its memory, loads its call, replays
        member = pool.join()
        inputs.append(pool.static_input(tokens, member))
        assert pool.load(member, inputs[-1:], [tokens])
        pool.replaying(member, "forward")
    shared = inputs[0]
    assert inputs == [shared] * 3 and shared.readers == [0, 1, 2]
    for member in (2, 1, 0):
        pool.replaying(member, "backward")
    fresh = torch.randn(5, 4)
    for member in (0, 1):  # the next step: the first call writes, the second finds the tensor there
        assert pool.load(member, [shared], [fresh])
        assert shared.written_at == pool.clock if member == 0 else shared.written_at < pool.clock
        pool.replaying(member, "forward")
    assert not pool.load(2, [shared], [fresh * 0.5])  # the others still need what the memory holds
    torch.testing.assert_close(shared.memory, fresh, rtol=0, atol=0)
    for member in (1, 0):
        pool.replaying(member, "backward")
    assert pool.load(0, [shared], [fresh])
    pool.replaying(0, "forward")
    fresh.add_(1)  # changed in place since member 0 read it
    assert not pool.load(1, [shared], [fresh])
    pool.replaying(0, "backward")
    assert pool.load(1, [shared], [fresh])
    torch.testing.assert_close(shared.memory, fresh, rtol=0, atol=0)


def _two_in_a_pool(seed: int):
    """Stand-ins of two captures A and B (in that order) of one pool, and their input."""
    torch.manual_seed(seed)
    models = [torch.nn.Linear(4, 4) for _ in range(2)]
    x = torch.randn(2, 4)
    pool = _Pool(handle=None)
    a, b = (_Replayed(m, _EagerGraphs(m, x, pool)) for m in models)
    return a, b, x


def _pool_order_case():
    a, b, x = _two_in_a_pool(8)
    for _ in range(2):
        ya = a(x)
        (ya.sum() + b(ya).sum()).backward()
    yb = b(x)
    loss = a(x).sum() + yb.sum()
    with pytest.raises(RuntimeError, match=r"CUDAGraphed\(Linear\).*order of the step they were captured in"):
        loss.backward()


def _pool_capture_order_case():
    a, b, x = _two_in_a_pool(9)
    for _ in range(3):  # the first backwards are the captures: A's, then B's
        ya, yb = a(x), b(x)
        ya.sum().backward()
        yb.sum().backward()
    first, second = a(x), a(x)  # A's forward again: what the first one saved is overwritten
    second.sum().backward()
    with pytest.raises(RuntimeError, match=r"CUDAGraphed\(Linear\).*or this module's forward again"):
        first.sum().backward()


def test_the_pool_order_check_follows_the_order_the_backwards_were_captured_in():
    """Backwards are captured when the step reaches them: captured as forwards A, B then backwards A, B (two
    branches), the step replays in that order step after step (B's saved activations were held while A's backward
    was captured); a module's forward replayed twice before its first backward raises there."""
    run_spmd(_pool_capture_order_case, 1)


def test_the_pool_order_check_lets_nested_replays_pass_and_stops_the_rest():
    """The order check of a shared pool, on CPU stand-ins of two captures (A, then B): forwards A, B and backwards
    B, A (one step of the model) pass, step after step; B's forward before A's puts A's replays inside B's span,
    and B's backward raises before it replays."""
    run_spmd(_pool_order_case, 1)  # a rank of its own: a backward here after a compiled one breaks later forks
