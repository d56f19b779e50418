"""Boolean masks over sharded dims (``x[mask]``, ``x[mask] = v``, ``masked_select``, ``masked_scatter``,
``nonzero``) and what a selection of rows does next (element-wise ops, sums and means, losses), against one process:
outputs and every gradient, on w2, w3 (uneven), h2 and 2x2, fp32 and float64, fallbacks as errors. Masks are
random with rows that select nothing, and one selects only a corner, so that some ranks hold no rows; an FCOS-like
box loss selects foreground tokens of a flattened map. Token sets one after another (pyramid levels concatenated)
with sharded and replicated masks, ``cumsum`` along them, FCOS's and RetinaNet's one-hot targets
(``gt[fg, labels[fg]] = 1``), torchvision's ``generalized_box_iou_loss`` (a mask over selected rows) and
RetinaNet's replicated integer indices into a token dim. Ops a selection has no handler for, and selections of two
different masks meeting, take the exact fallback (an error in "error" mode)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchvision.ops import generalized_box_iou_loss, sigmoid_focal_loss

from lightning_spatial import LayoutError, SpatialFallbackWarning, shard
from lightning_spatial.ops.selection import Selection
from lightning_spatial.run import Run, entered
from tests.ops.cases import DTYPES, check_cases
from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd

B, C, H = 2, 3, 5


def _w(layout: str) -> int:
    return 7 if layout == "w3" else 6


def _map(layout, channels=C):
    return torch.randn(B, channels, H, _w(layout))


def _mask(layout, *lead):
    """Random, with a row and a column of every sample selecting nothing."""
    m = torch.rand(*lead, B, H, _w(layout)) > 0.5
    m[..., 1, :] = False
    m[..., :, 2] = False
    return m[0] if lead else m


def _corner(layout):
    """Only the top-left corner: every rank but the first holds no rows (w2, w3, h2, 2x2)."""
    m = torch.zeros(B, H, _w(layout), dtype=torch.bool)
    m[:, :2, :2] = torch.rand(B, 2, 2) > 0.3
    m[0, 0, 0] = True
    return m


def _channels_last(x):
    return x.permute(0, 2, 3, 1)


def _losses(x, m, target, labels):
    rows = _channels_last(x)[m]  # (K, C)
    return (
        rows * 2,
        F.l1_loss(rows, target),
        F.mse_loss(rows, target, reduction="sum"),
        F.smooth_l1_loss(rows, target, beta=0.5),
        F.binary_cross_entropy_with_logits(rows, target.sigmoid()),
        F.cross_entropy(rows, labels),
        F.l1_loss(rows, target, reduction="none"),
    )


def _with_rows(make_mask):
    """x, a sharded mask, a replicated target of the mask's K rows and class labels."""

    def make(layout):
        m = make_mask(layout)
        k = int(m.sum())
        return [_map(layout), m, torch.randn(k, C), torch.randint(0, C, (k,))]

    return make


def _assign(x, m, target, labels):
    y = _channels_last(x) * 1.0  # a new channels-last map to write into
    y[m] = y[m] * 2  # a Selection of the same mask
    z = x * 1.0
    _channels_last(z)[m] = 0.0  # through a view
    w = _channels_last(x) * 1.0
    w[m] = target  # a replicated value of K rows
    v = _channels_last(x) * 1.0
    v[m] = target[0]  # a replicated value broadcast over the rows
    return y, z, w, v


def _reductions(x, m, target, labels):
    rows = _channels_last(x)[m]
    return rows.sum(), rows.mean(), rows.sum(0), torch.mean(rows, dim=0), rows.sum(-1), rows.mean((0, 1), keepdim=True)


def _elementwise(x, m, target, labels):
    rows = _channels_last(x)[m]
    other = (_channels_last(x) * 3)[m]  # another selection of the same mask: the same rows
    weight = target[0]  # (C,): broadcast over the rows
    return (
        rows * weight + target,
        torch.where(rows > 0, rows, target).sigmoid(),
        (rows - other).abs() / 2,
        rows[:, 1:],
        rows[..., 0] * 3,
    )


def _fcos(pred_map, target_map, labels):
    """torchvision's FCOS box loss: foreground tokens of (N, HW, 4) token maps, summed, over the foreground count."""
    pred = pred_map.flatten(2).transpose(1, 2)
    target = target_map.flatten(2).transpose(1, 2)
    fg = (labels > 0).flatten(1)
    return F.l1_loss(pred[fg], target[fg], reduction="sum") / max(1, fg.sum())


