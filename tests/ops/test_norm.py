"""BatchNorm, GroupNorm, InstanceNorm, LayerNorm (incl. timm LayerNorm2d) and GlobalResponseNorm."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from timm.layers import LayerNorm2d
from timm.layers.grn import GlobalResponseNorm

from lightning_spatial import SpatialTensor, shard
from lightning_spatial.tensor import wrap
from tests.oracle import RTOL, assert_rel_close, check
from tests.spmd import LAYOUTS, axes, run_spmd

LAYOUT_NAMES = list(LAYOUTS)


def _width(layout):
    return 19 if layout == "w3" else 10


def _running_norm_case(layout, kind, training):
    torch.manual_seed(0)
    module = (
        torch.nn.BatchNorm2d(4)
        if kind == "batch"
        else torch.nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
    )
    module.running_mean.normal_()
    module.running_var.uniform_(0.5, 2)
    modules = {False: module, True: copy.deepcopy(module)}  # reference, sharded
    x = torch.randn(3, 4, 7, _width(layout)) * 2 + 1

    def op(x, w, b):
        m = modules[isinstance(x, SpatialTensor)]
        if kind == "batch":
            return F.batch_norm(x, m.running_mean, m.running_var, w, b, training, 0.1, 1e-5)
        return F.instance_norm(x, m.running_mean, m.running_var, w, b, training, 0.1, 1e-5)

    w, b = torch.randn(4), torch.randn(4)
    check(op, [x, w, b], sharded=[0], axes=axes(layout))
    assert_rel_close(modules[True].running_mean, modules[False].running_mean, "running_mean")
    assert_rel_close(modules[True].running_var, modules[False].running_var, "running_var")


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("kind", ["batch", "instance"])
@pytest.mark.parametrize("training", [True, False])
def test_batch_and_instance_norm(layout, kind, training):
    run_spmd(_running_norm_case, LAYOUTS[layout][0], layout, kind, training)


def _batch_norm_variant_case(layout, variant):
    torch.manual_seed(5)
    dtype = torch.float64 if variant in ("float64", "far_mean") else torch.float32
    x = torch.randn(3, 4, 7, _width(layout), dtype=dtype) * 2 + 1
    if variant == "far_mean":  # spread 2e-2 about 1e2: a variance from sums of squares would cancel (float64: fp32
        # rounds x itself to 4e-4 of its spread, so any two implementations differ by more than fp32's tolerance)
        x = x * 1e-2 + 100
    if variant == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    affine = [] if variant == "no_affine" else [torch.randn(4, dtype=dtype), torch.randn(4, dtype=dtype)]

    def op(x, *wb):
        return F.batch_norm(x, None, None, *(wb or (None, None)), True, 0.1, 1e-5)

    check(op, [x, *affine], sharded=[0], axes=axes(layout))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("variant", ["no_affine", "float64", "channels_last", "far_mean"])
def test_batch_norm_variants(layout, variant):
    """Without affine parameters, in float64, channels_last, and a mean far from zero against the spread."""
    run_spmd(_batch_norm_variant_case, LAYOUTS[layout][0], layout, variant)


def _case(layout, op, inputs):
    check(op, inputs, sharded=[0], axes=axes(layout))


def _group_norm_case(layout, groups):
    torch.manual_seed(1)
    x = torch.randn(2, 6, 5, _width(layout)) * 3 - 1
    check(lambda x, w, b: F.group_norm(x, groups, w, b, 1e-5), [x, torch.randn(6), torch.randn(6)], [0], axes(layout))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("groups", [1, 3, 6])
def test_group_norm(layout, groups):
    run_spmd(_group_norm_case, LAYOUTS[layout][0], layout, groups)


def _layer_norm_case(layout, over_spatial):
    torch.manual_seed(2)
    x = torch.randn(2, 4, 5, _width(layout))
    shape = x.shape[1:] if over_spatial else None
    if over_spatial:  # normalise over (C, H, W): statistics cross the shards, affine parameters are sliced
        check(
            lambda x, w, b: F.layer_norm(x, shape, w, b), [x, torch.randn(shape), torch.randn(shape)], [0], axes(layout)
        )
    else:  # timm's LayerNorm2d: permute to channels-last, normalise channels, permute back
        norm = LayerNorm2d(4)
        check(
            lambda x, w, b: torch.func.functional_call(norm, {"weight": w, "bias": b}, (x,)),
            [x, torch.randn(4), torch.randn(4)],
            [0],
            axes(layout),
        )


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("over_spatial", [False, True])
def test_layer_norm(layout, over_spatial):
    run_spmd(_layer_norm_case, LAYOUTS[layout][0], layout, over_spatial)


def _grn_case(layout, channels_last):
    torch.manual_seed(3)
    grn = GlobalResponseNorm(4, channels_last=channels_last)
    x = torch.randn(2, 5, _width(layout), 4) if channels_last else torch.randn(2, 4, 5, _width(layout))
    ax = axes(layout)
    if channels_last:  # (N, H, W, C): the spatial dims are -3 and -2
        ax = {d - 1: a for d, a in ax.items()}
    check(
        lambda x, w, b: torch.func.functional_call(grn, {"weight": w, "bias": b}, (x,)),
        [x, torch.randn(4), torch.randn(4)],
        [0],
        ax,
    )


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("channels_last", [True, False])
def test_global_response_norm(layout, channels_last):
    run_spmd(_grn_case, LAYOUTS[layout][0], layout, channels_last)


def _saved_activations(fn, x, local: torch.Tensor) -> int:
    """How many tensors of (about) ``local``'s size autograd keeps for the backward of ``fn(x)``."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(n >= local.numel() // 2 for n in sizes)


