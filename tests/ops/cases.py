"""Many oracle cases per forked group of ranks: a fork per case would dominate the run time."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import torch

from tests.oracle import RTOL, check
from tests.spmd import axes

DTYPES = {"fp32": (torch.float32, RTOL), "fp64": (torch.float64, 1e-12)}

# name -> (inputs for a layout name, op, indices of the inputs to shard)
Cases = dict[str, tuple[Callable[[str], Sequence[torch.Tensor]], Callable, Sequence[int]]]


def check_cases(layout: str, dtype: str, cases: Cases) -> None:
    """``tests.oracle.check`` every case on this group, floating inputs in ``dtype``; names the failing case."""
    dtype, rtol = DTYPES[dtype]
    mesh_axes = axes(layout)
    for name, (make, op, sharded) in cases.items():
        torch.manual_seed(zlib.crc32(name.encode()))
        inputs = [t.to(dtype) if t.is_floating_point() else t for t in make(layout)]
        try:
            check(op, inputs, sharded, mesh_axes, rtol=rtol)
        except AssertionError as e:
            raise AssertionError(f"case {name!r} on {layout}: {e}") from None
