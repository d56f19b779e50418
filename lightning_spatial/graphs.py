"""CUDA graphs of a module's forward and backward on shards: the op layer's host time out of the step.

In bf16 one rank's GPU work per op can be short enough that our per-op Python (``__torch_function__``, halo
bookkeeping) sets the step time (ConvNeXt-XL at S = 8: 1.2x the shard alone eagerly, 1.05x replayed;
docs/benchmarks.md), and a compiled step still runs its exchanges' Python (1.17x). A CUDA graph records the kernels
of one forward and one backward, halo messages included, and replays them with no Python at all: what
``torch.compile(mode="reduce-overhead")`` does for plain modules (its graph trees cannot copy a shard), and what
``torch.cuda.make_graphed_callables`` does, but for calls whose inputs and outputs are shards. It wraps a compiled
module too (``CUDAGraphed(torch.compile(model))``: 1.06x the compiled and graphed shard alone): the capture calls it
as its warm-up did, after a rehearsal, so that nothing compiles inside the capture.

``CUDAGraphed(module)`` (or ``SpatialParallelStrategy(cuda_graphs=["backbone"])``, which wraps named submodules for
a run and unwraps them after) runs the module eagerly for its first ``warmup`` training calls of a given input
signature (caches, cuDNN's algorithm search and NCCL's communicators are set up there), captures the next, and
replays from then on; inputs of another shape or layout get their own capture, up to ``max_signatures`` (then eager,
with a warning). It runs eagerly, and says nothing, off CUDA, without autograd (validation) and inside another
capture; once the parameters are no longer where the capture saw them, it captures again. What a graph cannot see
is frozen at capture: the forward must be a function of its tensor inputs, parameters and buffers (Python-side
randomness or step counters are not replayed; torch's CUDA random numbers are). Outputs live in the graph's
memory; a replay returns copies of them. The parameters' gradients are written outside the graphs' memory, into
DDP's buckets where there are some, and handed to autograd as ``.grad``: held once, as in an eager step. Captures
of one step given the same tensor (a BEV encoder's layers, the camera tokens) read one copy of it. Checkpoints do
not see the wrapper: its state dict is the module's, under the same names.

Memory: the captures made in one training step, up to its first replayed backward, share one pool (``_Pool``), so
that what one graph only needs while it replays (its temporaries) is memory the next graph reuses, as in an eager
step, instead of every capture reserving its own. A forward is captured at its call and its backward when the step's
backward reaches it, so the pool sees the step's own order of allocations: a forward's saved activations stay
allocated (its autograd graph is held) until its backward's capture, which frees them as it goes for its own
temporaries, as an eager backward does. Replays are safe while they keep that order (the order of one step of a
model); a backward whose saved activations another replay may have overwritten since its forward (a module captured
outside its span, or its own forward again) raises an error instead of computing gradients. A backward that cannot
be captured is computed eagerly for that step (the forward again, with the same random numbers), and the module runs
eagerly from then on, with a warning. A module with compiled code keeps a pool of its own, its backward captured
with its forward. Each capture first reserves, in the pool, one range the size of what the module's last warm-up
call kept allocated after its forward (its saved activations and outputs), and allocates from it: the pool grows a
segment for every block it cannot place, and a block freed in one segment never merges with its neighbour in
another, so grown a block at a time the pool reserved 10% more than it ever held (ConvNeXt-XL, 7 x 3 x 512 x 1024
in fp32: 35.4 GiB for a peak of 32.1 GiB; PETR's captures 6.5 GiB for 5.7).
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import run
from .tensor import SpatialTensor, _Plain, settled, wrap


def _is(a: Any) -> bool:
    return isinstance(a, torch.Tensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, SpatialTensor) else t


def _layout(t: Any):
    return t.shard_layout if isinstance(t, SpatialTensor) else None


class _Pool:
    """The memory pool that the captures of one step share (see the module docstring), and when each of its graphs
    was captured and last replayed, on one clock: member ``i`` is the ``i``-th capture made into it."""

    def __init__(self, handle: Any, device: int | None = None) -> None:
        self.handle, self.device = handle, device  # torch.cuda.graph_pool_handle(), the CUDA device index
        self.clock = 0
        # per phase ("forward", "backward"), per member: the clock at its capture (None: not yet) and last replay
        self.captured_at: dict[str, list[int | None]] = {"forward": [], "backward": []}
        self.replayed_at: dict[str, list[int]] = {"forward": [], "backward": []}
        self.inputs: list[_StaticInput] = []  # where its captures read their inputs from
        self.last_backward_at = -1

    @property
    def own(self) -> bool:
        """One module's own pool (compiled code), not a run's shared one: its backward is captured with its forward."""
        return self.device is None

    @staticmethod
    def for_capture(module: nn.Module) -> _Pool:
        """The current run's open pool on this device, or a new one; a pool of its own for a module with compiled
        code (its compiled backward reuses, "donates", its saved activations' memory; a shared pool is not tested
        with that, nor a compiled backward captured inside the step's backward)."""
        if any(isinstance(m, OptimizedModule) or m._compiled_call_impl is not None for m in module.modules()):
            return _Pool(torch.cuda.graph_pool_handle())
        pools, device = run.current().graph_pools, torch.cuda.current_device()
        if device not in pools:
            pools[device] = _Pool(torch.cuda.graph_pool_handle(), device)
        return pools[device]

    def close(self) -> None:
        """Forwards captured after a replayed backward start a pool of their own: a step's order holds only for the
        graphs captured in that step."""
        pools = run.current().graph_pools
        if pools.get(self.device) is self:
            del pools[self.device]

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def join(self) -> int:
        """A new member, its forward about to be captured."""
        self.captured_at["forward"].append(self._tick())
        self.captured_at["backward"].append(None)
        self.replayed_at["forward"].append(0)
        self.replayed_at["backward"].append(0)
        return len(self.replayed_at["forward"]) - 1

    def captured(self, member: int, phase: str) -> None:
        self.captured_at[phase][member] = self._tick()

    def replaying(self, member: int, phase: str) -> int:
        self.replayed_at[phase][member] = at = self._tick()
        if phase == "backward":
            self.last_backward_at = at
        return at

    def static_input(self, a: torch.Tensor, member: int) -> _StaticInput:
        """Where member ``member`` reads input ``a`` from: the memory an earlier capture of this step reads the
        same tensor from (a BEV encoder's layers all read the camera tokens), else new memory, outside the pool."""
        local = _local(a)
        for shared in self.inputs:
            if shared.holds(a, self.last_backward_at) and _same_layout(shared.memory, local):
                shared.readers.append(member)
                return shared
        self.inputs.append(shared := _StaticInput(local, member))
        return shared

    def held(self, member: int) -> bool:
        """Whether ``member``'s forward replayed and its backward has not yet: what it saved is still needed."""
        return self.replayed_at["forward"][member] > self.replayed_at["backward"][member]

    def load(self, member: int, inputs: list[_StaticInput], tensors: list[torch.Tensor]) -> bool:
        """Write ``member``'s call's tensors where it reads them, skipping memory that holds the very tensor as
        written since the last backward; False, writing nothing, where memory shared with another member would
        change while that member still needs it."""
        since = self.last_backward_at
        stale = [(m, a) for m, a in zip(inputs, tensors) if not m.holds(a, since)]
        if any(r != member and self.held(r) for m, _ in stale for r in m.readers):
            return False
        for m, a in stale:
            m.write(a, self.clock)
        return True

    def check_saved(self, member: int, forward_at: int, name: str) -> None:
        """Raise if, since ``member``'s forward replayed (at ``forward_at``), a graph replayed that was not captured
        while that forward's saved activations were held (after its forward's capture, before its backward's): its
        memory may be where they are, and the backward would read what it wrote."""
        lo, hi = self.captured_at["forward"][member], self.captured_at["backward"][member] or self.clock + 1
        for phase, replayed in self.replayed_at.items():
            for at, captured in zip(replayed, self.captured_at[phase]):
                if at > forward_at and not lo < captured < hi:
                    raise RuntimeError(
                        f"CUDAGraphed({name}): between this module's replayed forward and its backward, another "
                        "replay (or this module's forward again) wrote to memory where this forward's saved "
                        "activations may be; the gradients would be wrong. Captured modules must run in the order of "
                        "the step they were captured in, each once per step. Name only modules that run once in a "
                        "fixed order (cuda_graphs=[...]), or turn graphs off (cuda_graphs=False)"
                    )


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)


