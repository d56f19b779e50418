"""Sums into a BEV grid sharded over its cells (``Run.bev_shard``, ``ops.pending``): a splat (``index_add``,
``scatter_add``, ``index_put(accumulate=True)``) of sharded features and a ``grid_sample`` of a sharded image
followed by what a BEV encoder does (views, a 3x3 conv, batch norm, a loss), against one process: outputs and
every gradient, on w2, w3 (uneven), h2 and 2x2, fp32 and float64, fallbacks as errors. The reduced grid must be
sharded as asked (checked on its layout), a small result stays replicated, and a grid smaller than its ranks
raises before any message."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

import lightning_spatial.ops.pending as pending_module
from lightning_spatial import LayoutError, SpatialTensor, shard
from lightning_spatial.run import Run, entered
from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd

B, C, X, Y = 2, 3, 7, 5  # odd cell counts: uneven shards of the grid too
SPLATS = (
    "index_add",
    "scatter_add",
    "index_put",
    "grid_sample",
    "grid_sample_points",
    "grid_sample_cameras",
    "grid_sample_transposed",
)
MODES = {"w2": "x", "w3": "y", "h2": "xy", "2x2": "xy"}  # 2x2 with "xy": 2-D tiles over the two axes


def _splat(kind: str, feats: torch.Tensor, cells: torch.Tensor, grid: torch.Tensor, dest: torch.Tensor):
    """(B, C, h, w) image features -> (B, C, X, Y) BEV grid, as BEV code writes it, the scatters into ``dest``
    (random: the destination's own values enter once, after the reduction)."""
    if kind == "grid_sample":  # Simple-BEV: sample the image at every cell's projection
        return F.grid_sample(feats, grid, align_corners=False)
    if kind == "grid_sample_points":  # BEVFormer: 4 points per cell stacked as rows, more samples than the image
        return F.grid_sample(feats, grid, align_corners=False).unflatten(2, (4, X)).mean(2)
    if kind == "grid_sample_cameras":  # Simple-BEV: cameras split from the batch, Z heights from the rows
        return F.grid_sample(feats, grid, align_corners=False).view(1, B, C, 4, X, Y).sum(1).mean(2)
    if kind == "grid_sample_transposed":  # the same points as columns, transposed first: every sample computed
        return (
            F.grid_sample(feats, grid.transpose(1, 2), align_corners=False).transpose(2, 3).unflatten(2, (4, X)).mean(2)
        )
    rows = feats.permute(0, 2, 3, 1).reshape(-1, C)  # (B*h*w, C), a token dim merged from the sharded map
    if kind == "index_add":  # Lift-Splat's voxel pooling
        flat = dest.index_add(0, cells, rows)
    elif kind == "scatter_add":
        flat = dest.scatter_add(0, cells[:, None].expand(-1, C), rows)
    else:
        flat = dest.index_put((cells,), rows, accumulate=True)
    return flat.view(B, X, Y, C).permute(0, 3, 1, 2)


def _bev_case(layout: str, kind: str, dtype: torch.dtype, mode: str, then: str):
    torch.manual_seed(0)
    feats = torch.randn(B, C, 6, 12, dtype=dtype)
    cells = torch.randint(0, B * X * Y, (B * 6 * 12,))
    points = 4 if kind.startswith("grid_sample_") else 1  # 4: the image is gathered and sampled, then cut
    grid = torch.rand(B, points * X, Y, 2, dtype=dtype) * 2.4 - 1.2  # some cells project outside the image
    weight = torch.randn(4, C, 3, 3, dtype=dtype)
    dest = torch.randn(B * X * Y, C, dtype=dtype)
    seen = []

    def op(x):
        bev = _splat(kind, x, cells, grid, dest)
        if then == "grid":
            return bev * 1.0  # an element-wise op reduces it
        y = F.conv2d(bev, weight, padding=1)
        seen.append(y)
        y = F.batch_norm(y, None, None, training=True).relu()
        return y if then == "encoder" else (y.sigmoid() * y).mean()

    check(op, [feats], sharded=[0], axes=axes(layout), bev_shard=mode)
    want = {"x": (-2,), "y": (-1,), "xy": (-2, -1)[: len(LAYOUTS[layout][1])]}[mode]
    if then != "grid":
        sharded = seen[-1]  # the conv after the splat ran on this rank's cells only
        assert isinstance(sharded, SpatialTensor) and sharded.shard_layout.dims == want, sharded


@pytest.mark.parametrize("then", ["grid", "encoder", "loss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", SPLATS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_splat_then_encoder_matches_one_process(layout, kind, dtype, then):
    run_spmd(_bev_case, LAYOUTS[layout][0], layout, kind, dtype, MODES[layout], then)


@pytest.mark.parametrize("kind", SPLATS)
def test_one_plane_dim_on_a_2d_group(kind):
    """``"x"`` on 2x2 tiles: the sums are all-reduced over the second axis, reduce-scattered along X over the first."""
    run_spmd(_bev_case, 4, "2x2", kind, torch.float64, "x", "loss")


def _small_case():
    """A sum that is no BEV plane (fewer than 4 dims) is replicated, exactly as without ``bev_shard``."""
    torch.manual_seed(0)
    feats = torch.randn(B, C, 6, 12, dtype=torch.float64)
    cells = torch.randint(0, 9, (B * 6 * 12,))

    def op(x):
        table = torch.zeros(9, C, dtype=x.dtype).index_add(0, cells, x.permute(0, 2, 3, 1).reshape(-1, C))
        return table.t() * 2.0

    check(op, [feats], sharded=[0], axes=axes("w2"), bev_shard="xy")


def test_a_table_stays_replicated():
    run_spmd(_small_case, 2)


def _too_small_case():
    feats = shard(torch.randn(1, C, 4, 8), axes("w3"))
    grid = torch.rand(1, 2, 6, 2) * 2 - 1  # 2 cells along X, 3 ranks
    with entered(Run(fallback="error", bev_shard="x")):
        bev = F.grid_sample(feats, grid, align_corners=False)
        with pytest.raises(LayoutError, match=r"2 cells along dim -2, fewer than its 3 ranks.*bev_shard=None"):
            bev + 1


def test_a_grid_smaller_than_its_ranks_raises():
    run_spmd(_too_small_case, 3)


def _temporal_case(layout: str, dtype: torch.dtype, mode: str):
    """Temporal fusion on a sharded BEV grid: the previous frame's grid, sharded over its cells, warped by ego motion
    (``grid_sample`` at a replicated sampling grid), comes back sharded like the current one and joins it along
    channels for a conv."""
    torch.manual_seed(0)
    feats, prev = torch.randn(B, C, 6, 12, dtype=dtype), torch.randn(B, C, 6, 12, dtype=dtype)
    cells = torch.randint(0, B * X * Y, (B * 6 * 12,))
    angle, shift = 0.1, torch.tensor([0.05, -0.1], dtype=dtype)
    rotation = torch.tensor([[1.0, -angle], [angle, 1.0]], dtype=dtype)
    ys, xs = torch.meshgrid(torch.linspace(-1, 1, X, dtype=dtype), torch.linspace(-1, 1, Y, dtype=dtype), indexing="ij")
    ego = (torch.stack([xs, ys], -1) @ rotation.T + shift).expand(B, X, Y, 2)  # where each cell was a frame ago
    weight = torch.randn(4, 2 * C, 3, 3, dtype=dtype)
    dest = torch.randn(B * X * Y, C, dtype=dtype)

    def op(now_image, prev_image):
        now = _splat("index_add", now_image, cells, None, dest)
        before = _splat("index_add", prev_image, cells.flip(0), None, dest)
        warped = F.grid_sample(before, ego, align_corners=False)  # a sharded BEV input, a replicated grid
        out = F.conv2d(torch.cat([now, warped], 1), weight, padding=1)
        assert isinstance(out, SpatialTensor) == isinstance(now_image, SpatialTensor)  # sharded all the way
        return out

    check(op, [feats, prev], sharded=[0, 1], axes=axes(layout), bev_shard=mode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_temporal_fusion_on_a_sharded_grid(layout, dtype):
    run_spmd(_temporal_case, LAYOUTS[layout][0], layout, dtype, MODES[layout])


def _inplace_case():
    feats = shard(torch.randn(1, C, 4, 8), axes("w2"))
    grid = torch.rand(1, X, Y, 2) * 2 - 1
    with entered(Run(fallback="error", bev_shard="x")):
        bev = F.grid_sample(feats, grid, align_corners=False)
        with pytest.raises(LayoutError, match=r"add_ writes into a BEV grid .*bev = bev \+ x"):
            bev.add_(1.0)
        with pytest.raises(LayoutError, match=r"add_ writes into a BEV grid"):
            bev += 1.0
        assert isinstance(bev + 1.0, SpatialTensor)  # as a new tensor it is reduced, sharded
        again = F.grid_sample(feats, grid, align_corners=False)
        with counting_reductions() as count:
            again * 2.0, again.relu()
        assert count == [1]  # a pending sum read twice is reduced once


@contextmanager
def counting_reductions():
    """How many times pending sums are reduced in the block."""
    count, reduce = [0], pending_module._reduce

    def counted(p):
        count[0] += 1
        return reduce(p)

    pending_module._reduce = counted
    try:
        yield count
    finally:
        pending_module._reduce = reduce


def test_an_inplace_write_into_pending_sums_raises():
    """Writing into the sums before they are reduced would update a tensor the name no longer means: a clear error."""
    run_spmd(_inplace_case, 2)


VIEWS = {  # samples (B, C, 4 * X, Y) viewed in order, and how to reduce them to a (., C, X, Y) grid
    "points": (lambda s: s.unflatten(2, (4, X)), lambda s: s.mean(2)),  # BEVFormer's points of each cell
    "cameras": (lambda s: s.view(1, B, C, 4, X, Y), lambda s: s.sum(1).mean(2)),  # Simple-BEV's cameras, heights
}


def _lazy_case(layout: str, view: str):
    """The samples of a gathered image at replicated points stay uncomputed through views in order, and the first
    reader samples only this rank's cells, in the grad mode the samples were asked in."""
    torch.manual_seed(0)
    feats = shard(torch.randn(B, C, 6, 12), axes(layout)).requires_grad_()
    grid = torch.rand(B, 4 * X, Y, 2) * 2.4 - 1.2
    viewed, reduced = VIEWS[view]
    asked = []
    with entered(Run(fallback="error", bev_shard=MODES[layout])):
        samples = F.grid_sample(feats, grid, align_corners=False)
        with torch.no_grad():
            stacked = viewed(samples)
        assert samples._samples is not None and stacked._samples is not None  # nothing sampled yet
        inner = stacked._samples.sample
        stacked._samples.sample = lambda points: asked.append(tuple(points.shape)) or inner(points)
        out = reduced(stacked).to_local()
    assert asked == [(B, 2, 4, *out.shape[-2:])], (asked, out.shape)  # this rank's cells' points only
    assert out.requires_grad
    assert out.shape[-2:] != (X, Y)


@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_samples_are_computed_at_this_ranks_cells_only(layout, view):
    run_spmd(_lazy_case, LAYOUTS[layout][0], layout, view)
