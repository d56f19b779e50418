"""Token sets one after another: the levels of a feature pyramid (or cameras) flattened to tokens, concatenated along
the token dim, worked on token-wise and split back by sizes stay sharded, with no communication, as in
BEVFormer's encoder and multi-scale deformable attention (the pure-PyTorch algorithm of mmcv's
``multi_scale_deformable_attn_pytorch``, written here from its description: split the value tokens per level, view
each level as a map, ``grid_sample`` it at the replicated sampling points, weight and sum)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from lightning_spatial import SpatialFallbackWarning
from lightning_spatial.layout import LayoutError
from tests.ops.cases import DTYPES, check_cases
from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd

B, C, CAMS, HEADS, QUERIES, POINTS = 2, 4, 2, 2, 5, 3


def _sizes(layout: str) -> list[tuple[int, int]]:  # 64 (w3: 70) tokens in all
    """Per level (h, w): every level shardable over the layout's ranks (w3: widths of 3 and more)."""
    return [(6, 9), (3, 5), (2, 3)] if layout == "w3" else [(6, 8), (3, 4), (2, 2)]


def _levels(layout):
    return [torch.randn(B, C, h, w) for h, w in _sizes(layout)]


def _tokens(levels):
    return [x.flatten(2).transpose(1, 2) for x in levels]  # (B, h*w, C) per level


def _maps(tokens, like):
    return [t.transpose(1, 2).reshape(x.shape) for t, x in zip(tokens, like)]


def _token_layers(*args):
    """Level embeddings, a linear layer and a norm over all levels' tokens, split back, a conv on every level."""
    *levels, weight, level_embed = args
    tokens = torch.cat([t + level_embed[k] for k, t in enumerate(_tokens(levels))], 1)
    tokens = F.layer_norm(F.gelu(F.linear(tokens, weight)), (C,))
    back = tokens.split([x.shape[-2] * x.shape[-1] for x in levels], dim=1)
    return tuple(F.conv2d(m, weight[:, :, None, None].expand(-1, -1, 3, 3), padding=1) for m in _maps(back, levels))


def _regrouped(*levels):
    """Split at other borders: the first two levels together, then the last; softmax and sums over all tokens."""
    tokens = torch.cat(_tokens(levels), 1).unsqueeze(1).squeeze(1)  # a size-1 dim before the sets, and gone again
    n = [x.shape[-2] * x.shape[-1] for x in levels]
    first_two, last = torch.split(tokens, [n[0] + n[1], n[2]], dim=1)
    mixed = torch.cat([first_two, last * 2], 1)  # a cat of a segmented operand: the segments stay as they were
    return first_two.softmax(1), last.sum(1), mixed.mean(1), mixed.amax(1), tokens.square().sum()


