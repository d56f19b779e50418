"""Handlers bind their arguments as torch does: every handler in its positional and its keyword spelling."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from lightning_spatial import LayoutError
from lightning_spatial.ops._binding import Binding
from lightning_spatial.primitives import Axis, DimShard, Layout
from lightning_spatial.tensor import wrap
from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd


def _bound(func, *args, **kwargs) -> dict:
    out = Binding(func).bind(args, kwargs)
    out.pop("input")
    return out


def test_overloads_bind_as_torch_parses_them():
    x = torch.randn(2, 3)
    assert _bound(torch.Tensor.var, x, False) == {"unbiased": False}  # a bool is not a dim
    assert _bound(torch.Tensor.var, x, 1) == {"dim": 1, "unbiased": True, "keepdim": False}
    assert _bound(torch.var, x, 1, False, True) == {"dim": 1, "unbiased": False, "keepdim": True}
    assert _bound(torch.var, x, dim=0, correction=2) == {"dim": 0, "correction": 2, "keepdim": False}
    assert _bound(torch.sum, x, axis=1, keepdims=True) == {"dim": 1, "keepdim": True, "dtype": None}
    assert _bound(torch.softmax, x, -1, torch.float64) == {"dim": -1, "dtype": torch.float64}
    assert _bound(F.softmax, x, -1, 3, torch.float64) == {"dim": -1, "_stacklevel": 3, "dtype": torch.float64}
    assert _bound(F.max_pool2d, x, 2)["stride"] is None  # a boolean dispatcher binds like its targets
    assert _bound(F.conv2d, x, x, None, 1, "same")["padding"] == "same"
    assert _bound(torch.Tensor.norm, x, 1, 0) == {"p": 1, "dim": 0, "keepdim": False, "dtype": None}


def test_a_call_is_passed_on_as_given_only_where_the_handler_takes_it_so():
    x = torch.randn(2, 3)
    every = frozenset({"input", "dim", "keepdim", "dtype"})

    def passing(func, args, kwargs, positional=("input", "dim", "keepdim", "dtype"), names=every):
        return Binding(func, positional, names).plan((x, *args), kwargs).add

    assert passing(torch.sum, (1,), {}) == {"keepdim": False, "dtype": None}  # the defaults torch would bind
    assert passing(torch.sum, (1,), {"keepdim": True}) == {"dtype": None}
    assert passing(torch.sum, (1, True), {}, positional=("input", "dim")) is None  # keepdim only by keyword there
    assert passing(torch.sum, (1,), {"keepdim": True}, names=every - {"keepdim"}) is None  # a name it lacks
    assert passing(torch.sum, (), {"axis": 1}) is None  # numpy's spelling: bound, as torch's parser reads it
    assert passing(torch.var, (False,), {}, positional=("input", "dim", "unbiased")) is None  # not a dim


@pytest.mark.parametrize(
    "func, args, kwargs",
    [
        (torch.var, ("a",), {}),  # 2.14: "invalid combination of arguments"; 2.11: a dim name not found
        (torch.softmax, (True,), {}),  # a bool is not a dim
        (F.interpolate, (), {"bogus": 2}),
    ],
)
def test_a_call_torch_rejects_raises_torch_error(func, args, kwargs):
    x = torch.randn(2, 3)
    with pytest.raises(Exception) as torch_says:
        func(x, *args, **kwargs)
    with pytest.raises(type(torch_says.value), match=re.escape(str(torch_says.value))):
        Binding(func).bind((x, *args), kwargs)


def test_out_is_refused_before_any_communication():
    import lightning_spatial.ops.reduce  # noqa: F401 - registers the handlers

    axis = Axis((0, 1), 0)  # no process group: any message would fail
    x = wrap(torch.randn(2, 3, 5), Layout((DimShard(-1, axis, 10),)))
    with pytest.raises(LayoutError, match="^torch.sum: out= is not supported"):
        torch.sum(x, -1, out=torch.empty(2, 3))


# torch takes no gradient for class weights and pos_weight
_CLASS_WEIGHTS = torch.tensor([0.5, 1.25, 0.75, 1.5])
_POS_WEIGHT = torch.tensor([0.5, 1.25, 0.75, 1.5]).view(4, 1, 1)

# name -> (inputs, positional spelling, keyword spelling); inputs named in TENSORS, sharded ones in SHARDED
CASES = {
    "var(unbiased)": ("x", lambda x: x.var(False), lambda x: x.var(unbiased=False)),
    "var(dim, unbiased, keepdim)": (
        "x",
        lambda x: torch.var(x, (2, 3), False, True),
        lambda x: torch.var(x, dim=(2, 3), unbiased=False, keepdim=True),
    ),
    "var(correction)": ("x", lambda x: torch.var(x, -1, correction=2), lambda x: x.var(dim=-1, correction=2)),
    "std(unbiased)": ("x", lambda x: x.std(False), lambda x: torch.std(x, unbiased=False)),
    "std(dim)": ("x", lambda x: torch.std(x, (2, 3), True, True), lambda x: x.std(dim=(2, 3), keepdim=True)),
    "sum(dtype)": (
        "x",
        lambda x: torch.sum(x, (2, 3), True, dtype=torch.float64),
        lambda x: x.sum(dim=(2, 3), keepdim=True, dtype=torch.float64),
    ),
    "sum(axis)": ("x", lambda x: x.sum(-1), lambda x: x.sum(axis=-1)),
    "mean": ("x", lambda x: x.mean((2, 3), True), lambda x: torch.mean(x, dim=(2, 3), keepdim=True)),
    "mean(keepdims)": ("x", lambda x: torch.mean(x, -1, True), lambda x: torch.mean(x, axis=-1, keepdims=True)),
    "amax": ("x", lambda x: x.amax(-1, True), lambda x: torch.amax(x, dim=-1, keepdim=True)),
    "amin": ("x", lambda x: torch.amin(x, (2, 3)), lambda x: x.amin(dim=(2, 3))),
    "norm": ("x", lambda x: x.norm(1, (2, 3), True), lambda x: torch.norm(x, p=1, dim=(2, 3), keepdim=True)),
    "vector_norm": (
        "x",
        lambda x: torch.linalg.vector_norm(x, 3, (-1, -2), True),
        lambda x: torch.linalg.vector_norm(x, ord=3, dim=(-1, -2), keepdim=True),
    ),
    "vector_norm(dtype)": (
        "x",
        lambda x: torch.linalg.vector_norm(x, 2, -1, False, dtype=torch.float64),
        lambda x: torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64),
    ),
    "logsumexp": (
        "x",
        lambda x: torch.logsumexp(x, (2, 3), True),
        lambda x: x.logsumexp(dim=(2, 3), keepdim=True),
    ),
    "softmax(dtype)": (
        "x",
        lambda x: torch.softmax(x, -1, torch.float64),
        lambda x: torch.softmax(x, dim=-1, dtype=torch.float64),
    ),
    "F.softmax(dtype)": (
        "x",
        lambda x: F.softmax(x, -1, 3, torch.float64),
        lambda x: F.softmax(x, dim=-1, dtype=torch.float64),
    ),
    "F.softmax(implicit dim)": ("x", lambda x: F.softmax(x, None), lambda x: F.softmax(input=x)),
    "log_softmax": ("x", lambda x: x.log_softmax(-2), lambda x: torch.log_softmax(x, dim=-2)),
    "all": ("x", lambda x: (x > -2).all(-1, True), lambda x: torch.all(x > -2, dim=-1, keepdim=True)),
    "any": ("x", lambda x: torch.any(x > 2, (2, 3)), lambda x: (x > 2).any(dim=(2, 3))),
    "conv2d": (
        "x w b",
        lambda x, w, b: F.conv2d(x, w, b, 2, 1, 1, 1),
        lambda x, w, b: F.conv2d(x, w, bias=b, stride=2, padding=1, dilation=1, groups=1),
    ),
    "conv2d(lists)": (  # unhashable arguments: planned at every call, not kept by the arguments as given
        "x w b",
        lambda x, w, b: F.conv2d(x, w, b, [2, 1], [1, 2]),
        lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=(1, 2), dilation=[1, 1]),
    ),
    "conv2d(same)": (
        "x w",
        lambda x, w: F.conv2d(x, w, None, 1, "same", 2),
        lambda x, w: F.conv2d(input=x, weight=w, padding="same", dilation=2),
    ),
    "conv_transpose2d": (
        "x wt b",
        lambda x, w, b: F.conv_transpose2d(x, w, b, 2, 1, 1),
        lambda x, w, b: F.conv_transpose2d(x, w, bias=b, stride=2, padding=1, output_padding=1),
    ),
    "max_pool2d": (
        "x",
        lambda x: F.max_pool2d(x, 3, 2, 1, 1, True),
        lambda x: F.max_pool2d(x, kernel_size=3, stride=2, padding=1, dilation=1, ceil_mode=True),
    ),
    "max_pool2d(indices)": (
        "x",
        lambda x: F.max_pool2d(x, 2, None, 0, 1, False, True),
        lambda x: F.max_pool2d(x, 2, return_indices=True),
    ),
    "torch.max_pool2d": (
        "x",
        lambda x: torch.max_pool2d(x, 3, 2, 1),
        lambda x: torch.max_pool2d(x, kernel_size=3, stride=2, padding=1),
    ),
    "avg_pool2d": (
        "x",
        lambda x: F.avg_pool2d(x, 3, 2, 1, True, False, 5),
        lambda x: F.avg_pool2d(
            x, kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False, divisor_override=5
        ),
    ),
    "adaptive_avg_pool2d": (
        "x",
        lambda x: F.adaptive_avg_pool2d(x, (3, 4)),
        lambda x: F.adaptive_avg_pool2d(x, output_size=(3, 4)),
    ),
    "adaptive_max_pool2d": (
        "x",
        lambda x: F.adaptive_max_pool2d(x, 3, True),
        lambda x: F.adaptive_max_pool2d(x, output_size=3, return_indices=True),
    ),
    "pad(reflect)": (
        "x",
        lambda x: F.pad(x, (1, 2, 3, 1), "reflect"),
        lambda x: F.pad(x, pad=(1, 2, 3, 1), mode="reflect"),
    ),
    "pad(value)": ("x", lambda x: F.pad(x, (2, 1, 1, 2), "constant", 0.5), lambda x: F.pad(x, (2, 1, 1, 2), value=0.5)),
    "interpolate": (
        "x",
        lambda x: F.interpolate(x, None, 2, "bilinear", False),
        lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False),
    ),
    "batch_norm": (
        "x nw nb",
        lambda x, w, b: F.batch_norm(x, None, None, w, b, True, 0.1, 1e-3),
        lambda x, w, b: F.batch_norm(x, None, None, weight=w, bias=b, training=True, eps=1e-3),
    ),
    "group_norm": (
        "x nw nb",
        lambda x, w, b: F.group_norm(x, 2, w, b, 1e-3),
        lambda x, w, b: F.group_norm(x, num_groups=2, weight=w, bias=b, eps=1e-3),
    ),
    "instance_norm": (
        "x nw nb",
        lambda x, w, b: F.instance_norm(x, None, None, w, b, True, 0.1, 1e-3),
        lambda x, w, b: F.instance_norm(x, weight=w, bias=b, eps=1e-3),
    ),
    "layer_norm": (
        "x lw lb",
        lambda x, w, b: F.layer_norm(x, x.shape[-2:], w, b, 1e-3),
        lambda x, w, b: F.layer_norm(x, normalized_shape=x.shape[-2:], weight=w, bias=b, eps=1e-3),
    ),
    "dropout": (
        "x",
        lambda x: (torch.manual_seed(7), F.dropout(x, 0.3, True))[1],
        lambda x: (torch.manual_seed(7), F.dropout(x, p=0.3, training=True))[1],
    ),
    "dropout2d": (
        "x",
        lambda x: (torch.manual_seed(7), F.dropout2d(x, 0.5, True))[1],
        lambda x: (torch.manual_seed(7), F.dropout2d(x, p=0.5, training=True))[1],
    ),
    "cross_entropy": (
        "x t",
        lambda x, t: F.cross_entropy(x, t, _CLASS_WEIGHTS, None, 1, None, "sum", 0.1),
        lambda x, t: F.cross_entropy(x, t, weight=_CLASS_WEIGHTS, ignore_index=1, reduction="sum", label_smoothing=0.1),
    ),
    "mse_loss": (
        "x y",
        lambda x, y: F.mse_loss(x, y, None, None, "sum"),
        lambda x, y: F.mse_loss(x, y, reduction="sum"),
    ),
    "mse_loss(size_average)": (
        "x y",
        lambda x, y: F.mse_loss(x, y, False),
        lambda x, y: F.mse_loss(x, y, size_average=False),
    ),
    "mse_loss(weight)": (
        "x y ew",
        lambda x, y, w: F.mse_loss(x, y, None, None, "mean", w),
        lambda x, y, w: F.mse_loss(x, y, weight=w),
    ),
    "l1_loss(weight)": (
        "x y ew",
        lambda x, y, w: F.l1_loss(x, y, None, None, "mean", w),
        lambda x, y, w: F.l1_loss(x, y, weight=w),
    ),
    "huber_loss(weight)": (
        "x y ew",
        lambda x, y, w: F.huber_loss(x, y, "mean", 0.5, w),
        lambda x, y, w: F.huber_loss(x, y, delta=0.5, weight=w),
    ),
    "smooth_l1_loss": (
        "x y",
        lambda x, y: F.smooth_l1_loss(x, y, None, None, "sum", 0.5),
        lambda x, y: F.smooth_l1_loss(x, y, reduction="sum", beta=0.5),
    ),
    "bce_with_logits": (
        "x p",
        lambda x, p: F.binary_cross_entropy_with_logits(x, p, None, None, None, "mean", _POS_WEIGHT),
        lambda x, p: F.binary_cross_entropy_with_logits(x, p, pos_weight=_POS_WEIGHT),
    ),
}

SHARDED = {"x", "y", "t", "p"}


def _tensors(width: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "x": torch.randn(2, 4, 9, width, generator=g),
        "y": torch.randn(2, 4, 9, width, generator=g),
        "p": torch.rand(2, 4, 9, width, generator=g),
        "t": torch.randint(0, 4, (2, 9, width), generator=g),
        "w": torch.randn(6, 4, 3, 3, generator=g),
        "wt": torch.randn(4, 6, 3, 3, generator=g),
        "b": torch.randn(6, generator=g),
        "nw": torch.rand(4, generator=g) + 0.5,
        "nb": torch.randn(4, generator=g),
        "lw": torch.rand(9, width, generator=g) + 0.5,
        "lb": torch.randn(9, width, generator=g),
        "ew": torch.rand(2, 4, 9, width, generator=g) + 0.1,  # a replicated per-element weight: cut per rank
    }


def _spellings(layout: str) -> None:
    from lightning_spatial import gather, shard

    tensors = _tensors(23 if layout == "w3" else 10)
    for name, (names, positional, keyword) in CASES.items():
        inputs = [tensors[n] for n in names.split()]
        sharded = [i for i, n in enumerate(names.split()) if n in SHARDED]
        for spelling, op in (("positional", positional), ("keyword", keyword)):
            try:
                check(op, inputs, sharded, axes(layout))
                expected = op(*inputs)  # the result dtypes too (the oracle compares values)
                got = op(*[shard(t, axes(layout)) if i in sharded else t for i, t in enumerate(inputs)])
                for e, g in zip(*(o if isinstance(o, tuple) else (o,) for o in (expected, got))):
                    assert gather(g).dtype == e.dtype, f"dtype {gather(g).dtype} != {e.dtype}"
            except Exception as error:
                raise AssertionError(f"{name}, {spelling} spelling: {error}") from error


@pytest.mark.parametrize("layout", ["w3", "2x2"])
def test_every_handler_binds_positional_and_keyword_spellings(layout):
    run_spmd(_spellings, LAYOUTS[layout][0], layout)
