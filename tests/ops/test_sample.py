"""F.grid_sample of a sharded input at replicated grid points: every mode, padding mode, align_corners, fp32 and
float64, 4-D and 5-D, against the single-process op (outputs, input and grid gradients), and torch's errors.

Grids hold every pixel centre and pixel edge of the input (where bilinear's gradient has its kinks and nearest
rounds half to even), points outside the image (reflected several times) and random points. The sizes make
those special points exact floats (n a power of two without align_corners, n - 1 with it): torch's kernels
round the source coordinate differently from each other (fused multiply-add in some), so a point an ulp off
a kink may legitimately land on either side. ``test_generic_sizes`` covers other sizes with random points.
"""

from __future__ import annotations

import itertools
import warnings
from contextlib import contextmanager
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tests.oracle as oracle
from lightning_spatial import LayoutError, SpatialTensor, shard
from lightning_spatial.run import Run, entered
from tests.oracle import assert_rel_close, check
from tests.spmd import LAYOUTS, axes, run_spmd

LAYOUT_NAMES = list(LAYOUTS)
PADDINGS = ("zeros", "border", "reflection")


@contextmanager
def _tolerance(dtype: torch.dtype):
    """float64 results must agree to float64 rounding, not fp32's 1e-5."""
    old = oracle.RTOL
    oracle.RTOL = 1e-12 if dtype == torch.float64 else old
    try:
        yield
    finally:
        oracle.RTOL = old


def _coords(n: int, align: bool, gen: torch.Generator) -> torch.Tensor:
    """Normalised positions along a dim of size n: pixel centres, pixel edges, far outside, random."""
    if align:
        centres, edges = [2 * k / (n - 1) - 1 for k in range(n)], [(2 * k + 1) / (n - 1) - 1 for k in range(n - 1)]
    else:
        centres, edges = [(2 * k + 1) / n - 1 for k in range(n)], [2 * k / n - 1 for k in range(n + 1)]
    outside = [-1.25, 1.25, -2.5, 2.5, -3.75, 3.75, -7.125, 7.125]
    return torch.tensor(centres + edges + outside + (torch.rand(6, generator=gen) * 3.2 - 1.6).tolist())


def _grid(sizes, align: bool, dtype, gen: torch.Generator, special: bool = True) -> torch.Tensor:
    """(2, *points, nd) grid, coordinate 0 along the last input dim: sample 0 the product of ``_coords``
    (random points only unless ``special``), sample 1 uniform random points in [-1.6, 1.6]."""
    per_dim = [_coords(n, align, gen) if special else torch.rand(2 * n + 5, generator=gen) * 3.2 - 1.6 for n in sizes]
    mesh = torch.meshgrid(*per_dim, indexing="ij")
    product = torch.stack(mesh[::-1], -1)
    random = torch.rand(product.shape, generator=gen) * 3.2 - 1.6
    return torch.stack([product, random]).to(dtype)


def _sampler(mode, padding, align):
    return lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode=padding, align_corners=align)


def _cases(layout, modes, sizes_for, dtypes=(torch.float32, torch.float64), special=True):
    gen = torch.Generator().manual_seed(5)
    for mode, padding, align, dtype in itertools.product(modes, PADDINGS, (False, True), dtypes):
        sizes = sizes_for(align)
        x = torch.randn(2, 3, *sizes, generator=gen, dtype=dtype)
        grid = _grid(sizes, align, dtype, gen, special)
        try:
            with _tolerance(dtype):
                check(_sampler(mode, padding, align), [x, grid], sharded=[0], axes=axes(layout))
        except AssertionError as e:
            raise AssertionError(f"{mode}, {padding}, align_corners={align}, {dtype}, input {tuple(sizes)}: {e}") from e


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
def test_grid_sample_2d(layout, mode):
    run_spmd(_cases, LAYOUTS[layout][0], layout, [mode], lambda align: (9, 17) if align else (8, 16))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_grid_sample_3d(layout, mode):
    """Volumetric input (trilinear or nearest), depth unsharded."""
    run_spmd(_cases, LAYOUTS[layout][0], layout, [mode], lambda align: (3, 5, 17) if align else (2, 4, 8))


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_generic_sizes(layout):
    """Sizes that are not powers of two (w3: uneven shards), random points only, fp32."""
    modes = ["bilinear", "nearest", "bicubic"]
    run_spmd(_cases, LAYOUTS[layout][0], layout, modes, lambda align: (7, 23), (torch.float32,), False)


