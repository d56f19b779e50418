"""User ``torch.autograd.Function``s on shards: forward and backward see SpatialTensors, and train as on one device."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import lightning_spatial
from lightning_spatial import LayoutError, SpatialFallbackWarning, SpatialTensor, shard
from lightning_spatial.primitives import wrap
from tests.ops.cases import DTYPES, check_cases
from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd

B, C, H = 2, 3, 5


def _w(layout: str) -> int:
    return 7 if layout == "w3" else 6


class MemoryEfficientSwish(torch.autograd.Function):
    """EfficientNet-PyTorch's ``SwishImplementation``: saves the input only, recomputes the sigmoid."""

    @staticmethod
    def forward(ctx, i):
        ctx.save_for_backward(i)
        return i * torch.sigmoid(i)

    @staticmethod
    def backward(ctx, grad_output):
        (i,) = ctx.saved_tensors
        sigmoid_i = torch.sigmoid(i)
        return grad_output * (sigmoid_i * (1 + i * (1 - sigmoid_i)))


class StraightThroughQuantize(torch.autograd.Function):
    """Rounds to a learned step; the gradient passes straight through to the input, the step gets its own."""

    @staticmethod
    def forward(ctx, x, step):
        ctx.save_for_backward(x, step)
        return torch.round(x / step) * step

    @staticmethod
    def backward(ctx, grad):
        x, step = ctx.saved_tensors
        return grad, (grad * (torch.round(x / step) - x / step)).sum(dim=(0, 2, 3), keepdim=True)


class ScaledExp(torch.autograd.Function):
    """Saves its input and its output (an output comes back from autograd as a new tensor)."""

    @staticmethod
    def forward(ctx, x, scale):
        y = x.exp() * scale
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * y, (grad * y / ctx.saved_tensors[1].div(x.exp())).sum(dim=(0, 2, 3), keepdim=True)


class SoftplusWithSetupContext(torch.autograd.Function):
    """The torch 2 style: ``forward`` without ctx, ``setup_context`` saves the output."""

    @staticmethod
    def forward(x, beta):
        return torch.nn.functional.softplus(x, beta)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.beta = inputs[1]
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - torch.exp(-ctx.beta * y)), None


class MapAndTotal(torch.autograd.Function):
    """Two outputs, one sharded and one replicated (a total over the map): backward gets the true gradient of each."""

    @staticmethod
    def forward(ctx, x):
        y = x.square()
        ctx.save_for_backward(x)
        return y, y.sum(dim=(1, 2, 3))

    @staticmethod
    def backward(ctx, grad_map, grad_total):
        (x,) = ctx.saved_tensors
        return 2 * x * (grad_map + grad_total[:, None, None, None])