class _StaticInput:
    """Memory that captures read an input from, and which tensor it holds: each call copies its input there,
    unless the memory holds that very tensor already (the same object at the same version, written in this
    step's forwards), as when several captured modules are given the same tensor and share it."""

    def __init__(self, local: torch.Tensor, member: int) -> None:
        self.memory = local.detach().clone()
        self.readers = [member]  # the pool members that read it
        self.source: weakref.ref | None = None  # the tensor last written here, its version and the pool's clock
        self.version = self.written_at = -1

    def holds(self, a: torch.Tensor, since: int) -> bool:
        """Whether the memory holds ``a`` as it is now, written at or after the pool's clock read ``since``."""
        held = self.source is not None and self.source() is a
        return held and _version(a) == self.version and self.written_at >= since

    def write(self, a: torch.Tensor, clock: int) -> None:
        with torch.no_grad():
            self.memory.copy_(_local(a))
        self.source, self.version, self.written_at = weakref.ref(a), _version(a), clock


def _version(a: torch.Tensor) -> int:
    with _Plain():  # a shard's version is its local tensor's; reading it needs no op layer
        return a._version


@contextmanager
def _capturing(graph: torch.cuda.CUDAGraph, pool: Any) -> Iterator[None]:
    """``torch.cuda.graph`` with Python's automatic garbage collection held off: a collection during the capture that
    frees a dead cycle holding another CUDA graph (an earlier model's) destroys that graph mid-capture, which CUDA
    forbids, and the capture fails (torch no longer collects before a capture). Where the capture fails, the thread's
    stream is made current again and the CUDA random number generator leaves capture mode (a capture that ends does
    that), so that eager code can run after it: a failed ``torch.cuda.graph`` leaves both as they were inside it
    (torch 2.11)."""
    stream, collecting = torch.cuda.current_stream(), gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    except BaseException:
        torch.cuda.set_stream(stream)
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
            torch.zeros(1, device=stream.device)
        raise
    finally:
        if collecting:
            gc.enable()


