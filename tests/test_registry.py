"""The handler registry is read live by every path (eager and traced): a handler registered, replaced or removed
after import takes effect at the next call; the worked example of docs/design.md ("Writing a handler") is exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lightning_spatial
from lightning_spatial import LayoutError, SpatialTensor, fallback_mode, handler_for, register_handler, remove_handler
from lightning_spatial.primitives import Layout, fallback, planned, unwrap, wrap
from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd


def scale_rows(x: torch.Tensor, scale: float) -> torch.Tensor:
    """A user's own function that takes part in torch's ``__torch_function__`` protocol."""
    if torch.overrides.has_torch_function_unary(x):
        return torch.overrides.handle_torch_function(scale_rows, (x,), x, scale)
    return x * scale


def _scale_rows_case():
    x = lightning_spatial.shard(torch.randn(2, 3, 4, 10), axes("w2"))
    calls = []

    def on_shards(x: SpatialTensor, scale: float) -> SpatialTensor:
        calls.append(type(x))
        return x * scale

    with fallback_mode("error"):
        with pytest.raises(LayoutError, match="scale_rows has no spatial handler"):
            scale_rows(x, 2.0)  # nothing registered yet: the fallback, an error here
        register_handler(scale_rows)(on_shards)
        try:
            assert handler_for(scale_rows) is on_shards
            eager = scale_rows(x, 2.0)
            traced = torch.compile(lambda t: scale_rows(t, 2.0), backend="eager", fullgraph=True)(x)
            with pytest.raises(ValueError, match="already has a spatial handler; pass override=True"):
                register_handler(scale_rows)(on_shards)
        finally:
            assert remove_handler(scale_rows) is on_shards
        with pytest.raises(LayoutError, match="scale_rows has no spatial handler"):
            scale_rows(x, 2.0)  # removed: the fallback again
    assert calls == [SpatialTensor, SpatialTensor]  # eager, and traced by dynamo
    for out in (eager, traced):
        assert isinstance(out, SpatialTensor) and torch.equal(out.to_local(), x.to_local() * 2.0)


def test_a_handler_registered_after_import_serves_eager_and_compiled_calls_until_removed():
    run_spmd(_scale_rows_case, 2)


def _override_case():
    x = lightning_spatial.shard(torch.randn(2, 3, 4, 10), axes("w2"))
    ours = handler_for(F.gelu)
    seen = []

    @register_handler(F.gelu, override=True)
    def counting(*args, **kwargs):
        seen.append(args[0].shard_layout)
        return ours(*args, **kwargs)

    try:
        out = F.gelu(x, approximate="tanh")
        torch.nn.GELU()(x)  # nn.GELU calls F.gelu: the override sees it too
    finally:
        register_handler(F.gelu, override=True)(ours)
    F.gelu(x)
    assert seen == [x.shard_layout] * 2 and handler_for(F.gelu) is ours
    assert torch.equal(out.to_local(), F.gelu(x.to_local(), approximate="tanh"))


def test_our_own_handlers_can_be_replaced_and_put_back():
    run_spmd(_override_case, 2)


def test_registration_errors_name_the_function():
    with pytest.raises(KeyError, match="scale_rows has no spatial handler"):
        remove_handler(scale_rows)
    with pytest.raises(TypeError, match="needs the function"):
        register_handler()
    with pytest.raises(TypeError, match="must be callable"):
        register_handler(scale_rows)("not a function")
    assert handler_for(scale_rows) is None


# The worked example of docs/design.md, "Writing a handler", verbatim.
@planned
def shuffled(layout: Layout, factor: int) -> Layout | None:
    """The output layout, or None where a rank's rows would not scale exactly (then the fallback is exact)."""
    if any(s.merged or s.dim < -2 or s.size % s.axis.size for s in layout.shards):
        return None
    return layout.with_sizes({s.dim: s.size * factor for s in layout.shards})


def pixel_shuffle(input, upscale_factor):
    x, layout = unwrap(input)
    out_layout = shuffled(layout, upscale_factor)
    if out_layout is None:
        return fallback(F.pixel_shuffle, (input, upscale_factor), {})
    return wrap(F.pixel_shuffle(x, upscale_factor), out_layout)


def _pixel_shuffle_case(layout):
    torch.manual_seed(5)
    x = torch.randn(2, 12, 6, 8, dtype=torch.float64)  # width 8: whole on w2 and 2x2, uneven on w3 (the fallback)
    register_handler(F.pixel_shuffle)(pixel_shuffle)
    try:
        check(lambda t: F.pixel_shuffle(t, 2), [x], sharded=[0], axes=axes(layout), allow_fallback=layout == "w3")
    finally:
        remove_handler(F.pixel_shuffle)


@pytest.mark.parametrize("layout", ["w2", "w3", "2x2"])
def test_the_worked_example_of_a_handler_is_exact(layout):
    run_spmd(_pixel_shuffle_case, LAYOUTS[layout][0], layout)
