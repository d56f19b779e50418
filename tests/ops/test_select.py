"""Top-k, sort and arg-extremes over sharded tokens: exact values, global indices and ties as torch breaks them."""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import DTYPES, check_cases, raises_like_one_device
from tests.spmd import LAYOUTS, run_spmd

B, C, H = 2, 3, 5


def _w(layout: str) -> int:
    return 19 if layout == "w3" else 8


def _scores(layout):
    return torch.randn(B, H, _w(layout))


def _tied(x):
    """Values with many ties (rounded), still differentiable (the rounding passes the gradient through)."""
    return x + (x.detach().round() - x.detach())


def _in_order(values, indices):
    """``sorted=False`` promises no order (ours come sorted): compare in sorted order."""
    order = values.argsort(1)
    return values.gather(1, order), indices.gather(1, order)


CASES = {
    "topk_tokens": (lambda lay: [_scores(lay)], lambda s: s.flatten(1).topk(6, dim=1), [0]),
    "topk_smallest_unsorted": (
        lambda lay: [_scores(lay)],
        lambda s: _in_order(*torch.topk(s.flatten(1), 4, 1, largest=False, sorted=False)),
        [0],
    ),
    "topk_more_than_a_shard_holds": (  # w3: 2x3 split in columns of one, 2x2: tiles of one or two
        lambda lay: [torch.randn(B, 2, 3)],
        lambda s: s.flatten(1).topk(5, 1),
        [0],
    ),
    "topk_along_width_keeps_the_height_shard": (
        lambda lay: [torch.randn(B, C, H, _w(lay))],
        lambda x: x.topk(3, dim=-1),
        [0],
    ),
    "select_foreground_tokens": (  # StreamPETR: the top-k tokens' features, by replicated indices
        lambda lay: [_scores(lay), torch.randn(B, C, H, _w(lay))],
        lambda s, x: (
            x.flatten(2).transpose(1, 2).gather(1, s.flatten(1).topk(4, 1).indices[..., None].expand(-1, -1, C))
        ),
        [0, 1],
    ),
    "max_min_dim_with_ties": (
        lambda lay: [_scores(lay)],
        lambda s: (*_tied(s).flatten(1).max(1), *torch.min(_tied(s).flatten(1), 1, keepdim=True)),
        [0],
    ),
    "argmax_argmin_with_ties": (
        lambda lay: [_scores(lay)],
        lambda s: (_tied(s).flatten(1).argmax(1), torch.argmin(_tied(s), -1, keepdim=True), _tied(s).argmax(1)),
        [0],
    ),
    "sort_argsort_stable_with_ties": (
        lambda lay: [_scores(lay)],
        lambda s: (
            *_tied(s).flatten(1).sort(dim=1, descending=True, stable=True),
            torch.argsort(_tied(s), dim=-1, stable=True),
        ),
        [0],
    ),
    "max_of_everything_and_binary_max": (
        lambda lay: [_scores(lay), _scores(lay)],
        lambda s, t: (s.max(), torch.min(s), torch.max(s, t)),
        [0, 1],
    ),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_selection_matches_one_device(layout, dtype):
    run_spmd(check_cases, LAYOUTS[layout][0], layout, dtype, CASES)


def test_k_larger_than_the_tokens_raises_torchs_error_before_communicating():
    op = lambda s: s.flatten(1).topk(H * 8 + 1, 1)  # noqa: E731
    run_spmd(raises_like_one_device, 2, "w2", op, [_scores("w2")], [0], False, timeout=30)  # meta kernel's wording