def _fcos_replicated_target(pred_map, labels, target):
    pred = pred_map.flatten(2).transpose(1, 2)
    fg = (labels > 0).flatten(1)
    return F.l1_loss(pred[fg], target[fg], reduction="sum") / max(1, fg.sum()), pred[fg].sum(-1)


def _labels(layout):
    return torch.randint(0, 3, (B, H, _w(layout))) * _mask(layout)


def _full_mask(layout):
    return torch.rand(B, C, H, _w(layout)) > 0.4


def _level_sizes(layout: str) -> list[tuple[int, int]]:
    """Per pyramid level (h, w), each shardable over the layout's ranks (w3: uneven widths)."""
    return [(6, 9), (3, 5), (2, 3)] if layout == "w3" else [(6, 8), (3, 4), (2, 2)]


def _token_sets(*levels):
    """Levels (B, C, h, w) as (B, tokens, C), level after level: token sets one after another."""
    return torch.cat([x.flatten(2).transpose(1, 2) for x in levels], 1)


def _label_levels(layout):
    """Per level, labels 0 (background) to 2 with a row selecting nothing; the last level is all background."""
    out = [torch.randint(0, 3, (B, h, w)) * (torch.arange(h)[:, None] != 1) for h, w in _level_sizes(layout)]
    out[-1].zero_()
    return out


def _sharded_mask_over_sets(layout):
    return [
        *(torch.randn(B, 4, h, w) for h, w in _level_sizes(layout)),
        *(torch.randn(B, 4, h, w) for h, w in _level_sizes(layout)),
        *_label_levels(layout),
    ]


def _over_sets_sharded(*args):
    """A mask computed from sharded labels over the levels' tokens (a sharded mask over token sets)."""
    pred, target = _token_sets(*args[:3]), _token_sets(*args[3:6])
    labels = torch.cat([t.flatten(1) for t in args[6:]], 1)  # (B, tokens), level after level
    fg = labels > 0
    rows = pred[fg]
    return (
        F.l1_loss(rows, target[fg], reduction="sum") / max(1, fg.sum()),
        F.binary_cross_entropy_with_logits(rows[:, 0], target[fg][:, 1].sigmoid()),
        rows.mean(0),
        fg.cumsum(1),  # the running count itself: level after level
        pred.cumsum(1),  # a float scan over the token sets
        torch.nonzero(fg),
        pred[torch.where(fg)] - rows,  # coordinates over token sets: the mask's rows
        pred[fg, labels[fg]],  # one class per row, a Selection of integer indices
    )


def _replicated_mask_over_sets(layout):
    sizes = _level_sizes(layout)
    tokens = sum(h * w for h, w in sizes)
    classes = torch.randint(-1, 3, (B, tokens))
    classes[1, -10:] = -1
    return [*(torch.randn(B, 3, h, w) for h, w in sizes), classes, torch.randn(B, tokens, 3)]


def _over_sets_replicated(*args):
    """A replicated mask over the levels' tokens (computed from anchors and targets, as detectors do): FCOS's
    one-hot classification target ``gt[fg, classes[fg]] = 1``, RetinaNet's per-image ``x[fg, :]``."""
    *levels, classes, target = args
    logits = _token_sets(*levels)
    fg = classes >= 0
    gt = torch.zeros_like(logits)
    gt[fg, classes[fg]] = 1.0
    picked = logits[fg, classes[fg]]
    per_image = []
    for logits_i, classes_i, target_i in zip(logits, classes, target):
        fg_i = classes_i >= 0
        per_image.append(F.l1_loss(logits_i[fg_i, :], target_i[fg_i], reduction="sum"))
    return (
        sigmoid_focal_loss(logits, gt, reduction="sum") / max(1, fg.sum().item()),
        gt,
        picked * 2,
        logits[fg, 1:],
        *per_image,
        logits[fg, ...].sum(),
    )


def _boxes_over_sets(layout):
    sizes = _level_sizes(layout)
    tokens = sum(h * w for h, w in sizes)
    corners = torch.rand(B, tokens, 2) * 8
    target = torch.cat([corners, corners + 1 + torch.rand(B, tokens, 2) * 4], -1)
    return [*(torch.randn(B, 4, h, w) for h, w in sizes), torch.randint(-1, 2, (B, tokens)), target]