def _torch_functions_case(layout):
    gen = torch.Generator().manual_seed(6)
    x, grid = torch.randn(2, 3, 8, 16, generator=gen), _grid((8, 16), False, torch.float32, gen)
    aligned, aligned_grid = torch.randn(2, 3, 9, 17, generator=gen), _grid((9, 17), True, torch.float32, gen)
    volume, grid3 = torch.randn(2, 3, 2, 4, 8, generator=gen), _grid((2, 4, 8), False, torch.float32, gen)
    check(lambda x, g: torch.grid_sampler(x, g, 2, 2, False), [x, grid], sharded=[0], axes=axes(layout))
    check(lambda x, g: torch.grid_sampler_2d(x, g, 0, 1, True), [aligned, aligned_grid], sharded=[0], axes=axes(layout))
    check(lambda x, g: torch.grid_sampler_3d(x, g, 1, 0, False), [volume, grid3], sharded=[0], axes=axes(layout))
    channels_last = x.to(memory_format=torch.channels_last)
    check(_sampler("bilinear", "border", False), [channels_last, grid], sharded=[0], axes=axes(layout))
    with pytest.warns(UserWarning, match="align_corners=False since 1.3.0"):
        check(lambda x, g: F.grid_sample(x, g), [x, grid], sharded=[0], axes=axes(layout))


@pytest.mark.parametrize("layout", ["w3", "2x2"])
def test_torch_functions(layout):
    """torch.grid_sampler(_2d/_3d) with enum arguments, a channels-last input, and F.grid_sample's default
    align_corners (warns)."""
    run_spmd(_torch_functions_case, LAYOUTS[layout][0], layout)


def _transposed_grid_case():
    gen = torch.Generator().manual_seed(7)
    x, grid = torch.randn(2, 3, 8, 16, generator=gen), _grid((8, 16), False, torch.float32, gen)
    # the grid is stored (N, H, 2, W), its W sharded like the input's: transposed, its points are sharded
    check(
        lambda x, g: F.grid_sample(x, g.transpose(-1, -2), align_corners=False),
        [x, grid.transpose(-1, -2)],
        sharded=[0, 1],
        axes=axes("w2"),
    )


def test_a_grid_sharded_through_a_transpose():
    """A grid whose points are sharded is sampled without a gather of the input (fallbacks as errors)."""
    run_spmd(_transposed_grid_case, 2)


def _autocast_case():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 3, 8, 16, generator=gen).bfloat16()
    grid = _grid((8, 16), False, torch.float32, gen)
    ref_grid, our_grid = grid.clone().requires_grad_(), grid.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.grid_sample(x, ref_grid, align_corners=False)
        out = F.grid_sample(shard(x, axes("2x2")), our_grid, align_corners=False)
    assert out.dtype == ref.dtype == torch.float32
    assert_rel_close(out, ref, "output")
    upstream = torch.randn(ref.shape, generator=gen)
    (ref * upstream).sum().backward()
    (out * upstream).sum().div(dist.get_world_size()).backward()  # the split convention, as the oracle's loss
    dist.all_reduce(our_grid.grad)
    assert_rel_close(our_grid.grad, ref_grid.grad, "grid gradient (summed over ranks)")


def test_autocast():
    """Under CPU autocast torch samples in float32: a bf16 input meets an fp32 grid."""
    run_spmd(_autocast_case, 4)


