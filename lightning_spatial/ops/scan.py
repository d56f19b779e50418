"""Cumulative sums along a sharded dim: local scans plus exclusive scans of the ranks' totals, never the data.

A dim's global order is lexicographic over its factors (a plain dim is one factor; a token dim merged from
sharded maps is ``outer x size x inner`` per sharded factor: ``Layout.factors``). The inclusive scan at an element
is its scan along the innermost factor plus, for every outer factor, the exclusive scan along that factor of the
totals over all factors inside it. A scan along a sharded factor is the local scan plus the sum of the earlier
ranks' totals (one all-gather of one row per rank); a total over sharded inner factors is one all-reduce. So a
rank exchanges a few rows of totals, and its tokens stay where they are. Differentiable through both collectives.

A token dim of several token sets one after another (``Layout.segments``: the levels of a feature pyramid
concatenated) is scanned set by set, each as above, and each set's scan starts from the earlier sets' totals (one
all-reduce of a row per set), so the order is the single-device one: set after set, each set's tokens in its own
global order.
"""

from __future__ import annotations

import torch

from ..collectives import across, all_gather
from ..layout import DimShard, Layout
from ..tensor import adopt, on_shard, unwrap
from ._binding import bound
from ._common import bad_or_fallback


def cumsum(input, dim, dtype=None):
    x, layout = unwrap(input)
    if not -x.dim() <= dim < x.dim():
        return bad_or_fallback(torch.cumsum, (input, dim), {"dtype": dtype})
    dim = dim % x.dim() - x.dim()
    if not layout.on(dim):
        return adopt(on_shard(torch.cumsum, input, dim, dtype=dtype), layout)
    if dtype is None and not (x.is_floating_point() or x.is_complex()):
        dtype = torch.int64  # as torch: integral and boolean inputs sum in int64
    if dtype is not None:
        x = x.to(dtype)
    sets = layout.segments(dim)
    if sets is None:
        return adopt(_scan_dim(x, dim, layout), layout)
    others = tuple(s for s in layout.shards if s.dim != dim)
    parts = x.split(layout.local_sizes(dim), dim)
    scans, before = [], None
    for part, one in zip(parts, sets):  # set after set: each set's scan plus the earlier sets' totals
        scan = _scan_dim(part, dim, Layout(others + one.shards))
        scans.append(scan if before is None else scan + before)
        total = across(part.sum(dim, keepdim=True), one.shards)
        before = total if before is None else before + total
    return adopt(torch.cat(scans, dim), layout)


def _scan_dim(x: torch.Tensor, dim: int, layout: Layout) -> torch.Tensor:
    """The inclusive scan of local ``x`` along sharded ``dim`` of one token set (its factors)."""
    factors = layout.factors(dim)
    pos = x.dim() + dim
    runs = x.unflatten(pos, [s.stop - s.start if s else n for n, s in factors])  # one local dim per factor
    last = pos + len(factors) - 1
    out = _scan(runs, last, factors[-1][1], exclusive=False)
    for k in range(len(factors) - 1):  # what comes before along each outer factor: totals over the inner ones
        totals = across(
            runs.sum(tuple(range(pos + k + 1, last + 1)), keepdim=True), [s for _, s in factors[k + 1 :] if s]
        )
        out = out + _scan(totals, pos + k, factors[k][1], exclusive=True)
    return out.flatten(pos, last)


def _scan(t: torch.Tensor, dim: int, shard: DimShard | None, exclusive: bool) -> torch.Tensor:
    """The scan along one factor, global when it is sharded: the earlier ranks' totals are added."""
    out = t.cumsum(dim)
    if shard is not None:
        every = all_gather(out.narrow(dim, out.shape[dim] - 1, 1), dim, shard.axis, shard.axis.size)
        out = out + every.narrow(dim, 0, shard.axis.index).sum(dim, keepdim=True)
    return out - t if exclusive else out


HANDLERS = bound(cumsum, torch.cumsum, torch.Tensor.cumsum)

__all__ = ["HANDLERS", "cumsum"]
