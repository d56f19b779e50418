"""``F.pad`` on sharded dims, every mode: the padded output follows the partition rule again, so each
rank fetches the window of its output rows; only border rows read padding (circular reads the far border,
reflect and replicate their own edge). Negative pads (crops) are the same window arithmetic."""

from __future__ import annotations

import torch.nn.functional as F

from ..layout import check_padding
from ..tensor import unwrap, wrap
from ._binding import bound
from ._common import Windows, output_layout, output_sizes

_MODES = {"constant": "zeros", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}


def pad(input, pad, mode="constant", value=None):
    x, layout = unwrap(input)
    if mode not in _MODES:
        raise ValueError(f"pad: unsupported padding mode {mode!r}; expected one of {sorted(_MODES)}")
    nd = len(pad) // 2  # pad lists (lo, hi) pairs starting from the last dim
    shards = {s.dim + nd: s for s in layout.shards if s.dim + nd >= 0}  # sharded dims beyond the pad list stay
    lo = {nd - 1 - k: pad[2 * k] for k in range(nd)}
    hi = {nd - 1 - k: pad[2 * k + 1] for k in range(nd)}
    for i, s in shards.items():
        check_padding(s.size, lo[i], hi[i], mode, f"pad (dim {s.dim})")
    out_sizes = output_sizes("pad", shards, lambda i, s: s.size + lo[i] + hi[i])
    x = Windows.plan(shards, out_sizes, lambda i, a, b: (a - lo[i], b - lo[i])).fetch(x, _MODES[mode], value or 0.0)
    local = [0 if (nd - 1 - k) in shards else p for k in range(nd) for p in (pad[2 * k], pad[2 * k + 1])]
    if any(local):
        x = F.pad(x, local, mode=mode, value=value)
    return wrap(x, output_layout(layout, shards, out_sizes))


HANDLERS = bound(pad, F.pad)

__all__ = ["HANDLERS"]
