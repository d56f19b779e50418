"""One numerical oracle for every spatial op: sharded vs single-process, outputs and all gradients."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from lightning_spatial import SpatialTensor, gather, shard
from lightning_spatial.tensor import _warned, wrap

RTOL = 1e-5


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    """Relative tolerance (fp32's by default): max |actual - expected| <= rtol * max |expected| (exact for integers)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), f"{what}: integer results differ"
        return
    scale = expected.abs().max().clamp_min(torch.finfo(expected.dtype).tiny)
    err = (actual - expected).abs().max()
    assert err <= rtol * scale, f"{what}: max abs error {err:.3e} > {rtol} * {scale:.3e}"


def check(
    op: Callable,
    inputs: Sequence[torch.Tensor],
    sharded: Sequence[int],
    axes: dict,
    seed: int = 0,
    allow_fallback: bool = False,
    rtol: float = RTOL,
) -> None:
    """Compare ``op`` on shards of ``inputs[i]`` (i in ``sharded``) with ``op`` on the full tensors.

    Every rank builds the same full inputs and upstream gradients (same seed). Sharded inputs' gradients
    are compared slice by slice; replicated inputs' gradients (weights) are summed over the group, the
    split-gradient convention the strategy relies on. Unless ``allow_fallback``, the op must run through
    spatial handlers: an exact gather-and-run fallback would hide a missing or misregistered handler.
    ``rtol`` is fp32's; float64 tests pass a float64 tolerance.
    """
    ref_inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    ref_out = op(*ref_inputs)
    ref_outs = ref_out if isinstance(ref_out, tuple) else (ref_out,)

    ours, leaves = [], []
    for i, t in enumerate(inputs):
        if i in sharded:
            s = shard(t.detach(), axes)
            local = s.to_local().clone().requires_grad_(t.is_floating_point())
            leaves.append((i, local, s.shard_layout))
            ours.append(wrap(local, s.shard_layout))
        else:
            local = t.detach().clone().requires_grad_(t.is_floating_point())
            leaves.append((i, local, None))
            ours.append(local)
    _warned.clear()  # each fallback warns once per process: make this call's fallbacks visible
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = op(*ours)
    fallbacks = [str(w.message) for w in caught if "no spatial handler" in str(w.message)]
    assert allow_fallback or not fallbacks, f"op fell back instead of running spatially: {fallbacks}"
    for w in caught:  # pass them on to the caller
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    outs = out if isinstance(out, tuple) else (out,)
    assert len(outs) == len(ref_outs)

    upstream = torch.Generator().manual_seed(2**31 - 1 - seed)  # independent of the inputs' stream
    world = dist.get_world_size()
    loss, ref_loss = 0.0, 0.0
    for k, (o, r) in enumerate(zip(outs, ref_outs)):
        assert_rel_close(gather(o).detach(), r.detach(), f"output {k}", rtol)
        if not r.requires_grad:  # indices, counts, histograms: nothing to differentiate
            continue
        g = torch.randn(r.shape, generator=upstream, dtype=r.dtype)
        ref_loss = ref_loss + (r * g).sum()
        if isinstance(o, SpatialTensor):
            layout = o.shard_layout
            copies = world // torch.Size([s.axis.size for s in layout.shards]).numel()
            loss = loss + (o.to_local() * layout.take_local(g)).sum() / copies
        else:
            loss = loss + (o * g).sum() / world
    if not isinstance(ref_loss, torch.Tensor):  # no differentiable output
        return
    ref_loss.backward()
    loss.backward()
    for i, local, layout in leaves:
        expected = ref_inputs[i].grad
        if expected is None:
            continue
        if layout is not None:
            assert_rel_close(local.grad, layout.take_local(expected), f"grad of input {i}", rtol)
        else:
            total = local.grad.clone()
            dist.all_reduce(total)
            assert_rel_close(total, expected, f"grad of input {i} (summed over ranks)", rtol)