class _Graphs:
    """One capture: the forward and backward graphs, their static inputs, outputs and gradients."""

    def __init__(
        self, module: nn.Module, flat: list, spec, pool: _Pool, on_failure: Callable, reserve: int = 0
    ) -> None:
        self.name, self.on_failure = type(module).__name__, on_failure
        self.params = tuple(p for p in module.parameters() if p.requires_grad)
        self.pointers = tuple(p.data_ptr() for p in self.params)
        self.is_tensor = [_is(a) for a in flat]
        # the call's tensors in fixed memory, and the capture's leaves over it (plain: autograd must not see a
        # shard): ``.data`` aliases, so that writing an input does not count as an in-place change of a tensor the
        # forward saved (autograd would refuse the backward captured after it)
        self.pool, self.index = pool, pool.join()
        tensors = [a for a in flat if _is(a)]
        self.inputs = [pool.static_input(a, self.index) for a in tensors]
        self.static_in = [m.memory.data.requires_grad_(a.requires_grad) for m, a in zip(self.inputs, tensors)]
        layouts = [_layout(a) for a in tensors]
        needs = [a for a in self.static_in if a.requires_grad]
        self.input_needs_grad = [t and a.requires_grad for a, t in zip(flat, self.is_tensor)]
        # The capture reads detached aliases of the parameters (same memory, so a replay sees the optimizer's
        # updates) as its leaves: the parameters' own AccumulateGrad nodes, which DDP keeps alive, were made on the
        # default stream, and a backward reaching them from the capture's stream would invalidate the capture.
        # (Parameters, as the module's own are: compiled code guards on their type.)
        names = [n for n, p in module.named_parameters() if p.requires_grad]
        leaves = [nn.Parameter(p.detach()) for p in self.params]
        wrt = needs + leaves

        def forward():
            # shards and their local views made here: the alias nodes between them must run on the capture's
            # stream in the backward
            shards = iter([wrap(t, layout) for t, layout in zip(self.static_in, layouts)])
            static = [next(shards) if _is(a) else a for a in flat]
            args, kwargs = tree_unflatten(static, spec)
            with _uncached_autocast():
                return functional_call(module, dict(zip(names, leaves)), tuple(args), kwargs)

        # where the backward writes the parameters' gradients: memory outside the pool (see ``_gradient_memory``)
        self.param_grads: list[torch.Tensor | None] = _gradient_memory(self.params)
        self.input_grads: list[torch.Tensor | None] = []
        rng = torch.get_rng_state(), torch.cuda.get_rng_state()
        _rehearse(module, forward, wrt)
        torch.set_rng_state(rng[0])  # the rehearsal's random numbers are not the step's: the replay draws those
        torch.cuda.set_rng_state(rng[1])
        self.forward_graph = torch.cuda.CUDAGraph()
        # thread_local: a DataLoader's pin-memory thread may call CUDA while we capture
        self.reserved = reserve
        with _capturing(self.forward_graph, pool.handle):
            _reserve(self.reserved)
            out = forward()
            flat_out, self.out_spec = tree_flatten(out)
            outs = [o for o in flat_out if _is(o)]
            local_outs = [_local(o) for o in outs]
        # per output position: (True, the layout a tensor is returned with) or (False, a constant returned as is)
        self.out_slots = [(True, _layout(o)) if _is(o) else (False, o) for o in flat_out]
        self.static_out = [o.detach() for o in local_outs]
        self.out_needs_grad = [o.requires_grad for o in outs]
        differentiable = [o for o in local_outs if o.requires_grad]
        self.static_grad_out = [torch.empty_like(o) for o in differentiable]
        # The backward is captured when the step's backward first reaches it, in the step's order, as an eager
        # step runs it: until then the forward's autograd graph holds its saved activations (no later capture puts
        # memory there), and its capture frees them as it goes, for its own temporaries to reuse.
        self.backward_graph: torch.cuda.CUDAGraph | None = None
        self._backward_of: tuple | None = (differentiable, wrt)
        # what an eager backward needs if the capture fails: the forward, the autocast state it ran under, and the
        # random numbers' state before the forward replayed (a dropout mask is drawn again, the same)
        self._forward, self._wrt, self._autocast = forward, wrt, torch.get_autocast_dtype("cuda")
        self._autocast_on, self.rng_before_forward = torch.is_autocast_enabled("cuda"), None
        del out, flat_out, outs, local_outs, differentiable
        if pool.own:
            self._capture_backward()

    def _capture_backward(self) -> None:
        """The backward recorded as autograd runs it: each parameter's gradient moved into ``param_grads`` as soon
        as it is accumulated (its memory in the pool free again for what follows), the inputs' gradients left in
        the pool (the graph's outputs)."""
        differentiable, wrt = self._backward_of
        self._backward_of = None  # the capture frees the saved activations as it goes
        inputs, leaves = wrt[: len(wrt) - len(self.params)], wrt[len(wrt) - len(self.params) :]
        reached: set[int] = set()
        moves = [
            leaf.register_post_accumulate_grad_hook(_moving_into(memory, i, reached))
            for i, (leaf, memory) in enumerate(zip(leaves, self.param_grads))
        ]
        graph = torch.cuda.CUDAGraph()
        try:
            with _capturing(graph, self.pool.handle):
                torch.autograd.backward(differentiable, self.static_grad_out, inputs=wrt)
        finally:  # the graph's outputs are kept here; no leaf keeps a gradient (after a failure neither)
            for move in moves:
                move.remove()
            self.input_grads = [a.grad for a in inputs]
            for a in wrt:
                a.grad = None
        self.param_grads = [m if i in reached else None for i, m in enumerate(self.param_grads)]  # None: unused
        self.backward_graph = graph
        self._forward = self._wrt = self.rng_before_forward = None
        self.pool.captured(self.index, "backward")

    def replay_backward(self) -> None:
        """The recorded backward, captured first if this is its first call; ``static_grad_out`` holds its input."""
        if self.backward_graph is None:
            try:
                self._capture_backward()
            except Exception as error:  # noqa: BLE001 - whatever stops the capture, this step's gradients are owed
                self._backward_eagerly(error)
                return
        self.pool.replaying(self.index, "backward")
        self.backward_graph.replay()

    def _backward_eagerly(self, error: Exception) -> None:
        """The gradients of the replayed forward by an eager forward and backward on the same inputs, parameters and
        random numbers; the module runs eagerly from now on (``on_failure``)."""
        torch.cuda.synchronize()
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
            torch.cuda.set_rng_state(self.rng_before_forward)
            with torch.enable_grad(), torch.autocast("cuda", self._autocast, enabled=self._autocast_on):
                outs = [_local(o) for o in tree_flatten(self._forward())[0] if _is(o) and o.requires_grad]
            grads = torch.autograd.grad(outs, self._wrt, self.static_grad_out, allow_unused=True)
        torch.cuda.synchronize()
        inputs = len(grads) - len(self.params)
        self.input_grads, self.param_grads = list(grads[:inputs]), list(grads[inputs:])
        self._forward = self._wrt = None
        self.on_failure(error)

    def fits(self) -> bool:
        """The parameters still live where the graphs read them (``.to()`` or a reload that reallocates moves
        them; the optimizer's in-place steps do not)."""
        return all(p.data_ptr() == ptr for p, ptr in zip(self.params, self.pointers))

    def load(self, flat: list) -> bool:
        """This call's inputs written where the graphs read them (``_Pool.load``); False where they cannot be."""
        return self.pool.load(self.index, self.inputs, [a for a, t in zip(flat, self.is_tensor) if t])

    def __call__(self, flat: list) -> Any:
        """The replay, its inputs loaded."""
        edges = [_local(a) for a, needs in zip(flat, self.input_needs_grad) if needs]
        outs = iter(_Replay.apply(self, *edges, *self.params))
        flat_out = [wrap(next(outs), value) if tensor else value for tensor, value in self.out_slots]
        return tree_unflatten(flat_out, self.out_spec)


