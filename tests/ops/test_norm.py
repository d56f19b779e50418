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
from tests.oracle import assert_rel_close, check
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
