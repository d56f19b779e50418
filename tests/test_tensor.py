"""The sharded activation: shard/gather round trips, halo windows, element-wise ops and the exact fallback."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_spatial import LayoutError, SpatialFallbackWarning, SpatialTensor, fallback_mode, gather, shard
from lightning_spatial.layout import partition, source_index
from lightning_spatial.primitives import Axis, DimShard, Layout, fetch_window, wrap
from lightning_spatial.run import Run, entered
from tests.oracle import assert_rel_close, check
from tests.spmd import LAYOUTS, axes, run_spmd

LAYOUT_NAMES = list(LAYOUTS)


def _round_trip(layout):
    torch.manual_seed(0)
    full = torch.randn(2, 3, 7, 97)
    x = shard(full, axes(layout))
    assert isinstance(x, SpatialTensor)
    assert x.shape == full.shape and x.size(-1) == 97 and x.numel() == full.numel() and len(x) == 2
    for s in x.shard_layout.shards:
        assert x.to_local().shape[s.dim] == s.stop - s.start
    assert torch.equal(gather(x), full)


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_shard_gather_round_trip(layout):
    run_spmd(_round_trip, LAYOUTS[layout][0], layout)


def _window_case(n, windows, mode, compiled):
    """Every rank asks for an arbitrary window; compare with indexing the full tensor, and the adjoint. Compiled,
    the window is traced (copies as tensor ops around the ``exchange`` op) and must be the same."""
    torch.manual_seed(1)
    axis = Axis.from_group()
    full = torch.randn(2, n, dtype=torch.float64)
    upstream = torch.randn(len(windows), 2, max(b - a for a, b in windows), dtype=torch.float64)
    x = shard(full, {-1: axis})
    local = x.to_local().clone().requires_grad_()

    def fetch(t):
        return fetch_window(t, x.shard_layout.shards[0], windows, mode)

    out = (torch.compile(fetch, backend="aot_eager", fullgraph=True) if compiled else fetch)(local)
    a, b = windows[axis.index]
    rows = [source_index(p, n, mode) for p in range(a, b)]
    expected = torch.stack([full[:, i] if i >= 0 else torch.zeros(2, dtype=full.dtype) for i in rows], -1)
    assert torch.equal(out.detach(), expected)
    (out * upstream[axis.index, :, : b - a]).sum().backward()
    lo, hi = partition(n, axis.size)[axis.index]
    assert_rel_close(local.grad, _scattered(upstream, windows, n, mode)[:, lo:hi], "window gradient")


def _scattered(upstream: torch.Tensor, windows, n: int, mode: str = "zeros") -> torch.Tensor:
    """Every rank's upstream gradient of its window (``upstream[rank]``), added to the rows the window read."""
    grad_full = upstream.new_zeros(upstream.shape[1], n)
    for r, (a, b) in enumerate(windows):
        for j, p in enumerate(range(a, b)):
            if source_index(p, n, mode) >= 0:
                grad_full[:, source_index(p, n, mode)] += upstream[r, :, j]
    return grad_full