def _reserve(nbytes: int) -> None:
    """One free range of ``nbytes`` in the pool being captured into (unless it has one): what the capture then
    allocates is split from it and merges back into it when freed (the module docstring says why). Allocating
    records no kernel."""
    if nbytes > 0:
        torch.empty(nbytes, dtype=torch.uint8, device="cuda")  # freed at once, the range left in the pool


def _rehearse(module: nn.Module, forward, wrt: list[torch.Tensor]) -> None:
    """The capture's forward and backward once, uncaptured, the module's buffers restored after: whatever compiles
    or allocates on a first call under the capture's conditions (compiled code meeting leaves or an autocast state
    its warm-up calls did not show it) does so here, where it may, not inside the capture."""
    buffers = [(b, b.clone()) for b in module.buffers()]
    outs = [_local(o) for o in tree_flatten(forward())[0] if _is(o) and o.requires_grad]
    if outs:
        torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)
    with torch.no_grad():
        for b, saved in buffers:
            b.copy_(saved)


class _Replay(torch.autograd.Function):
    """The recorded forward as one autograd node; its backward replays the recorded backward. What it returns to
    other nodes is copied out of the graph's memory, which a graph of the same pool may reuse before they read it:
    the outputs, the inputs' gradients. The parameters' gradients are in memory of their own (``_gradient_memory``),
    which autograd adopts as ``.grad``."""

    @staticmethod
    def forward(ctx, graphs: _Graphs, *edges: torch.Tensor):
        ctx.graphs = graphs
        ctx.replayed_at = graphs.pool.replaying(graphs.index, "forward")
        if graphs.backward_graph is None:  # until its capture: what an eager backward would need
            graphs.rng_before_forward = torch.cuda.get_rng_state()
        graphs.forward_graph.replay()
        outs = tuple(o.clone() for o in graphs.static_out)
        ctx.mark_non_differentiable(*(o for o, needs in zip(outs, graphs.out_needs_grad) if not needs))
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        graphs = ctx.graphs
        graphs.pool.check_saved(graphs.index, ctx.replayed_at, graphs.name)
        graphs.pool.close()
        differentiable = (g for g, needs in zip(grads, graphs.out_needs_grad) if needs)
        for static, g in zip(graphs.static_grad_out, differentiable):
            if g is None:
                static.zero_()
            else:
                static.copy_(_local(g))
        _out_of_the_way(graphs.params, graphs.param_grads)
        graphs.replay_backward()
        to_inputs = (None if g is None else g.clone() for g in graphs.input_grads)
        return (None, *to_inputs, *_as_gradients(graphs.params, graphs.param_grads))


