"""The data model of a sharded tensor and the arithmetic it needs: pure, no communication.

``Layout`` says which dims of a tensor are sharded over which mesh ``Axis``. Every sharded dim of global size
``n`` over ``parts`` ranks is split like ``torch.tensor_split``: the first ``n % parts`` ranks get one extra row.
Every op's *output* follows the same rule for its output size, so any chain of ops gathers to exactly the
single-device tensor. An op then only needs, per rank, the window ``[a, b)`` of its input's global dim that
produces that rank's output rows; ``halo.fetch_window`` moves it.

A dim may also be *merged*: camera tokens ``x.flatten(2)`` of a width-sharded ``(B, C, h, w)`` map hold, on
each rank, the tokens of its columns in single-device order. A ``DimShard`` then describes one sharded
*factor* of its dim (``outer`` and ``inner`` are the global sizes of the factors around it), so the global
token order stays what one device would have and a later ``view(B, C, h, w)`` finds the spatial layout again.

A token dim may hold several token sets one after another (*segments*: the levels of a feature pyramid
concatenated, ``torch.cat(levels, 1)``): each rank holds its tokens of every segment, segment after segment, and a
``DimShard`` lists its factor in each segment (``segments``). Splitting at the segments' borders gives each level
back (``split``); an op that needs one token set raises until then (``Layout.factors``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from .plans import planned

if TYPE_CHECKING:
    from .mesh import Axis


class LayoutError(ValueError):
    """Raised before any communication when tensors or arguments cannot be sharded as asked."""


@dataclass(frozen=True)
class DimShard:
    """A factor of global size ``size`` of tensor dim ``dim`` (negative) is split over ``axis``.

    A plain sharded dim is its own single factor. A merged dim (tokens) is ``outer x size x inner`` in
    row-major order, ``outer`` and ``inner`` being global sizes; only this factor is cut by this shard.
    """

    dim: int
    axis: Axis
    size: int
    outer: int = 1
    inner: int = 1
    segments: tuple[tuple[int, int, int], ...] = ()  # per token segment: this factor's (outer, size, inner)

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        if self.segments:
            raise LayoutError(_SEGMENTED.format(dim=self.dim, n=len(self.segments)))
        return partition(self.size, self.axis.size)

    @property
    def start(self) -> int:
        return self.bounds[self.axis.index][0]

    @property
    def stop(self) -> int:
        return self.bounds[self.axis.index][1]

    @property
    def extent(self) -> int:
        """The global size of the tensor dim."""
        if self.segments:
            return sum(o * n * i for o, n, i in self.segments)
        return self.outer * self.size * self.inner

    @property
    def merged(self) -> bool:
        return self.outer > 1 or self.inner > 1 or bool(self.segments)

    def segment(self, k: int) -> DimShard:
        """This factor in segment ``k``, as the shard of that token set alone."""
        outer, size, inner = self.segments[k]
        return DimShard(self.dim, self.axis, size, outer, inner)


_SEGMENTED = (
    "dim {dim} holds {n} token sets one after another (e.g. the levels of a feature pyramid concatenated); this op "
    "needs one: split them back (x.split(sizes, dim)) before it, or gather"
)


@dataclass(frozen=True)
class Layout:
    """Which dims of a tensor are sharded (negative dims), each factor over its own mesh axis.

    Hashed as a dataclass: with a cached ``__hash__`` of its own, torch 2.11's dynamo traced a compiled ConvNeXt into
    wrong aliases. ``plans`` holds the plans about this layout (``plans.planned(per_layout=True)``)."""

    shards: tuple[DimShard, ...]
    dims: tuple[int, ...] = field(init=False, repr=False, compare=False)  # the sharded dims, ascending
    plans: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shards = tuple(sorted(self.shards, key=lambda s: (s.dim, s.outer, s.segments)))  # the same on every rank
        if any(s.dim >= 0 for s in shards):
            raise LayoutError(f"sharded dims must be negative, got {[s.dim for s in shards]}")
        axes = [s.axis.ranks for s in shards]
        if len(set(axes)) != len(axes):
            raise LayoutError("two dims cannot be sharded over the same mesh axis")
        for dim in {s.dim for s in shards}:
            on = tuple(s for s in shards if s.dim == dim)
            if any(s.segments for s in on):  # every factor lists the same segments, and each segment's nest
                if len({len(s.segments) for s in on}) != 1 or not all(s.segments for s in on):
                    raise LayoutError(f"the factors of dim {dim} list different token segments: {on}")
                for k in range(len(on[0].segments)):
                    _factors(tuple(s.segment(k) for s in on))
            else:
                _factors(on)  # validates that the factors nest
        object.__setattr__(self, "shards", shards)
        object.__setattr__(self, "dims", tuple(sorted({s.dim for s in shards})))
        object.__setattr__(self, "plans", {})

    def __reduce__(self):  # pickled (DataLoader workers) without its plans: some are not picklable
        return Layout, (self.shards,)

    def get(self, dim: int) -> DimShard | None:
        """The shard of a plain (unmerged) sharded dim; ``None`` if ``dim`` is not sharded."""
        for s in self.shards:
            if s.dim == dim:
                return s
        return None

    def on(self, dim: int) -> tuple[DimShard, ...]:
        return tuple(s for s in self.shards if s.dim == dim)

    @property
    def merged(self) -> bool:
        return any(s.merged for s in self.shards)

    def factors(self, dim: int) -> tuple[tuple[int, DimShard | None], ...]:
        """The factors of a sharded dim in row-major order: ``(global size, shard or None)``; raises for a dim of
        several token segments (``segments``)."""
        return _factors(self.on(dim))

    def segments(self, dim: int) -> tuple[Layout, ...] | None:
        """Per token segment of ``dim``, the layout of that token set alone (its shards on ``dim``); ``None`` for a
        dim of one token set."""
        return _segments(self.on(dim))

    def global_shape(self, local: torch.Tensor | torch.Size) -> torch.Size:
        if isinstance(local, torch.Tensor):
            return _global_shape(self, local.shape)
        return _global_shape(self, local if isinstance(local, tuple) else tuple(local))  # a torch.Size is a tuple

    def cut_for(self, shape: torch.Size) -> Layout | None:
        """How a replicated tensor of ``shape`` is cut to this rank's part next to a tensor of this layout: size 1
        along a sharded dim broadcasts, the full global size is cut (the returned layout's shards); ``None``: nothing
        to cut. Anything else raises."""
        return _cut_for(self, shape)  # a torch.Size hashes and compares as the tuple of its sizes

    def local_shape(self, shape: Sequence[int]) -> list[int]:
        """This rank's sizes of a tensor of global ``shape`` with this layout."""
        shape = list(shape)
        for dim in self.dims:
            shape[dim] = sum(self.local_sizes(dim))
        return shape

    def local_sizes(self, dim: int) -> list[int]:
        """This rank's size of each token segment of sharded ``dim`` (one entry for a dim of one token set)."""
        return [
            math.prod([s.stop - s.start if s else n for n, s in p.factors(dim)]) for p in self.segments(dim) or (self,)
        ]

    def take_local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full (replicated) tensor: its rows of every sharded factor."""
        for dim in self.dims:
            parts = self.segments(dim)
            if parts is not None:  # each segment's part, one after another
                pieces = full.split([p.on(dim)[0].extent for p in parts], dim)
                full = torch.cat([p.take_local(piece) for p, piece in zip(parts, pieces)], dim)
                continue
            factors = self.factors(dim)
            if len(factors) == 1:
                s = factors[0][1]
                full = full.narrow(dim, s.start, s.stop - s.start)
                continue
            pos = full.dim() + dim
            split = full.unflatten(pos, [n for n, _ in factors])
            for k, (_, s) in enumerate(factors):
                if s is not None:
                    split = split.narrow(pos + k, s.start, s.stop - s.start)
            full = split.flatten(pos, pos + len(factors) - 1)
        return full

    def local_slices(self, ndim: int) -> tuple[slice, ...]:
        """Basic-indexing slices of this rank's part (plain sharded dims only; see ``take_local``)."""
        if self.merged:
            raise LayoutError(f"layout [{self.describe()}] has merged (token) dims: use take_local")
        index = [slice(None)] * ndim
        for s in self.shards:
            index[s.dim] = slice(s.start, s.stop)
        return tuple(index)

    def with_sizes(self, sizes: Mapping[int, int | None]) -> Layout | None:
        """Same axes with new global sizes of plain dims; a size of ``None`` drops that dim's sharding."""
        return _with_sizes(self, tuple(sizes.items()))

    def moved(self, dims: Mapping[int, int]) -> Layout | None:
        """The same shards on other tensor dims (``old -> new``); dims missing from ``dims`` are dropped."""
        shards = tuple(replace(s, dim=dims[s.dim]) for s in self.shards if s.dim in dims)
        return Layout(shards) if shards else None

    def positions(self, dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global indices along ``dim`` of this rank's entries, in local order (a merged dim's tokens too)."""
        return _positions(self.on(dim), torch.device(device))

    def owners(self, dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """This rank's local position of every global index along ``dim``; ``-1`` where another rank holds it."""
        return _owners(self.on(dim), torch.device(device))

    def describe(self) -> str:
        def one(s: DimShard) -> str:
            if s.segments:
                sets = " + ".join(f"{o}x[{n}]x{i}" for o, n, i in s.segments)
                return f"dim {s.dim} of {sets} tokens (over {s.axis.size} ranks {s.axis.ranks})"
            merged = f" of {s.outer}x[{s.size}]x{s.inner} tokens" if s.merged else ""
            return f"dim {s.dim}{merged} ({s.size} over {s.axis.size} ranks {s.axis.ranks})"

        return ", ".join(one(s) for s in self.shards)


@planned(per_layout=True, maxsize=256)
def _global_shape(layout: Layout, local: tuple[int, ...]) -> torch.Size:
    shape = list(local)
    for s in layout.shards:
        shape[s.dim] = s.extent
    return torch.Size(shape)


@planned(per_layout=True, maxsize=256)
def _cut_for(layout: Layout, shape: tuple[int, ...]) -> Layout | None:
    cut = []
    for dim in layout.dims:
        if len(shape) < -dim or shape[dim] == 1:
            continue
        shards = layout.on(dim)
        if shape[dim] != shards[0].extent:
            raise LayoutError(
                f"a replicated tensor of shape {tuple(shape)} meets a tensor sharded along dim {dim} of global "
                f"size {shards[0].extent}; it must have size 1 (broadcast) or {shards[0].extent} there"
            )
        cut.extend(shards)
    return Layout(tuple(cut)) if cut else None


@planned
def _segments(shards: tuple[DimShard, ...]) -> tuple[Layout, ...] | None:
    if not shards or not shards[0].segments:
        return None
    return tuple(Layout(tuple(s.segment(k) for s in shards)) for k in range(len(shards[0].segments)))


@planned
def _factors(shards: tuple[DimShard, ...]) -> tuple[tuple[int, DimShard | None], ...]:
    if shards and shards[0].segments:
        raise LayoutError(_SEGMENTED.format(dim=shards[0].dim, n=len(shards[0].segments)))
    extent, out, done = shards[0].extent, [], 1
    for s in sorted(shards, key=lambda s: s.outer):
        if s.extent != extent or s.outer % done:
            raise LayoutError(f"sharded factors of dim {s.dim} do not nest: {shards}")
        if s.outer > done:
            out.append((s.outer // done, None))
        out.append((s.size, s))
        done = s.outer * s.size
    if extent % done:
        raise LayoutError(f"sharded factors of dim {shards[0].dim} do not nest: {shards}")
    if extent > done:
        out.append((extent // done, None))
    return tuple(out)


@planned(maxsize=256)
def _positions(shards: tuple[DimShard, ...], device: torch.device) -> torch.Tensor:
    if not shards:
        raise LayoutError("positions: the dim is not sharded")
    along_one_dim = Layout(tuple(replace(s, dim=-1) for s in shards))
    return along_one_dim.take_local(torch.arange(shards[0].extent, device=device))


@planned(maxsize=256)
def _owners(shards: tuple[DimShard, ...], device: torch.device) -> torch.Tensor:
    mine = _positions(shards, device)
    table = torch.full((shards[0].extent,), -1, dtype=torch.long, device=device)
    return table.index_copy_(0, mine, torch.arange(len(mine), device=device))


@planned
def _with_sizes(layout: Layout, sizes: tuple[tuple[int, int | None], ...]) -> Layout | None:
    """``Layout.with_sizes``, built once per layout and sizes: ops call it every step."""
    new = dict(sizes)
    for s in layout.shards:
        if s.segments and new.get(s.dim) is not None:
            raise LayoutError(_SEGMENTED.format(dim=s.dim, n=len(s.segments)))
    shards = [replace(s, size=new.get(s.dim, s.size)) for s in layout.shards if new.get(s.dim, 0) is not None]
    return Layout(tuple(shards)) if shards else None


PAD_MODES = ("zeros", "constant", "reflect", "replicate", "circular")


@planned
def partition(n: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` of every rank's rows when ``n`` rows are split over ``parts`` ranks."""
    base, extra = n // parts, n % parts  # not divmod: dynamo traces this
    bounds, start = [], 0
    for r in range(parts):
        stop = start + base + (r < extra)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def conv_out_size(n: int, kernel: int, stride: int, pad_lo: int, pad_hi: int, dilation: int = 1) -> int:
    return (n + pad_lo + pad_hi - dilation * (kernel - 1) - 1) // stride + 1


def pool_out_size(n: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool) -> int:
    """Output length of torch's pooling, ceil_mode included (a window may not start in the right padding)."""
    span = n + 2 * padding - dilation * (kernel - 1) - 1
    out = (span + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= n + padding:
        out -= 1
    return out


def conv_window(lo: int, hi: int, kernel: int, stride: int, pad_lo: int, dilation: int = 1) -> tuple[int, int]:
    """Input rows ``[a, b)`` (global, may lie outside ``[0, n)``) that produce output rows ``[lo, hi)``."""
    return lo * stride - pad_lo, (hi - 1) * stride - pad_lo + dilation * (kernel - 1) + 1


def transposed_window(lo: int, hi: int, kernel: int, stride: int, padding: int, dilation: int = 1) -> tuple[int, int]:
    """Input rows ``[a, b)`` whose transposed conv (padding 0) covers output rows ``[lo, hi)``.

    Input row ``i`` writes output rows ``i*stride - padding + j*dilation``. The window starts at the first
    input that can reach ``lo`` (so the local result starts at or before ``lo``) and is long enough that the
    local result reaches ``hi``; extra rows only write outside ``[lo, hi)`` and are cut off by the caller.
    """
    reach = dilation * (kernel - 1)
    a = (lo + padding - reach) // stride
    b = max((hi - 1 + padding) // stride + 1, 1 + ceil_div(hi + padding - reach - 1, stride))
    return a, max(b, a + 1)


def adaptive_bins(n: int, m: int) -> tuple[tuple[int, int], ...]:
    """torch's adaptive pooling bins: bin ``i`` reads ``[floor(i*n/m), ceil((i+1)*n/m))``."""
    return tuple(((i * n) // m, -(-((i + 1) * n) // m)) for i in range(m))


def source_index(pos: int, n: int, mode: str) -> int:
    """Global row that window position ``pos`` reads under a padding mode; ``-1`` means the fill value."""
    if 0 <= pos < n:
        return pos
    if mode in ("zeros", "constant"):
        return -1
    if mode == "replicate":
        return min(max(pos, 0), n - 1)
    if mode == "circular":
        return pos % n
    if mode == "reflect":
        return -pos if pos < 0 else 2 * (n - 1) - pos
    raise ValueError(f"unknown padding mode {mode!r}; expected one of {PAD_MODES}")


def check_padding(n: int, pad_lo: int, pad_hi: int, mode: str, where: str) -> None:
    """Raise torch's own limits on reflect/circular padding before any rank communicates."""
    if mode == "reflect" and max(pad_lo, pad_hi) >= n:
        raise ValueError(f"{where}: reflect padding ({pad_lo}, {pad_hi}) must be smaller than the dim size {n}")
    if mode == "circular" and max(pad_lo, pad_hi) > n:
        raise ValueError(f"{where}: circular padding ({pad_lo}, {pad_hi}) must be at most the dim size {n}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "PAD_MODES",
    "DimShard",
    "Layout",
    "LayoutError",
    "adaptive_bins",
    "ceil_div",
    "check_padding",
    "conv_out_size",
    "conv_window",
    "partition",
    "pool_out_size",
    "source_index",
    "transposed_window",
]