class Identity(torch.autograd.Function):
    """Returns its input unchanged (autograd hands back an alias) and scales the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


class RowCentre(torch.autograd.Function):
    """Needs the whole row: a mean along the (sharded) width in forward and backward."""

    @staticmethod
    def forward(ctx, x):
        return x - x.mean(dim=-1, keepdim=True)

    @staticmethod
    def backward(ctx, grad):
        return grad - grad.mean(dim=-1, keepdim=True)


def _map(layout):
    return torch.randn(B, C, H, _w(layout))


def _positive(layout):
    return torch.rand(1, C, 1, 1) + 0.5


CASES = {
    "memory_efficient_swish": (lambda lay: [_map(lay)], MemoryEfficientSwish.apply, [0]),
    "straight_through_with_a_learned_step": (
        lambda lay: [_map(lay) * 3, _positive(lay)],
        StraightThroughQuantize.apply,
        [0],
    ),
    "saves_input_and_output": (lambda lay: [_map(lay), _positive(lay)], ScaledExp.apply, [0]),
    "setup_context_style": (lambda lay: [_map(lay)], lambda x: SoftplusWithSetupContext.apply(x, 1.5), [0]),
    "a_sharded_and_a_replicated_output": (lambda lay: [_map(lay)], MapAndTotal.apply, [0]),
    "input_returned_unchanged": (lambda lay: [_map(lay)], lambda x: Identity.apply(x) * x, [0]),
    "needs_the_whole_row": (lambda lay: [_map(lay)], RowCentre.apply, [0]),
    "reentrant_checkpoint": (  # torch's own Function, whose backward re-enters autograd
        lambda lay: [_map(lay), torch.randn(4, C, 3, 3)],
        lambda x, w: checkpoint(lambda x, w: F.conv2d(F.gelu(x), w, padding=1), x, w, use_reentrant=True),
        [0],
    ),
    "functions_in_a_row": (
        lambda lay: [_map(lay), _positive(lay)],
        lambda x, s: ScaledExp.apply(MemoryEfficientSwish.apply(StraightThroughQuantize.apply(x, s)), s),
        [0],
    ),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_user_functions_match_one_device(layout, dtype):
    run_spmd(check_cases, LAYOUTS[layout][0], layout, dtype, CASES)


def _of_a_pending_sum(layout, dtype):
    torch.manual_seed(0)
    feats = torch.randn(B, C, 8, 12, dtype=dtype)
    grid = torch.rand(B, 7, 5, 2, dtype=dtype) * 2.2 - 1.1  # a 7 x 5 BEV grid sampled from the image
    weight = torch.randn(C, C, 3, 3, dtype=dtype)

    def op(x):
        bev = F.grid_sample(x, grid, align_corners=False)  # a sum still pending into the grid
        return F.conv2d(MemoryEfficientSwish.apply(bev), weight, padding=1)

    check(op, [feats], sharded=[0], axes=axes(layout), bev_shard={"w2": "x", "w3": "y"}.get(layout, "xy"))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_function_of_a_pending_bev_sum(layout, dtype):
    """A Function applied to a splat's sum still pending (``bev_shard``) sees the shard it reduces to; its input's
    gradient was that of a replicated tensor (divided by the ranks) before."""
    run_spmd(_of_a_pending_sum, LAYOUTS[layout][0], layout, DTYPES[dtype])


def _sees_shards(layout):
    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = x * 2
            ctx.save_for_backward(x, y)
            seen.append(("forward input", x))
            return y

        @staticmethod
        def backward(ctx, grad):
            seen.extend([("grad_output", grad), *(("saved", t) for t in ctx.saved_tensors)])
            return grad * 2

    x = shard(torch.randn(B, C, H, _w(layout)), axes(layout)).requires_grad_()
    y = Spy.apply(x)
    assert isinstance(y, SpatialTensor) and y.shard_layout == x.shard_layout
    y.to_local().sum().backward()
    for what, t in seen:
        assert isinstance(t, SpatialTensor) and t.shard_layout == x.shard_layout, what
        assert t.shape == (B, C, H, _w(layout)), what  # global shapes, as on one device
    assert [what for what, _ in seen] == ["forward input", "grad_output", "saved", "saved"]


def test_forward_and_backward_see_shards_saved_tensors_included():
    run_spmd(_sees_shards, 2, "w2")


class LocalKernel(torch.autograd.Function):
    """Stands for a C++/CUDA extension: it reads the local shard's storage, outside torch's dispatch."""

    @staticmethod
    def forward(ctx, x):
        with torch._C.DisableTorchFunction():  # no torch function dispatch, as in C++
            return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class LocalSampler(torch.autograd.Function):
    """Stands for mmcv's CUDA multi-scale deformable attention: replicated queries read sharded values in a kernel
    that sees the local shard only, and whose output has the queries' shape (nothing like a shard's)."""

    @staticmethod
    def forward(ctx, value, weights):
        with torch._C.DisableTorchFunction():  # no torch function dispatch, as in C++
            return value.sum(-1) @ weights

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("not reached")


class LocalGradientKernel(torch.autograd.Function):
    """Torch ops forward, an extension's kernel for the weight's gradient in backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch._C.DisableTorchFunction():  # no torch function dispatch, as in C++
            return None, (grad * x).sum().reshape(1)