BAD_CALLS = {  # name: (input shape, grid shape, grid dtype, call)
    "grid with the wrong last dim": ((1, 2, 8, 8), (1, 3, 5, 3), torch.float32, lambda x, g: F.grid_sample(x, g)),
    "batch sizes differ": ((1, 2, 8, 8), (2, 3, 5, 2), torch.float32, lambda x, g: F.grid_sample(x, g)),
    "5-D grid for a 4-D input": ((1, 2, 8, 8), (1, 3, 5, 4, 2), torch.float32, lambda x, g: F.grid_sample(x, g)),
    "bicubic on a volume": (
        (1, 2, 3, 8, 8),
        (1, 2, 3, 5, 3),
        torch.float32,
        lambda x, g: F.grid_sample(x, g, mode="bicubic", align_corners=False),
    ),
    "grid_sampler_3d on a 4-D input": (
        (1, 2, 8, 8),
        (1, 3, 5, 2),
        torch.float32,
        lambda x, g: torch.grid_sampler_3d(x, g, 0, 0, False),
    ),
    "unknown mode": ((1, 2, 8, 8), (1, 3, 5, 2), torch.float32, lambda x, g: F.grid_sample(x, g, mode="area")),
    "unknown padding": ((1, 2, 8, 8), (1, 3, 5, 2), torch.float32, lambda x, g: F.grid_sample(x, g, padding_mode="x")),
    "grid of another dtype": ((1, 2, 8, 8), (1, 3, 5, 2), torch.float64, lambda x, g: F.grid_sample(x, g)),
}


def _bad_calls_rank0():
    ax = axes("w2")
    if dist.get_rank() == 0:
        for name, (shape, grid_shape, grid_dtype, call) in BAD_CALLS.items():
            x, grid = torch.randn(shape), torch.rand(grid_shape, dtype=grid_dtype)
            with pytest.raises(Exception) as expected, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                call(x, grid)
            with pytest.raises(expected.type) as ours, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                call(shard(x, ax), grid)
            assert str(ours.value) == str(expected.value), name
        with pytest.raises(LayoutError, match="grid_sample: .* dim -3, which is not one of its 2 spatial dims"):
            F.grid_sample(shard(torch.randn(1, 4, 8, 8), {-3: ax[-1]}), torch.rand(1, 3, 5, 2), align_corners=False)
        with pytest.raises(ValueError, match="must be 0, 1 or 2, got 3 and 0"):  # torch returns garbage here
            torch.grid_sampler(shard(torch.randn(1, 2, 8, 8), ax), torch.rand(1, 3, 5, 2), 3, 0, False)
    dist.barrier()


def test_bad_input_raises_torchs_error_before_communicating():
    """Only rank 0 makes the bad calls; an op that communicated first would hang the barrier."""
    run_spmd(_bad_calls_rank0, 2, timeout=60)


def _grid_by_points_case(layout: str, dtype: torch.dtype, form: str, image_hw: tuple[int, int]):
    """BEV queries sampling a sharded image (Simple-BEV's lifting, BEVFormer's cross-attention by ``grid_sample``):
    the grid sharded along its point dims over the image's ranks (X over the first axis, Y over the second), its
    points flattened to query tokens (``(N, X*Y, 1, 2)``), or several points per query stacked as rows
    (``(N, P*X, Y, 2)``, BEVFormer's deformable sampling). An image larger than the samples: each rank samples every
    point in its own image part and each point's sums reach its owner; a smaller one: it is gathered and each rank
    samples its own points. Either way the output is sharded like the grid. Outputs, image and grid gradients."""
    from lightning_spatial.ops import sample

    torch.manual_seed(0)
    image = torch.randn(2, 3, *image_hw, dtype=dtype)
    grid = (torch.rand(2, 3, 5, 4, 2, dtype=dtype) * 2.4 - 1.2).requires_grad_()  # some points outside the image
    if form != "stacked":
        grid = grid[:, 0].detach().requires_grad_()  # one point per query
    ax = axes(layout)
    by_points = {-3: next(iter(ax.values()))} if len(ax) == 1 else {-3: ax[-2], -2: ax[-1]}

    def op(x, g):
        if isinstance(x, SpatialTensor):
            g = shard(g, by_points)
        if form == "tokens":
            g = g.flatten(1, 2).unsqueeze(2)  # (N, X*Y, 1, 2) query tokens, one point each
        if form == "stacked":
            g = g.flatten(1, 2)  # (N, P*X, Y, 2): the points of every query stacked as rows
        with patch.object(sample, "_shard_taps", lambda *a: taps.append(1) or shard_taps(*a)):
            out = F.grid_sample(x, g, mode="bilinear", padding_mode="zeros", align_corners=False)
        if isinstance(x, SpatialTensor):
            assert isinstance(out, SpatialTensor) and len(out.shard_layout.shards) == len(by_points), out
            assert bool(taps) == (image.numel() >= out.numel()), (image.shape, out.shape)  # global shapes
        return out.unflatten(2, (3, 5)) if form == "stacked" else out

    taps, shard_taps = [], sample._shard_taps  # taps of a shard: the points were gathered, not the image
    if form == "tokens" and len(by_points) == 2:  # 2-D tiles flatten into two sharded factors of one token dim
        with pytest.raises(LayoutError, match="grid_sample"):
            check(op, [image, grid], sharded=[0], axes=ax)  # fallbacks are errors: the exact fallback was chosen
        return
    with _tolerance(dtype):
        check(op, [image, grid], sharded=[0], axes=ax)