def noting_bucket_views(hook: Callable) -> Callable:
    """A DDP communication hook (``gradient_as_bucket_view=True``) that first notes where DDP keeps each parameter's
    gradient, its bucket view (``.grad`` is that view by the time the bucket is reduced), then runs ``hook``. A
    backward captured after that writes the gradients there: autograd adopts that memory as ``.grad`` and DDP finds
    it in its bucket, with no copy. (It walks every parameter each step: for runs that replay.) The views are the
    current run's (``Run.bucket_views``) and go with it: they hold DDP's buckets, a gradient-sized buffer, alive."""

    def noting_hook(state, bucket):
        views = run.current().bucket_views
        storage = bucket.buffer().untyped_storage().data_ptr()
        for param in bucket.parameters():
            if param.grad is not None and param.grad.untyped_storage().data_ptr() == storage:
                views[param] = param.grad
        return hook(state, bucket)

    return noting_hook


def _gradient_memory(params: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Where a replayed backward writes each parameter's gradient: its DDP bucket view where one is noted (autograd
    adopts it as ``.grad`` and DDP finds it in place: no copy), else memory of its own, laid out as the parameter
    (autograd adopts it too). Outside the graphs' pool, so the gradients are held once, not once there and once
    in ``.grad``; the next replay writes the same memory again (``_out_of_the_way``)."""
    views = run.current().bucket_views
    found = [views.get(p) for p in params]
    return [v if v is not None and _same_layout(v, p) else torch.empty_like(p) for p, v in zip(params, found)]


def _moving_into(memory: torch.Tensor, index: int, reached: set[int]) -> Callable:
    """A hook run after autograd accumulates a capture's parameter gradient: recorded, a copy into ``memory``; the
    gradient itself is dropped, so its memory in the pool is reused by the rest of the backward."""

    def move(leaf: torch.Tensor) -> None:
        memory.copy_(leaf.grad)
        leaf.grad = None
        reached.add(index)

    return move


def _out_of_the_way(params: tuple[torch.Tensor, ...], grads: list[torch.Tensor | None]) -> None:
    """A ``.grad`` that is the memory the next replay writes (the gradient the last one handed over, still there:
    accumulation, or the same parameter in two captures) is copied out of its way first, to be added to."""
    for p, g in zip(params, grads):
        held = p.grad
        if held is not None and g is not None and held.data_ptr() == g.data_ptr():
            p.grad = held.clone()


def _as_gradients(params: tuple[torch.Tensor, ...], grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """What autograd gets for each parameter: where ``.grad`` is None (Lightning sets it so after every step), a
    fresh alias of the replay's output, which it adopts as ``.grad`` (DDP's bucket view: found in place); else the
    output itself, added to ``.grad``."""
    return [g.detach() if g is not None and p.grad is None else g for p, g in zip(params, grads)]


class _uncached_autocast:
    """The caller's autocast state without its cast cache: a capture must record the weights' casts (a cached
    cast made before the capture would be read from memory nobody refreshes)."""

    def __enter__(self) -> None:
        self.ctx = (
            torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
            if torch.is_autocast_enabled("cuda")
            else None
        )
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


class CUDAGraphed(nn.Module):
    """``module`` whose training forward and backward replay CUDA graphs after ``warmup`` eager calls; see the
    module docstring."""

    def __init__(self, module: nn.Module, warmup: int = 2, max_signatures: int = 4) -> None:
        super().__init__()
        if warmup < 1:
            raise ValueError(f"CUDAGraphed: warmup={warmup}; at least one eager call must precede the capture")
        self.module = module
        self.warmup, self.max_signatures = warmup, max_signatures
        self._graphs: dict[tuple, _Graphs] = {}
        self._eager_calls: dict[tuple, int] = {}
        self._kept: dict[tuple, int] = {}  # per signature, bytes its last warm-up forward left allocated
        self._warned: set[str] = set()
        self._failed = False
        self._register_state_dict_hook(_without_wrapper)
        self.register_load_state_dict_pre_hook(_with_wrapper)

    def __getattr__(self, name: str) -> Any:
        """The wrapped module's other methods and attributes (a detection head's ``loss``, called by its owner): only
        ``forward`` replays."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    @property
    def captured(self) -> bool:
        """Whether a capture holds: False before the warm-up ends, and for good once a capture failed."""
        return bool(self._graphs)

    @torch.compiler.disable  # opaque to a compiled caller (dynamo must not trace a capture); a compiled module
    def forward(self, *args: Any, **kwargs: Any) -> Any:  # inside still runs compiled
        flat, spec = tree_flatten((args, kwargs))
        if any(isinstance(a, SpatialTensor) and type(a) is not SpatialTensor for a in flat):
            # a sum still pending (ops.pending): reduced here, so that a capture copies the shard it reduces to
            flat = [settled(a) for a in flat]
            args, kwargs = tree_unflatten(flat, spec)
        key = self._signature(flat, spec)
        if key is None:
            return self.module(*args, **kwargs)
        graphs = self._graphs.get(key)
        if graphs is not None and graphs.fits():
            if graphs.load(flat):
                return graphs(flat)
            self._warn_once(
                f"CUDAGraphed({type(self.module).__name__}): a call runs eagerly: an input of its capture shares "
                "memory with another captured module's, which still needs what it holds (the two were given the "
                "same tensor when captured, different ones now)"
            )
            return self.module(*args, **kwargs)
        calls = self._eager_calls[key] = self._eager_calls.get(key, 0) + 1
        if calls <= self.warmup:
            device = next(a.device for a in flat if _is(a))
            before = torch.cuda.memory_allocated(device)
            with _uncached_autocast():  # as the capture will run it: compiled code guards on the cast cache
                out = self.module(*args, **kwargs)
            self._kept[key] = max(torch.cuda.memory_allocated(device) - before, 0)  # a forward may free more
            return out
        if graphs is None and len(self._graphs) >= self.max_signatures:  # each capture holds its activations
            if not self._failed:  # after a failed capture that warning said enough
                self._warn_once(
                    f"CUDAGraphed({type(self.module).__name__}): inputs of more than {self.max_signatures} shapes or "
                    "layouts; new ones run eagerly (each capture keeps its activations' memory). Pad or bucket inputs "
                    "to a few sizes, or raise max_signatures"
                )
            return self.module(*args, **kwargs)
        pool = _Pool.for_capture(self.module)
        try:
            graphs = _Graphs(self.module, flat, spec, pool, self._capture_failed, self._kept.pop(key, 0))
            self._graphs[key] = graphs
        except Exception as error:  # noqa: BLE001 - whatever stops a capture, the module still runs, eagerly
            pool.close()  # later captures go to a new pool, not one a capture failed in
            self._capture_failed(error)
            return self.module(*args, **kwargs)
        graphs.load(flat)  # nobody else reads its memory, or it holds this very tensor already
        return graphs(flat)

    def _capture_failed(self, error: Exception) -> None:
        """From now on eager: a capture that failed once (a host synchronisation, a data-dependent shape, an op the
        graph cannot hold) would fail again."""
        self.max_signatures, self._graphs, self._failed = 0, {}, True
        torch.cuda.synchronize()
        warnings.warn(
            f"CUDAGraphed({type(self.module).__name__}) runs eagerly: its capture failed with "
            f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}",
            stacklevel=3,
        )

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=3)

    def _signature(self, flat: list, spec) -> tuple | None:
        """What a capture depends on, or None where it must run eagerly."""
        tensors = [a for a in flat if _is(a)]
        if not torch.is_grad_enabled() or not tensors or any(not a.is_cuda for a in tensors):
            return None
        if torch.cuda.is_current_stream_capturing():
            return None
        key: list = [
            spec,
            self.module.training,
            torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"),
        ]
        for a in flat:
            if _is(a):
                local = _local(a)
                key.append((tuple(local.shape), local.stride(), local.dtype, local.device, a.requires_grad, _layout(a)))
            else:
                key.append(a)
        try:
            hash(tuple(key))
        except TypeError:  # an argument a key cannot hold: nothing to tell two calls apart by
            return None
        return tuple(key)


def _without_wrapper(module, state_dict, prefix, local_metadata):
    """State dict keys as the unwrapped module has them: ``backbone.stem.weight``, not ``backbone.module.stem...``."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _with_wrapper(module, state_dict, prefix, *args):
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


__all__ = ["CUDAGraphed", "noting_bucket_views"]