@pytest.mark.parametrize(
    "n,windows,mode",
    [
        (10, [(-2, 7), (3, 12)], "zeros"),
        (10, [(0, 10), (-3, 13)], "reflect"),  # each rank fetches everything, padded
        (7, [(-3, 4), (-1, 6), (2, 10)], "circular"),  # shards of 3, 2, 2: data from two ranks away
        (7, [(4, 7), (0, 2), (-2, 1)], "replicate"),  # windows far from the rank's own rows
        (9, [(0, 3), (3, 6), (6, 9)], "zeros"),  # exactly the own rows: a view, no messages
        (6, [(0, 4), (3, 6)], "zeros"),  # rank 1 only sends, and receives only the gradient of what it sent
    ],
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fetch_window(n, windows, mode, compiled):
    run_spmd(_window_case, len(windows), n, windows, mode, compiled)


def _shared_gradient_case(own_grad):
    """A window whose gradient another tensor reads too (``window + other``: the add hands both the same tensor)
    takes a copy of its rows; with ``own_grad`` (a convolution's fresh input gradient) the rows are a view of it,
    the halos' gradients added in place. The rows' gradient is right either way."""
    torch.manual_seed(4)
    n, halo = 12, 2
    full = torch.randn(2, n, dtype=torch.float64)
    x = shard(full, {-1: Axis.from_group()})
    s = x.shard_layout.shards[0]
    windows = [(a - halo, b + halo) for a, b in s.bounds]
    upstream = torch.randn(s.axis.size, 2, n // 2 + 2 * halo, dtype=torch.float64)  # every rank's, alike
    local = x.to_local().clone().requires_grad_()
    other = torch.randn(upstream.shape[1:], dtype=torch.float64, requires_grad=True)
    reader = other.clone()  # created first, its backward runs after the fetch's and reads what that left
    window = fetch_window(local, s, windows, own_grad=own_grad)
    ((window + reader) * 1).backward(upstream[s.axis.index])  # ``* 1``: the add's gradient is fresh and dense
    assert torch.equal(other.grad, upstream[s.axis.index]) != own_grad  # written in place only when owned
    a, b = s.bounds[s.axis.index]
    assert_rel_close(local.grad, _scattered(upstream, windows, n)[:, a:b], "window gradient")


@pytest.mark.parametrize("own_grad", [False, True])
def test_a_window_gradient_read_by_others_is_not_written(own_grad):
    run_spmd(_shared_gradient_case, 2, own_grad)


def _elementwise_case(layout):
    torch.manual_seed(2)
    x, y, gate, bias = torch.randn(2, 4, 6, 11), torch.randn(2, 4, 6, 11), torch.randn(2, 4, 1, 1), torch.randn(4, 1, 1)
    pos = torch.randn(4, 6, 11)  # a replicated full-size operand (e.g. a position embedding): sliced per rank

    def op(x, y, gate, bias, pos):
        z = torch.nn.functional.gelu(x) * torch.sigmoid(gate) + y.relu() - bias + pos
        z = z / 2 + x.clamp(-0.5, 0.5) ** 2 + torch.arange(z.shape[-1]) * 0.1  # global column index
        # options passed by keyword, as modules pass them (nn.GELU: approximate=, nn.ReLU: inplace=)
        z = torch.add(z, torch.nn.functional.gelu(y, approximate="tanh"), alpha=0.5)
        z = torch.nn.functional.relu(z * 1.5, inplace=True) - torch.nn.functional.leaky_relu(z, negative_slope=0.2)
        return torch.where(z > 0, z, -z).float().contiguous()

    check(op, [x, y, gate, bias, pos], sharded=[0, 1], axes=axes(layout))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_elementwise_ops_keep_the_layout(layout):
    run_spmd(_elementwise_case, LAYOUTS[layout][0], layout)


def _fallback_case(layout):
    torch.manual_seed(3)
    full = torch.randn(2, 3, 6, 11)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(lambda x: torch.roll(x, (1, 2), (-1, -2)).cumprod(-1), [full], [0], axes(layout), allow_fallback=True)
        check(lambda x: x.sum(dim=(-1, -2)), [full], [0], axes(layout), allow_fallback=True)
        check(lambda x: torch.median(x, -1), [full], [0], axes(layout), allow_fallback=True)  # global indices
    names = " ".join(str(w.message) for w in caught)
    assert "torch.roll" in names and "Tensor.cumprod" in names and "torch.median" in names
    # in place: the write lands in the right shard
    x = shard(full.clone(), axes(layout))
    x[..., 0, 0] = 5.0
    expected = full.clone()
    expected[..., 0, 0] = 5.0
    assert torch.equal(gather(x), expected)


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_unhandled_ops_fall_back_exactly_with_a_warning(layout):
    run_spmd(_fallback_case, LAYOUTS[layout][0], layout)


def _double_backward_case():
    from lightning_spatial.tensor import wrap

    x = shard(torch.randn(1, 2, 4, 8), {-1: Axis.from_group()})
    local, w = x.to_local().clone().requires_grad_(), torch.randn(2, 2, 3, 3)
    halo = torch.nn.functional.conv2d(wrap(local, x.shard_layout), w, padding=1).to_local().square().sum()
    reduction = wrap(local, x.shard_layout).square().sum().square()  # an all-reduce, no halo
    with pytest.warns(UserWarning, match="no spatial handler"):
        gathered = wrap(local, x.shard_layout).square().cumprod(-1).to_local().square().sum()  # the fallback's gather
    for loss in (halo, reduction, gathered):
        (grad_x,) = torch.autograd.grad(loss, local, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            grad_x.square().sum().backward()  # an input-gradient penalty: messages carry no graph, so refuse


def test_second_derivative_through_communication_is_refused():
    run_spmd(_double_backward_case, 2)


def _inplace_case(layout):
    """An in-place op (or ``out=``) on a replicated tensor with a sharded operand writes all of it, on every rank."""
    torch.manual_seed(6)
    full, plain = torch.randn(2, 3, 6, 11), torch.randn(2, 3, 6, 11)
    x = shard(full, axes(layout))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpatialFallbackWarning)
        y = plain.clone()
        assert y.add_(x) is y and torch.equal(y, plain + full)
        y = plain.clone()
        y *= x
        assert type(y) is torch.Tensor and torch.equal(y, plain * full)
        y = torch.empty_like(plain)
        torch.mul(x, 2.0, out=y)
        assert torch.equal(y, full * 2)
    z = shard(plain, axes(layout))  # a sharded target takes the replicated source's part, no gather
    z.copy_(full)
    assert torch.equal(gather(z), full)


@pytest.mark.parametrize("layout", ["w3", "2x2"])
def test_inplace_ops_on_replicated_tensors_write_the_whole_tensor(layout):
    run_spmd(_inplace_case, LAYOUTS[layout][0], layout)


class _Block(torch.nn.Module):
    def forward(self, x):
        return torch.roll(x, 1, -1)


def _orphan(local_shape, global_width):
    """A shard over an axis without a process group here: an attempt to communicate raises RuntimeError."""
    return wrap(torch.randn(local_shape), Layout((DimShard(-1, Axis((0, 1), 0), global_width),)))


def test_results_become_shards_without_changing_what_the_caller_holds():
    """Handlers turn a result they computed into the SpatialTensor itself (``tensor.adopt``, no alias); tensors
    user code holds (replicated operands, weights, an operand an op returns as it is) keep their class."""
    import torch.nn.functional as F

    from lightning_spatial.ops.elementwise import elementwise

    x = _orphan((2, 4, 3, 5), 10)  # global 2 x 4 x 3 x 10; none of these ops communicates
    plain, weight, norm, kernel = torch.randn(1, 4, 1, 10), torch.randn(6, 4), torch.randn(4), torch.randn(6, 4, 1, 1)
    results = {
        "mul": x * plain,
        "rmul": plain * x,
        "where": torch.where(x > 0, x, plain),
        "permute": x.permute(0, 2, 3, 1),
        "linear": F.linear(x.permute(0, 2, 3, 1), weight),
        "layer_norm": F.layer_norm(x.permute(0, 2, 3, 1), (4,), norm, norm),
        "conv1x1": F.conv2d(x, kernel),
    }
    for name, out in results.items():
        assert type(out) is SpatialTensor and out.to_local().numel() * 2 == out.numel(), name  # half the columns
    assert all(type(t) is torch.Tensor for t in (plain, weight, norm, kernel))
    held = torch.randn(1, 4, 1, 1)  # broadcasts: reaches the op as it is
    assert elementwise(lambda a, b: b)(x, held) is not held and type(held) is torch.Tensor  # an op that returned it
    assert torch.equal(results["mul"].to_local(), x.to_local() * plain[..., :5])  # rank 0's columns
    assert x.contiguous() is x and x.float() is x and type(x) is SpatialTensor  # operands returned as they are


def test_fallback_is_announced_before_any_communication_with_op_module_and_bytes():
    x = _orphan((1, 4, 128, 512), 1024)  # global 1 x 4 x 128 x 1024 float32: 2 MiB
    block = _Block()
    with entered(Run(module_names={id(block): "backbone.stage1"})):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", category=SpatialFallbackWarning)
            for _ in range(2):  # raised, so not marked as announced: the filter raises again
                with pytest.raises(SpatialFallbackWarning) as caught:
                    block(x)
        message = str(caught.value)
        assert "torch.roll in module 'backbone.stage1' (_Block)" in message
        assert "gathering 2.00 MiB (1 sharded operand)" in message and "docs/ops.md" in message
        with fallback_mode("error"), pytest.raises(LayoutError, match=r"torch.roll in module .* would gather 2.00 MiB"):
            block(x)
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            for _ in range(2):  # "warn": announced once per op and module, then it gathers (no group: raises)
                with pytest.raises(RuntimeError, match="no process group"):
                    block(x)
            with pytest.raises(RuntimeError, match="no process group"):
                torch.roll(x, 1, -1)  # outside the module: announced again, without a module
            with fallback_mode("silent"), pytest.raises(RuntimeError, match="no process group"):
                torch.cumprod(x, -1)
        assert [w.category for w in records] == [SpatialFallbackWarning] * 2
        assert "in module" not in str(records[1].message) and records[0].filename == __file__  # the user's line