def _memory_case(layout):
    torch.manual_seed(0)
    full = torch.randn(2, 8, 6, 12)
    x = shard(full, axes(layout))
    weight, bias = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    norms = {
        "batch_norm": lambda t: F.batch_norm(t, None, None, weight, bias, training=True),
        "group_norm": lambda t: F.group_norm(t, 4, weight, bias),
        "instance_norm": lambda t: F.instance_norm(t, weight=weight, bias=bias),
        "layer_norm over H, W": lambda t: F.layer_norm(t, t.shape[-2:]),
    }
    for name, fn in norms.items():
        local = x.to_local().clone().requires_grad_()
        ours = _saved_activations(fn, wrap(local, x.shard_layout), local)
        plain = _saved_activations(fn, local, local)  # torch's kernel on the shard alone: the memory to match
        assert ours <= plain, f"{name}: keeps {ours} activation-sized tensors, torch's kernel {plain}"


@pytest.mark.parametrize("layout", ["w3", "2x2"])
def test_normalisation_keeps_no_more_activations_than_torchs_kernel(layout):
    run_spmd(_memory_case, LAYOUTS[layout][0], layout)


def _gpu_batch_norm_case(layout, dtype_name):
    import torch.distributed as dist

    from lightning_spatial.run import Run, entered

    dtype, device = getattr(torch, dtype_name), torch.device("cuda")
    torch.manual_seed(6)
    x = (torch.randn(3, 4, 7, _width(layout)) * 2 + 1).to(device, dtype).to(memory_format=torch.channels_last)
    weight, bias, upstream = torch.randn(4, device=device), torch.randn(4, device=device), torch.randn(x.shape)
    # the reference: torch's BatchNorm in float64 on the same values (the bf16 input, the gradient as it arrives)
    ref = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    ref_out = F.batch_norm(ref[0], None, None, *ref[1:], True, 0.1, 1e-5)
    ref_out.backward(upstream.to(dtype).to(device, torch.float64))

    sharded = shard(x, axes(layout))
    local, layout_ = sharded.to_local().clone().requires_grad_(), sharded.shard_layout
    ours = [weight.clone().requires_grad_(), bias.clone().requires_grad_()]
    with entered(Run(fallback="error")):
        out = F.batch_norm(wrap(local, layout_), None, None, *ours, True, 0.1, 1e-5)
        (out.to_local().float() * layout_.take_local(upstream).to(device)).sum().backward()
    # bf16 output and input gradient: an fp32 result rounded to bf16 (2^-9 relative); the parameters' gradients are
    # fp32 sums whatever the activations' precision
    rtol = 1e-2 if dtype == torch.bfloat16 else RTOL
    assert_rel_close(out.to_local().double(), layout_.take_local(ref_out).detach(), "output", rtol=rtol)
    assert_rel_close(local.grad.double(), layout_.take_local(ref[0].grad), "grad of input", rtol=rtol)
    for name, p, r in zip(("weight", "bias"), ours, ref[1:]):
        total = p.grad.clone()
        dist.all_reduce(total)  # gloo reduces CUDA tensors (through the host)
        assert_rel_close(total.double(), r.grad, f"grad of {name}", rtol=RTOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's CUDA normalisation kernels need a GPU")
@pytest.mark.parametrize("layout", ["w3", "2x2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_norm_on_gpu_equals_torchs(layout, dtype):
    """On CUDA (ranks sharing one GPU, gloo all-reducing CUDA tensors; torch's SyncBatchNorm kernels), channels_last,
    fp32 and bf16 activations with fp32 parameters as under autocast: the sharded BatchNorm equals torch's
    training-mode BatchNorm on the whole tensor in float64, outputs and gradients, to fp32's tolerance where the
    result is fp32 (the parameters' gradients in bf16 too)."""
    run_spmd(_gpu_batch_norm_case, LAYOUTS[layout][0], layout, dtype, timeout=300.0)