def _local_kernel(layout):
    x = shard(torch.randn(B, C, H, _w(layout)), axes(layout))
    with pytest.raises(LayoutError, match=r"LocalSampler: output 0 was made outside torch's dispatch"):
        LocalSampler.apply(x, torch.randn(H, 2))
    y = LocalGradientKernel.apply(x, torch.ones(1, requires_grad=True))
    with pytest.raises(LayoutError, match=r"LocalGradientKernel: the gradient of input 1 was made outside"):
        y.to_local().sum().backward()
    with pytest.raises(
        LayoutError, match=r"LocalKernel: output 0 was made outside torch's dispatch.*register_handler\(LocalKernel\)"
    ):
        LocalKernel.apply(x)

    # The fix the message names: a handler for the Function class, here running the element-wise kernel per shard
    @lightning_spatial.register_handler(LocalKernel)
    def on_local_shards(x):
        return wrap(LocalKernel.apply(x.to_local()), x.shard_layout)

    try:
        check(LocalKernel.apply, [torch.randn(B, C, H, _w(layout))], [0], axes(layout))
    finally:
        lightning_spatial.remove_handler(LocalKernel)


def test_an_extension_run_on_the_local_shard_raises_and_a_handler_fixes_it():
    run_spmd(_local_kernel, 2, "w2")


class CumulativeMax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        values, indices = x.cummax(-1)
        ctx.save_for_backward(indices)
        return values

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        return torch.zeros_like(grad).scatter_add_(-1, indices, grad)


def _gathers_with_the_warning(layout):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(
            CumulativeMax.apply,
            [torch.randn(B, C, H, _w(layout), dtype=torch.float64)],
            [0],
            axes(layout),
            allow_fallback=True,
        )
    said = {str(w.message).split(" has no")[0] for w in caught if issubclass(w.category, SpatialFallbackWarning)}
    assert said == {"lightning_spatial: Tensor.cummax", "lightning_spatial: Tensor.scatter_add_"}, said
    dist.barrier()


def test_a_function_without_handlers_for_its_ops_takes_the_fallback_with_the_warning():
    run_spmd(_gathers_with_the_warning, 2, "w2")


def test_plain_tensors_take_torchs_apply():
    x = torch.randn(B, C, H, 4, requires_grad=True)
    y = MemoryEfficientSwish.apply(x)
    assert type(y) is torch.Tensor and type(y.grad_fn).__name__ == "MemoryEfficientSwishBackward"
    y.sum().backward()
    expected = torch.sigmoid(x) * (1 + x * (1 - torch.sigmoid(x)))
    torch.testing.assert_close(x.grad, expected)


def test_plain_tensors_compile_through_a_function_in_one_graph():
    """The wrapped ``apply`` is still torch's to dynamo: a Function on plain tensors traces into the graph."""
    f = lambda x, s: ScaledExp.apply(MemoryEfficientSwish.apply(x), s) * 2  # noqa: E731
    x, s = torch.randn(2, 3, 4, 5, requires_grad=True), torch.rand(1, 3, 1, 1, requires_grad=True)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)  # a graph break would raise
    (expected := f(x, s)).sum().backward()
    grads = (x.grad.clone(), s.grad.clone())
    x.grad = s.grad = None
    got = compiled(x, s)
    got.sum().backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close((x.grad, s.grad), grads)


def _compiled_on_shards(layout):
    f = lambda x, s: ScaledExp.apply(MemoryEfficientSwish.apply(x), s) * 2  # noqa: E731
    compiled = torch.compile(f, backend="aot_eager")
    inputs = [torch.randn(B, C, H, _w(layout), dtype=torch.float64), _positive(layout).double()]
    check(lambda x, s: compiled(x, s) if isinstance(x, SpatialTensor) else f(x, s), inputs, [0], axes(layout))


@pytest.mark.skipif(
    torch.__version__ < "2.14",
    reason="torch 2.11's dynamo fails internally on the LayoutError its trace meets (docs/design.md)",
)
def test_compiled_code_runs_a_function_on_shards_eagerly_and_exactly():
    run_spmd(_compiled_on_shards, 2, "w2")