def _deformable_attention(*args):
    """BEVFormer's spatial cross-attention value path: camera tokens of every level, concatenated, projected, split
    back per level and sampled at replicated points (mmcv's pure-PyTorch multi-scale deformable attention)."""
    *levels, value_proj, locations, attention = args
    shapes = [(x.shape[-2], x.shape[-1]) for x in levels]
    flat = [x.view(CAMS, B // CAMS if B % CAMS == 0 else 1, C, -1).flatten(3).permute(0, 1, 3, 2) for x in levels]
    value = torch.cat(flat, 2).permute(0, 2, 1, 3)  # (cams, tokens, bs, C), BEVFormer's feat_flatten
    value = value.permute(2, 0, 1, 3).reshape(-1, value.shape[1], C)  # (bs * cams, tokens, C)
    value = F.linear(value, value_proj).view(value.shape[0], value.shape[1], HEADS, C // HEADS)
    bs = value.shape[0]
    value_list = value.split([h * w for h, w in shapes], dim=1)
    grids = 2 * locations - 1
    sampled = []
    for level, (h, w) in enumerate(shapes):
        value_l = value_list[level].flatten(2).transpose(1, 2).reshape(bs * HEADS, C // HEADS, h, w)
        grid_l = grids[:, :, :, level].transpose(1, 2).flatten(0, 1)
        sampled.append(F.grid_sample(value_l, grid_l, mode="bilinear", padding_mode="zeros", align_corners=False))
    weights = attention.transpose(1, 2).reshape(bs * HEADS, 1, QUERIES, len(shapes) * POINTS)
    out = (torch.stack(sampled, dim=-2).flatten(-2) * weights).sum(-1).view(bs, HEADS * (C // HEADS), QUERIES)
    return out.transpose(1, 2).contiguous()


def _deformable_inputs(layout):
    levels = [torch.randn(B, C, h, w) for h, w in _sizes(layout)]
    locations = torch.rand(B, QUERIES, HEADS, len(levels), POINTS, 2) * 1.2 - 0.1  # some points off the map
    attention = torch.rand(B, QUERIES, HEADS, len(levels), POINTS).softmax(-1)
    return [*levels, torch.randn(C, C), locations, attention]


CASES = {
    "levels_as_tokens_and_back": (
        lambda lay: [*_levels(lay), torch.randn(C, C) / 2, torch.randn(3, 1, C)],
        _token_layers,
        [0, 1, 2],
    ),
    "split_at_other_borders_and_reductions": (lambda lay: _levels(lay), _regrouped, [0, 1, 2]),
    "multi_scale_deformable_attention": (_deformable_inputs, _deformable_attention, [0, 1, 2]),
    "attention_and_selection_over_all_levels": (  # a deformable-DETR-style decoder's keys: every level's tokens
        lambda lay: [*_levels(lay), torch.randn(B, QUERIES, C), torch.tensor([0, 50, 3, 61])],
        lambda *args: _over_all_levels(torch.cat(_tokens(args[:3]), 1), *args[3:]),
        [0, 1, 2],
    ),
}


def _over_all_levels(tokens, queries, index):
    return (
        F.scaled_dot_product_attention(queries, tokens, tokens),
        *tokens.topk(3, dim=1),
        tokens.argmax(1),
        tokens.index_select(1, index),
        tokens.cumsum(-1),  # along the channels: local
    )


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_token_sets_match_one_device_without_communication(layout, dtype):
    run_spmd(check_cases, LAYOUTS[layout][0], layout, dtype, CASES)


def _regrouping_gathers(layout):
    levels = _levels(layout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(  # a view that regroups tokens across the sets cannot stay local: the exact fallback, announced
            lambda *xs: torch.cat(_tokens(xs), 1).view(B, -1, 2, C // 2).flatten(1, 2).cumsum(1),
            levels,
            [0, 1, 2],
            axes(layout),
            allow_fallback=True,
        )
    said = {str(w.message).split(" has no")[0] for w in caught if issubclass(w.category, SpatialFallbackWarning)}
    assert said == {"lightning_spatial: Tensor.flatten"}, said


def test_a_view_across_the_token_sets_takes_the_fallback():
    run_spmd(_regrouping_gathers, 2, "w2")


def _one_row_level(layout, dtype):
    """A pyramid whose coarsest level is one row high (a plain width-sharded dim once flattened) is a token set too."""
    torch.manual_seed(0)
    width = 9 if layout == "w3" else 8
    levels = [torch.randn(B, C, 4, 2 * width, dtype=dtype), torch.randn(B, C, 1, width, dtype=dtype)]
    weight, level_embed = torch.randn(C, C, dtype=dtype) / 2, torch.randn(2, 1, C, dtype=dtype)
    check(lambda *args: _token_layers(*args, weight, level_embed), levels, [0, 1], axes(layout))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", ["w2", "w3"])
def test_a_level_one_row_high_is_a_token_set(layout, dtype):
    run_spmd(_one_row_level, LAYOUTS[layout][0], layout, DTYPES[dtype])


def _maps_along_width(layout):
    x, y = torch.randn(B, C, 4, 6), torch.randn(B, C, 4, 3)
    with pytest.raises(LayoutError, match="torch.cat"):  # fallbacks are errors: the exact fallback was chosen
        check(lambda a, b: torch.cat([a, b], -1), [x, y], [0, 1], axes(layout))


def test_maps_concatenated_along_their_sharded_width_are_no_token_sets():
    run_spmd(_maps_along_width, 2, "w2")