def _giou(*args):
    """torchvision's ``generalized_box_iou_loss`` over selected tokens: pairwise ``torch.max``/``min`` with the
    replicated targets, ``intsctk[mask] = ...`` with a mask over the selected rows (rows of those rows)."""
    *levels, classes, target = args
    deltas = _token_sets(*levels)
    corners = target[..., :2] + deltas[..., :2]
    pred = torch.cat([corners, corners + deltas[..., 2:].exp() * 2], -1)
    fg = classes >= 0
    rows, goal = pred[fg], target[fg]
    keep = rows[:, 0] > goal[:, 0]
    picked = rows[keep]
    other = rows * 1.0
    other[keep] = picked * 3
    again = rows * 1.0
    again[keep] = 0.5
    flags = (goal[:, 1] > 4).to(torch.uint8)  # a replicated mask of K flags
    return (
        generalized_box_iou_loss(rows, goal, reduction="sum"),
        generalized_box_iou_loss(rows, goal),
        picked * 2,
        picked.sum(),
        other,
        again,
        torch.max(rows, goal),
        torch.min(rows[:, 0], rows[:, 1]),
        rows[flags.bool()],
        rows[keep, :][:, 1:].sum(0),
    )


def _rows_of_rows(*args):
    """A mask over selected pixels' rows, on a map (one token set)."""
    x, m = args[:2]
    rows = _channels_last(x)[m]
    keep = rows.sum(-1) > 0
    out = rows * 1.0
    out[keep] = rows[keep].exp()
    return rows[keep], out, rows[keep][rows[keep][:, 0] > 0]


def _indexed_tokens(layout):
    sizes = _level_sizes(layout)
    tokens = sum(h * w for h, w in sizes)
    classes = torch.randint(-1, 2, (B, tokens))
    classes[1] = -1  # an image without foreground
    return [*(torch.randn(B, 4, h, w) for h, w in sizes), classes, torch.randn(B, tokens, 4)]


def _take_tokens(*args):
    """RetinaNet's box loss: per image, ``x[torch.where(fg)[0], :]`` with replicated integer indices into a token
    dim of token sets (the only sharded dim), an L1 loss against replicated targets of those rows; duplicate and
    negative indices, and a single map's tokens."""
    *levels, classes, target = args
    tokens = _token_sets(*levels)
    out = []
    for tokens_i, classes_i, target_i in zip(tokens, classes, target):
        idx = torch.where(classes_i >= 0)[0]
        rows = tokens_i[idx, :]
        out.append(F.l1_loss(rows, target_i[idx], reduction="sum") / max(1, idx.numel()))
    some = torch.tensor([3, -1, 3, 0, 17])
    one_map = levels[0][0].flatten(1).transpose(0, 1)  # (h * w, 4): one token set
    return (*out, tokens[0][some] * 2, one_map[some, 1:].sum(0), one_map[some, ...].exp())


