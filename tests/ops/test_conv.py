"""Convolutions on 2 ranks, 3 uneven ranks, height shards and 2x2 tiles against the single-process op."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from lightning_spatial import shard
from lightning_spatial.primitives import Axis
from lightning_spatial.saved import SavedActivations
from lightning_spatial.tensor import wrap
from tests.oracle import assert_rel_close, check
from tests.spmd import LAYOUTS, axes, run_spmd

LAYOUT_NAMES = list(LAYOUTS)

# (kernel, stride, padding, dilation, groups)
CONV2D = [
    (3, 1, 1, 1, 1),
    (3, 2, 1, 1, 1),
    (3, 2, 0, 1, 1),
    (7, 1, 3, 1, 4),  # ConvNeXt depthwise
    (7, 2, 3, 1, 1),  # ResNet stem
    (4, 4, 0, 1, 1),  # ConvNeXt patchify stem
    (2, 2, 0, 1, 2),
    (1, 1, 0, 1, 1),
    (1, 2, 0, 1, 1),
    (5, 2, 2, 1, 1),
    (3, 1, 2, 2, 1),
    (3, 3, 1, 1, 1),
    ((3, 5), (1, 2), (1, 2), (1, 1), 1),
    ((5, 3), (2, 1), (0, 1), (2, 1), 2),
    (4, 1, "same", 1, 1),  # asymmetric 'same'
    (3, 1, "same", 2, 4),
    (3, 1, "valid", 1, 1),
    (5, 3, 4, 1, 1),  # padding larger than the stride-2/3 halo
]


def _conv2d_case(layout, kernel, stride, padding, dilation, groups, width, memory_format=torch.contiguous_format):
    torch.manual_seed(7)
    c = 4
    k = kernel if isinstance(kernel, tuple) else (kernel, kernel)
    x = torch.randn(2, c, 13, width).contiguous(memory_format=memory_format)
    w = torch.randn(8, c // groups, *k)
    b = torch.randn(8)
    op = functools.partial(_conv2d, stride=stride, padding=padding, dilation=dilation, groups=groups)
    check(op, [x, w, b], sharded=[0], axes=axes(layout))


def _conv2d(x, w, b, **kw):
    return F.conv2d(x, w, b, **kw)


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("kernel,stride,padding,dilation,groups", CONV2D)
def test_conv2d(layout, kernel, stride, padding, dilation, groups):
    width = 97 if layout == "w3" else 24
    run_spmd(_conv2d_case, LAYOUTS[layout][0], layout, kernel, stride, padding, dilation, groups, width)


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("kernel,stride,padding,dilation,groups", [CONV2D[0], CONV2D[1], CONV2D[3]])
def test_conv2d_channels_last(layout, kernel, stride, padding, dilation, groups):
    """Activations in channels_last (ConvNeXt's, after its NHWC blocks): halos travel contiguous and are laid out
    like the window before it is joined."""
    width = 97 if layout == "w3" else 24
    args = (layout, kernel, stride, padding, dilation, groups, width, torch.channels_last)
    run_spmd(_conv2d_case, LAYOUTS[layout][0], *args)


def _thin_case(layout, size):
    # halo of 3 wider than shards of 2 or 3 rows: data comes from two ranks away or is padding; in 2x2 tiles
    # the strips of one dim are widened along the other (corners) with the same thin shards
    torch.manual_seed(3)
    x, w = torch.randn(1, 2, *size), torch.randn(3, 2, 7, 7)
    check(lambda x, w: F.conv2d(x, w, padding=3), [x, w], sharded=[0], axes=axes(layout))
    check(lambda x, w: F.conv2d(x, w, stride=(1, 2), padding=3), [x, w], sharded=[0], axes=axes(layout))


@pytest.mark.parametrize("layout,size", [("w3", (5, 7)), ("2x2", (5, 4)), ("2x2", (3, 3))])
def test_conv2d_halo_wider_than_a_shard(layout, size):
    run_spmd(_thin_case, LAYOUTS[layout][0], layout, size)


def _inference_case(layout, memory_format):
    # validation and predict fetch windows without autograd; 2-D tiles write both dims' halos into one tensor
    from lightning_spatial.run import Run, entered

    torch.manual_seed(9)
    x = torch.randn(2, 4, 11, 14).contiguous(memory_format=memory_format)
    w = torch.randn(6, 4, 5, 5)
    sharded = shard(x, axes(layout))
    with torch.no_grad(), entered(Run(fallback="error")):
        out = F.conv2d(sharded, w, padding=2)
    assert out.to_local().is_contiguous(memory_format=memory_format)
    assert_rel_close(out.to_local(), sharded.shard_layout.take_local(F.conv2d(x, w, padding=2)), "output")


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_conv2d_without_grad(layout, memory_format):
    run_spmd(_inference_case, LAYOUTS[layout][0], layout, memory_format)


def _frozen_case(layout, freeze):
    # a frozen layer (weight without grad) and a first layer (input without grad) skip their gradients
    from lightning_spatial import gather, shard

    torch.manual_seed(5)
    x, w, b = torch.randn(2, 4, 9, 13), torch.randn(4, 1, 7, 7), torch.randn(4)
    upstream = torch.randn(2, 4, 9, 13)
    ref_x, ref_w = x.clone().requires_grad_(freeze != "input"), w.clone().requires_grad_(freeze != "weight")
    (F.conv2d(ref_x, ref_w, b, padding=3, groups=4) * upstream).sum().backward()
    ours_x, ours_w = shard(x, axes(layout)), w.clone().requires_grad_(freeze != "weight")
    if freeze != "input":
        ours_x.requires_grad_()
    out = F.conv2d(ours_x, ours_w, b, padding=3, groups=4)
    assert_rel_close(gather(out).detach(), F.conv2d(x, w, b, padding=3, groups=4), "output")
    (out * shard(upstream, axes(layout))).to_local().sum().backward()  # each rank's part of the loss
    if freeze == "input":
        assert ours_x.grad is None
        grad_w = ours_w.grad.clone()
        torch.distributed.all_reduce(grad_w)  # the split-gradient convention: ranks' parts sum to the whole
        assert_rel_close(grad_w, ref_w.grad, "weight grad")
    else:
        assert ours_w.grad is None
        local = ref_x.grad[ours_x.shard_layout.local_slices(4)]
        assert_rel_close(ours_x.grad.to_local(), local, "input grad")  # the grad of a sharded leaf is sharded


@pytest.mark.parametrize("layout", ["w3", "2x2"])
@pytest.mark.parametrize("freeze", ["input", "weight"])
def test_conv2d_without_input_or_weight_gradient(layout, freeze):
    run_spmd(_frozen_case, LAYOUTS[layout][0], layout, freeze)


def _module_case(layout, mode, kernel, stride):
    # the unchanged nn.Conv2d module: non-zero padding modes reach us as F.pad, then conv2d(padding=0)
    torch.manual_seed(11)
    conv = torch.nn.Conv2d(3, 5, kernel, stride=stride, padding=kernel // 2, padding_mode=mode)
    x = torch.randn(2, 3, 9, 31 if layout == "w3" else 16)
    check(
        lambda x, w, b: torch.func.functional_call(conv, {"weight": w, "bias": b}, (x,)),
        [x, conv.weight, conv.bias],
        sharded=[0],
        axes=axes(layout),
    )


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("kernel,stride", [(3, 1), (5, 2)])
def test_nn_conv2d_padding_modes(layout, mode, kernel, stride):
    run_spmd(_module_case, LAYOUTS[layout][0], layout, mode, kernel, stride)


def _conv1d_case(kernel, stride, padding, dilation, groups):
    torch.manual_seed(1)
    x, w, b = torch.randn(2, 4, 29), torch.randn(4, 4 // groups, kernel), torch.randn(4)
    check(
        lambda x, w, b: F.conv1d(x, w, b, stride, padding, dilation, groups),
        [x, w, b],
        sharded=[0],
        axes={-1: Axis.from_group()},
    )


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize(
    "kernel,stride,padding,dilation,groups", [(3, 1, 1, 1, 1), (5, 2, 2, 1, 4), (3, 2, 2, 2, 2), (3, 1, "same", 3, 1)]
)
def test_conv1d(ranks, kernel, stride, padding, dilation, groups):
    run_spmd(_conv1d_case, ranks, kernel, stride, padding, dilation, groups)


def _conv3d_case(layout, kernel, stride, padding):
    torch.manual_seed(2)
    x, w, b = torch.randn(1, 2, 5, 9, 17 if layout == "w3" else 10), torch.randn(3, 2, *kernel), torch.randn(3)
    check(lambda x, w, b: F.conv3d(x, w, b, stride, padding), [x, w, b], sharded=[0], axes=axes(layout))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("kernel,stride,padding", [((3, 3, 3), 1, 1), ((1, 3, 5), (1, 2, 2), (0, 1, 2))])
def test_conv3d(layout, kernel, stride, padding):
    run_spmd(_conv3d_case, LAYOUTS[layout][0], layout, kernel, stride, padding)


# (kernel, stride, padding, output_padding, dilation, groups)
CONV_T = [
    (2, 2, 0, 0, 1, 1),
    (3, 2, 1, 1, 1, 1),
    (4, 2, 1, 0, 1, 1),
    (3, 1, 1, 0, 1, 1),
    (1, 2, 0, 1, 1, 1),
    (3, 3, 0, 2, 1, 2),
    (3, 2, 2, 1, 2, 1),
    (5, 3, 1, 0, 1, 2),
]


def _conv_t_case(layout, kernel, stride, padding, output_padding, dilation, groups):
    torch.manual_seed(9)
    x = torch.randn(2, 4, 7, 19 if layout == "w3" else 8)
    w, b = torch.randn(4, 6 // groups, kernel, kernel), torch.randn(6)
    check(
        lambda x, w, b: F.conv_transpose2d(x, w, b, stride, padding, output_padding, groups, dilation),
        [x, w, b],
        sharded=[0],
        axes=axes(layout),
    )


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("kernel,stride,padding,output_padding,dilation,groups", CONV_T)
def test_conv_transpose2d(layout, kernel, stride, padding, output_padding, dilation, groups):
    run_spmd(_conv_t_case, LAYOUTS[layout][0], layout, kernel, stride, padding, output_padding, dilation, groups)


def _autocast_case(dtype):
    from lightning_spatial import shard
    from lightning_spatial.primitives import counting_halo_bytes

    torch.manual_seed(4)
    x, w = shard(torch.randn(2, 4, 8, 16), {-1: Axis.from_group()}), torch.randn(4, 1, 7, 7)
    sent = {}
    for autocast in (False, True):
        with counting_halo_bytes() as halos, torch.autocast("cpu", dtype=dtype, enabled=autocast):
            out = F.conv2d(x, w, padding=3, groups=4)
        sent[autocast] = halos.sent
        assert out.dtype == (dtype if autocast else torch.float32)
    assert sent[True] * 2 == sent[False] > 0  # halos travel in the half dtype under autocast


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_halos_travel_in_the_autocast_dtype(dtype):
    run_spmd(_autocast_case, 2, dtype)


def _conv_t_nd_case(layout, nd):
    torch.manual_seed(10)
    shape = (2, 3, 9) if nd == 1 else (1, 3, 4, 7, 11)
    x, w, b = torch.randn(*shape), torch.randn(3, 4, *([3] * nd)), torch.randn(4)
    op = F.conv_transpose1d if nd == 1 else F.conv_transpose3d
    ax = {-1: Axis.from_group()} if nd == 1 else axes(layout)
    check(lambda x, w, b: op(x, w, b, stride=2, padding=1, output_padding=1), [x, w, b], sharded=[0], axes=ax)


@pytest.mark.parametrize("nd,layout", [(1, "w2"), (1, "w3"), (3, "w3"), (3, "2x2")])
def test_conv_transpose_1d_3d(nd, layout):
    run_spmd(_conv_t_nd_case, LAYOUTS[layout][0], layout, nd)


def _kept_bytes(fn) -> int:
    """Bytes allocated during ``fn()`` and still alive after it: what autograd keeps for backward, plus outputs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    return sum(e.self_cpu_memory_usage for e in prof.key_averages())


def _window_memory_case(layout):
    """A conv after a ReLU: one device keeps the ReLU output once (for both ops' backward). Ours must not keep
    the halo-widened window beside it: backward fetches the window again."""
    torch.manual_seed(0)
    x = shard(torch.randn(2, 8, 32, 64), axes(layout))
    w = torch.randn(8, 8, 3, 3, requires_grad=True)
    local = x.to_local().clone().requires_grad_()

    def net(t):
        return torch.nn.functional.conv2d(torch.relu(t), w, padding=1).square()

    plain = _kept_bytes(lambda: net(local))
    ours = _kept_bytes(lambda: net(wrap(local, x.shard_layout)))
    assert ours <= plain * 1.02, f"keeps {ours} bytes where the shard alone keeps {plain}"
    counted = []  # our memory accounting (SpatialSummary, the automatic plan) observes without changing it
    for t in (local, wrap(local, x.shard_layout)):
        saved = SavedActivations(torch.nn.Module())
        with saved:
            net(t)
        counted.append(saved.nbytes)
    assert counted[1] <= counted[0] * 1.02, f"counted {counted[1]} bytes where the shard alone counts {counted[0]}"


@pytest.mark.parametrize("layout", ["w2", "2x2"])
def test_a_halo_window_is_not_kept_beside_its_input(layout):
    run_spmd(_window_memory_case, LAYOUTS[layout][0], layout)


def _refetch_case(layout):
    """The window is fetched again in backward only where that saves memory: after a ReLU (autograd keeps its
    output anyway) but not after a residual sum (the window would be the only copy: rebuilding it costs a second
    exchange and saves nothing)."""
    from lightning_spatial.primitives import counting_halo_bytes

    torch.manual_seed(0)
    x, y = (shard(torch.randn(2, 4, 16, 24), axes(layout)) for _ in range(2))
    w = torch.randn(4, 4, 3, 3, requires_grad=True)
    sent = {}
    for name, first in {"relu": lambda a, b: torch.relu(a), "sum": torch.add, "leaf": lambda a, b: a}.items():
        with counting_halo_bytes() as halos:
            out = torch.nn.functional.conv2d(first(x.detach().requires_grad_(), y), w, padding=1)
            forward = halos.sent
            out.square().sum().backward()
        sent[name] = halos.sent / forward  # backward: the adjoint's messages (and a refetch's)
    assert sent == {"relu": 3, "sum": 2, "leaf": 3}, sent


@pytest.mark.parametrize("layout", ["w2", "2x2"])
def test_a_window_is_fetched_again_only_where_that_saves_memory(layout):
    run_spmd(_refetch_case, LAYOUTS[layout][0], layout)