@pytest.mark.parametrize("image_hw", [(8, 12), (4, 4)], ids=["larger_image", "smaller_image"])
@pytest.mark.parametrize("form", ["map", "tokens", "stacked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_a_grid_sharded_by_points(layout, dtype, form, image_hw):
    run_spmd(_grid_by_points_case, LAYOUTS[layout][0], layout, dtype, form, image_hw)


def _gathered_image_case(layout: str, dtype: torch.dtype, mode: str):
    """A replicated grid with more samples than the image has values (Simple-BEV's lifting: 8 heights per BEV cell;
    BEVFormer's first cross-attention): the image is gathered and torch's own kernel samples it, the output
    replicated; no partial sums, so the taps of a shard are never computed. Output, image and grid gradients."""
    from lightning_spatial.ops import sample

    torch.manual_seed(0)
    image = torch.randn(2, 3, 4, 6, dtype=dtype)
    grid = torch.rand(2, 8, 5, 2, dtype=dtype) * 2.4 - 1.2  # 40 points a sample, some outside the image
    taps, shard_taps = [], sample._shard_taps
    with patch.object(sample, "_shard_taps", lambda *a: taps.append(1) or shard_taps(*a)), _tolerance(dtype):
        check(_sampler(mode, "zeros", False), [image, grid], sharded=[0], axes=axes(layout))
    assert not taps


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_an_image_smaller_than_its_samples_is_gathered(layout, dtype, mode):
    run_spmd(_gathered_image_case, LAYOUTS[layout][0], layout, dtype, mode)


def _grid_over_other_ranks_case():
    ax = axes("2x2")
    image = shard(torch.randn(2, 3, 6, 10), {-1: ax[-1]})  # sharded over the w ranks only
    grid = shard(torch.rand(2, 5, 4, 2) * 2 - 1, {-3: ax[-2]})  # its points over the h ranks
    with entered(Run(fallback="error")), pytest.raises(LayoutError, match="grid_sample"):
        F.grid_sample(image, grid, align_corners=False)


def test_a_grid_sharded_over_other_ranks_than_the_image_takes_the_fallback():
    run_spmd(_grid_over_other_ranks_case, 4)


def _taps_recomputed_case():
    """The taps' rows and weights of every grid point (``taps`` x the points, on every rank, whatever S is) are not
    kept for the backward: it computes them again from the grid, so a rank keeps its input shard and the grid only."""
    from lightning_spatial.ops import sample

    ax = axes("w2")
    image = shard(torch.randn(2, 3, 6, 10), ax).requires_grad_()
    grid = (torch.rand(2, 5, 4, 2) * 2 - 1).requires_grad_()
    calls, original = [], sample._shard_taps
    with patch.object(sample, "_shard_taps", lambda *a: calls.append(1) or original(*a)):
        out = F.grid_sample(image, grid, align_corners=False)
        assert len(calls) == 1
        out.sum().backward()
    assert len(calls) == 2 and image.grad is not None and grid.grad is not None


def test_the_taps_are_recomputed_in_backward_not_kept():
    run_spmd(_taps_recomputed_case, 2)