CASES = {
    "select_channels_last_then_losses": (_with_rows(_mask), _losses, [0, 1]),
    "a_rank_selects_nothing": (_with_rows(_corner), _losses, [0, 1]),
    "a_replicated_mask": (_with_rows(_mask), _losses, [0]),
    "assign_under_a_mask": (_with_rows(_mask), _assign, [0, 1]),
    "sum_and_mean_of_rows": (_with_rows(_mask), _reductions, [0, 1]),
    "elementwise_on_rows": (_with_rows(_corner), _elementwise, [0, 1]),
    "masked_select_then_sum": (
        lambda lay: [_map(lay), _full_mask(lay)],
        lambda x, m: (torch.masked_select(x, m).sum(), x.masked_select(m) * 2),
        [0, 1],
    ),
    "masked_scatter": (
        lambda lay: [_map(lay), _full_mask(lay), torch.randn(B * C * H * _w(lay) + 3)],
        lambda x, m, src: (x.masked_scatter(m, src), x.masked_scatter(m, x[m] * 3), (x * 1.0).masked_scatter_(m, src)),
        [0, 1],
    ),
    "masked_fill": (
        lambda lay: [_map(lay), _full_mask(lay), _mask(lay)],
        lambda x, m, m3: (x.masked_fill(m, 0.5), x.masked_fill(m3[:, None], -1.0)),
        [0, 1, 2],
    ),
    "nonzero_coordinates": (
        lambda lay: [_mask(lay)],
        lambda m: (torch.nonzero(m), *m.nonzero(as_tuple=True), *torch.where(m), torch.argwhere(m)),
        [0],
    ),
    "index_with_coordinates": (
        _with_rows(_mask),
        lambda x, m, target, labels: (
            F.mse_loss(_channels_last(x)[torch.nonzero(m).unbind(1)], target),
            _channels_last(x)[torch.where(m)] - _channels_last(x)[m],  # the same rows as the mask's
            x.sum(1)[torch.where(m)],
        ),
        [0, 1],
    ),
    "fcos_box_loss_over_tokens": (
        lambda lay: [_map(lay, 4), _map(lay, 4), _labels(lay)],
        _fcos,
        [0, 1, 2],
    ),
    "a_sharded_mask_over_token_sets": (_sharded_mask_over_sets, _over_sets_sharded, range(9)),
    "a_replicated_mask_over_token_sets": (_replicated_mask_over_sets, _over_sets_replicated, [0, 1, 2]),
    "generalized_box_iou_loss_over_token_sets": (_boxes_over_sets, _giou, [0, 1, 2]),
    "rows_of_rows": (_with_rows(_mask), _rows_of_rows, [0, 1]),
    "integer_indices_into_token_sets": (_indexed_tokens, _take_tokens, [0, 1, 2]),
    "fcos_box_loss_replicated_target": (
        lambda lay: [_map(lay, 4), _labels(lay), torch.randn(B, H * _w(lay), 4)],
        _fcos_replicated_target,
        [0, 1],
    ),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_masks_over_sharded_dims_match_one_device(layout, dtype):
    run_spmd(check_cases, LAYOUTS[layout][0], layout, dtype, CASES)


def _fallbacks(layout):
    mesh_axes = axes(layout)
    torch.manual_seed(0)
    x, m = _map(layout).double(), _mask(layout)
    other = m.flatten().flip(0).view(m.shape)  # as many rows, other ones
    fewer = m & (torch.arange(m.numel()).view(m.shape) % 3 > 0)
    assert int(other.sum()) == int(m.sum()) != int(fewer.sum()) and not torch.equal(other, m)
    ops = {
        "Tensor.cumsum": lambda x, m, o, f: _channels_last(x)[m].cumsum(0),
        "Tensor.sort": lambda x, m, o, f: _channels_last(x)[m].sort(0).values,
        "Tensor.add": lambda x, m, o, f: _channels_last(x)[m] + _channels_last(x)[o],  # two masks: other rows
        "Tensor.sub": lambda x, m, o, f: _channels_last(x)[m] - _channels_last(x)[f],  # another count
        "Tensor.__getitem__": lambda x, m, o, f: _channels_last(x)[m][_channels_last(x)[o][:, 0] > 0],  # other rows
        "torch.max": lambda x, m, o, f: torch.max(_channels_last(x)[m]),  # a reduction, not max(a, b)
    }
    for name, op in ops.items():
        with entered(Run(fallback="error")):
            with pytest.raises(LayoutError, match=f"{name}.*no spatial handler"):
                op(*(shard(t, mesh_axes) for t in (x, m, other, fewer)))
        if name == "Tensor.sub":  # another count: torch's own error on one device
            continue
        with pytest.warns(SpatialFallbackWarning, match=name):
            check(op, [x, m, other, fewer], [0, 1, 2, 3], mesh_axes, allow_fallback=True)
    with entered(Run(fallback="error")):  # a mask sharded along another dim than x
        along_h = shard(m, {-2: next(iter(mesh_axes.values()))})
        with pytest.raises(LayoutError, match="Tensor.__getitem__ has no spatial handler"):
            _channels_last(shard(x, mesh_axes))[along_h]
    # one mask, two tensors: the same rows, told apart by one boolean all-reduce, not a fallback
    check(lambda x, m: _channels_last(x)[m] * _channels_last(x)[m.clone()], [x, m], [0, 1], mesh_axes)


@pytest.mark.parametrize("layout", ["w3", "2x2"])
def test_other_ops_and_other_rows_take_the_fallback(layout):
    run_spmd(_fallbacks, LAYOUTS[layout][0], layout)


def _reports(layout):
    mesh_axes = axes(layout)
    torch.manual_seed(0)
    x, m = _map(layout), _mask(layout)
    with entered(Run(fallback="error")):
        rows = shard(x, mesh_axes).permute(0, 2, 3, 1)[shard(m, mesh_axes)]
        k = int(m.sum())
        assert isinstance(rows, Selection) and rows.shape == (k, C) and rows.size(0) == len(rows) == k
        assert rows.numel() == k * C and rows.dim() == 2 and rows.count == k
        local = rows.to_local()
        assert local.shape[0] == rows.positions.numel() <= k  # this rank's rows only
        assert torch.equal(local, x.permute(0, 2, 3, 1)[m][rows.positions])


@pytest.mark.parametrize("layout", ["w3", "2x2"])
def test_a_selection_reports_the_global_shape_and_holds_its_own_rows(layout):
    run_spmd(_reports, LAYOUTS[layout][0], layout)
