"""Cumulative sums along a sharded dim: local scans plus exclusive scans of the ranks' totals, never the data.

A dim's global order is lexicographic over its factors (a plain dim is one factor; a token dim merged from
sharded maps is ``outer x size x inner`` per sharded factor: ``Layout.factors``). The inclusive scan at an element
is its scan along the innermost factor plus, for every outer factor, the exclusive scan along that factor of the
totals over all factors inside it. A scan along a sharded factor is the local scan plus the sum of the earlier
ranks' totals (one all-gather of one row per rank); a total over sharded inner factors is one all-reduce. So a
rank exchanges a few rows of totals, and its tokens stay where they are. Differentiable through both collectives.
"""

from __future__ import annotations

import torch

from ..collectives import across, all_gather
from ..fallback import fallback
from ..layout import DimShard
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
    if layout.segments(dim) is not None:  # token sets one after another: the exact fallback
        return fallback(torch.cumsum, (input, dim), {"dtype": dtype})
    if dtype is None and not (x.is_floating_point() or x.is_complex()):
        dtype = torch.int64  # as torch: integral and boolean inputs sum in int64
    if dtype is not None:
        x = x.to(dtype)
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
    return adopt(out.flatten(pos, last), layout)


def _scan(t: torch.Tensor, dim: int, shard: DimShard | None, exclusive: bool) -> torch.Tensor:
    """The scan along one factor, global when it is sharded: the earlier ranks' totals are added."""
    out = t.cumsum(dim)
    if shard is not None:
        every = all_gather(out.narrow(dim, out.shape[dim] - 1, 1), dim, shard.axis, shard.axis.size)
        out = out + every.narrow(dim, 0, shard.axis.index).sum(dim, keepdim=True)
    return out - t if exclusive else out


HANDLERS = bound(cumsum, torch.cumsum, torch.Tensor.cumsum)

__all__ = ["HANDLERS", "cumsum"]
