"""Partition rule and window arithmetic: pure functions, no communication.

Every sharded dim of global size ``n`` over ``parts`` ranks is split like ``torch.tensor_split``: the first
``n % parts`` ranks get one extra row. Every op's *output* follows the same rule for its output size, so any
chain of ops gathers to exactly the single-device tensor. An op then only needs, per rank, the window
``[a, b)`` of its input's global dim that produces that rank's output rows; ``halo.fetch_window`` moves it.
"""

from __future__ import annotations

from functools import lru_cache

PAD_MODES = ("zeros", "constant", "reflect", "replicate", "circular")


@lru_cache(maxsize=4096)
def partition(n: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` of every rank's rows when ``n`` rows are split over ``parts`` ranks."""
    base, extra = divmod(n, parts)
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
