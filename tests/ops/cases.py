"""Many oracle cases per forked group of ranks: a fork per case would dominate the run time."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.distributed as dist

from lightning_spatial import shard
from tests.oracle import check
from tests.spmd import axes

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}  # the oracle's tolerance follows the dtype

# name -> (inputs for a layout name, op, indices of the inputs to shard)
Cases = dict[str, tuple[Callable[[str], Sequence[torch.Tensor]], Callable, Sequence[int]]]


def check_cases(layout: str, dtype: str, cases: Cases) -> None:
    """``tests.oracle.check`` every case on this group, floating inputs in ``dtype``; names the failing case."""
    dtype = DTYPES[dtype]
    mesh_axes = axes(layout)
    for name, (make, op, sharded) in cases.items():
        torch.manual_seed(zlib.crc32(name.encode()))
        inputs = [t.to(dtype) if t.is_floating_point() else t for t in make(layout)]
        try:
            check(op, inputs, sharded, mesh_axes)
        except AssertionError as e:
            raise AssertionError(f"case {name!r} on {layout}: {e}") from None


def _meta_message(op: Callable, inputs: Sequence[torch.Tensor]) -> str | None:
    """What ``op`` raises on meta tensors of the inputs' shapes (where our ops learn torch's error)."""
    try:
        op(*(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in inputs))
    except Exception as err:  # noqa: BLE001 - any error is torch's answer
        return str(err)
    return None


def raises_like_one_device(
    layout: str, op: Callable, inputs: Sequence[torch.Tensor], sharded: Sequence[int], message=True
):
    """Only rank 0 calls ``op`` on shards of ``inputs``: it must raise what ``op`` raises on the full tensors on
    one process (type, and message unless ``message=False``) before any communication; the other ranks wait at
    a barrier, so an op that communicated first would hang (the harness reports the time-out)."""
    mesh_axes = axes(layout)  # building process groups is itself collective: every rank does it
    if dist.get_rank() == 0:
        with pytest.raises(Exception) as one_device:
            op(*inputs)
        ours = [shard(t, mesh_axes) if i in sharded else t for i, t in enumerate(inputs)]
        with pytest.raises(type(one_device.value)) as spatial:
            op(*ours)
        if message:  # torch's message for this call: from the CPU kernel, or (torch 2.11) the meta kernel's wording
            said = {str(one_device.value), _meta_message(op, inputs)}
            assert str(spatial.value) in said, (str(spatial.value), said)
    dist.barrier()
