"""Top-k and sort along a sharded (token) dim: exact values and global indices.

``topk`` (and ``max``/``argmax`` along a merged token dim, through ``ops.reduce``) selects candidates locally
(a stable local sort, its first ``k``), all-gathers ``k`` candidates per rank with their global indices
(``Layout.positions``) and picks the final ``k`` with a stable sort of the candidates in global index order.
Ties therefore go to the lowest global index: what torch documents for ``max``/``argmax`` (the first
occurrence) and what ``sort(stable=True)`` gives; ``torch.topk`` itself promises no order among ties. NaN sorts
above everything, as in torch. The values are then gathered by those indices (``ops.index``), so their gradient
reaches exactly the selected entries. ``sort``/``argsort`` need the whole dim: it is all-gathered (a few scalars
per token) and sorted on every rank. Results are replicated along the selected dim and keep the other dims'
sharding.
"""

from __future__ import annotations

import torch

from ..collectives import all_gather
from ..tensor import gather, unwrap, wrap
from ._common import layout_of, negative_dim, split_shards
from ._meta import meta_check


def select(input, k: int, dim: int, largest: bool):
    """(values, global indices) of the ``k`` largest (smallest) entries along a sharded ``dim``, sorted."""
    x, layout = unwrap(input)
    d = negative_dim(dim, x.dim())
    along, kept = split_shards(layout, d)
    pos = x.dim() + d
    local = x.detach().sort(dim=d, descending=largest, stable=True)
    m = min(k, x.shape[d])
    values, index = local.values.narrow(d, 0, m), layout.positions(d, x.device)[local.indices.narrow(d, 0, m)]
    if m < k:  # a thin shard: pad with entries that lose every comparison (and every tie: index past the end)
        pad = list(values.shape)
        pad[d] = k - m
        info = torch.finfo if values.is_floating_point() else torch.iinfo
        values = torch.cat(
            [values, values.new_full(pad, info(values.dtype).min if largest else info(values.dtype).max)], d
        )
        index = torch.cat([index, index.new_full(pad, along[0].extent)], d)
    for s in along:
        values = all_gather(values, pos, s.axis, values.shape[d] * s.axis.size)
        index = all_gather(index, pos, s.axis, index.shape[d] * s.axis.size)
    order = index.argsort(d)  # candidates in global order, so that the stable sort keeps the lowest index first
    values, index = values.gather(d, order), index.gather(d, order)
    best = values.sort(dim=d, descending=largest, stable=True).indices.narrow(d, 0, k)
    index = wrap(index.gather(d, best), layout_of(kept))
    return torch.take_along_dim(input, index, d), index


def topk(input, k, dim=-1, largest=True, sorted=True):
    meta_check(torch.topk, input, k, dim, largest, sorted)  # k out of range: torch's error
    x, layout = unwrap(input)
    if not split_shards(layout, negative_dim(dim, x.dim()))[0]:
        values, index = x.topk(k, dim, largest, sorted)
        return torch.return_types.topk((wrap(values, layout), wrap(index, layout)))
    return torch.return_types.topk(select(input, k, dim, largest))


def sort(input, dim=-1, descending=False, stable=False):
    meta_check(torch.sort, input, dim=dim, descending=descending, stable=stable)
    x, layout = unwrap(input)
    d = negative_dim(dim, x.dim())
    along, kept = split_shards(layout, d)
    full = gather(wrap(x, layout_of(along))) if along else x  # the whole dim, differentiable
    values, index = torch.sort(full, dim=d, descending=descending, stable=stable)
    return torch.return_types.sort((wrap(values, layout_of(kept)), wrap(index, layout_of(kept))))


def argsort(input, dim=-1, descending=False, stable=False):
    return sort(input, dim, descending, stable).indices


def _registrations() -> dict:
    handlers = {torch.topk: topk, torch.Tensor.topk: topk}
    for f in (torch.sort, torch.Tensor.sort):
        handlers[f] = sort
    for f in (torch.argsort, torch.Tensor.argsort):
        handlers[f] = argsort
    return handlers


HANDLERS = _registrations()

__all__ = ["HANDLERS", "select"]
