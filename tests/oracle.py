"""One numerical oracle for every spatial op: sharded vs single-process, outputs and all gradients."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from lightning_spatial import SpatialTensor, gather, shard
from lightning_spatial.ops.selection import Selection
from lightning_spatial.primitives import wrap
from lightning_spatial.run import Run, entered

RTOL = 1e-5  # fp32 (and lower precisions)
# float64: whole timm models agree to 3.5e-13 at worst (EfficientNet-B0's SE bias gradients), 1e-14 typically
RTOL_FLOAT64 = 1e-11


def assert_rel_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    what: str,
    scale: torch.Tensor | None = None,
    rtol: float | None = None,
) -> None:
    """Relative tolerance by dtype: max |actual - expected| <= rtol * scale, ``RTOL`` for fp32, ``RTOL_FLOAT64``
    for float64 unless ``rtol`` is given (exact for integers); ``scale`` defaults to max |expected|."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:  # empty (no query rows): the shape is the whole answer
        return
    if not expected.is_floating_point():
        assert torch.equal(actual, expected), f"{what}: integer results differ"
        return
    rtol = rtol or (RTOL_FLOAT64 if expected.dtype == torch.float64 else RTOL)
    scale = (expected.abs().max() if scale is None else scale).clamp_min(torch.finfo(expected.dtype).tiny)
    err = (actual - expected).abs().max()
    assert err <= rtol * scale, f"{what}: max abs error {err:.3e} > {rtol} * {scale:.3e}"


def check(
    op: Callable,
    inputs: Sequence[torch.Tensor],
    sharded: Sequence[int],
    axes: dict,
    seed: int = 0,
    allow_fallback: bool = False,
    modules: tuple[torch.nn.Module, torch.nn.Module] | None = None,
    rtol: float | None = None,
    bev_shard: str | None = None,
) -> None:
    """Compare ``op`` on shards of ``inputs[i]`` (i in ``sharded``) with ``op`` on the full tensors.

    Every rank builds the same full inputs and upstream gradients (same seed). Sharded inputs' gradients
    are compared slice by slice; replicated inputs' gradients (weights) are summed over the group, the
    split-gradient convention the strategy relies on. Unless ``allow_fallback``, the op must run through
    spatial handlers: an exact gather-and-run fallback would hide a missing or misregistered handler.
    ``modules=(reference, ours)``, the modules ``op`` runs on full tensors and on shards: every parameter's
    gradient (summed over the group) and every buffer after the call (BatchNorm statistics) are compared too.
    ``rtol`` replaces the dtype's tolerance, for a model whose reference is itself noisier (say by how much).
    ``bev_shard``: the run's ``Run.bev_shard`` (sums into a BEV grid end sharded).
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
    # A run of its own: fallbacks are errors (an exact gather-and-run would hide a missing handler) unless allowed,
    # then they warn, each once in this call. It spans the backward too, as a strategy's run does: a checkpoint
    # computes its forward again there.
    run = Run(fallback="warn" if allow_fallback else "error", bev_shard=bev_shard)
    with entered(run):
        out = op(*ours)
    outs = out if isinstance(out, tuple) else (out,)
    assert len(outs) == len(ref_outs)

    upstream = torch.Generator().manual_seed(2**31 - 1 - seed)  # independent of the inputs' stream
    world = dist.get_world_size()
    loss, ref_loss = 0.0, 0.0
    for k, (o, r) in enumerate(zip(outs, ref_outs)):
        assert_rel_close(gather(o).detach(), r.detach(), f"output {k}", rtol=rtol)
        if not r.requires_grad:  # indices, counts, histograms: nothing to differentiate
            continue
        g = torch.randn(r.shape, generator=upstream, dtype=r.dtype)
        ref_loss = ref_loss + (r * g).sum()
        if isinstance(o, Selection):  # rows of a boolean-mask selection: each rank weighs its own
            copies = world // torch.Size([a.size for a in o.axes]).numel()
            loss = loss + (o.to_local() * g[o.positions]).sum() / copies
        elif isinstance(o, SpatialTensor):
            layout = o.shard_layout
            copies = world // torch.Size([s.axis.size for s in layout.shards]).numel()
            loss = loss + (o.to_local() * layout.take_local(g)).sum() / copies
        else:
            loss = loss + (o * g).sum() / world
    if modules is not None:
        _compare_buffers(*modules, rtol)
    if not isinstance(ref_loss, torch.Tensor):  # no differentiable output
        return
    ref_loss.backward()
    with entered(run):
        loss.backward()
    if modules is not None:
        _compare_parameter_grads(*modules, rtol)
    for i, local, layout in leaves:
        expected = ref_inputs[i].grad
        if expected is None:
            continue
        if layout is not None:
            assert_rel_close(local.grad, layout.take_local(expected), f"grad of input {i}", rtol=rtol)
        else:
            total = local.grad.clone()
            dist.all_reduce(total)
            assert_rel_close(total, expected, f"grad of input {i} (summed over ranks)", rtol=rtol)


def _compare_buffers(reference: torch.nn.Module, ours: torch.nn.Module, rtol: float | None) -> None:
    for (path, module), mine in zip(reference.named_modules(), ours.modules(), strict=True):
        expected = dict(module.named_buffers(recurse=False))
        for name, actual in mine.named_buffers(recurse=False):
            # A running mean averages activations: its rounding error scales with their spread (running_var),
            # not with the mean, which is ~1e-17 behind a zero-mean layer (a 1x1 conv of BatchNorm output).
            spread = expected.get("running_var") if name == "running_mean" else None
            scale = None if spread is None else spread.max().sqrt()
            assert_rel_close(actual, expected[name], f"buffer {path}.{name}", scale, rtol)


def _compare_parameter_grads(reference: torch.nn.Module, ours: torch.nn.Module, rtol: float | None) -> None:
    for (path, module), mine in zip(reference.named_modules(), ours.modules(), strict=True):
        expected = {name: p.grad for name, p in module.named_parameters(recurse=False)}
        # Rounding in a parameter's gradient scales with its module's largest one: a BatchNorm bias whose true
        # gradient is exactly zero (the next layer is conv + BatchNorm) holds rounding noise of its weight's size.
        scale = max((g.abs().max() for g in expected.values() if g is not None), default=None)
        for name, p in mine.named_parameters(recurse=False):
            what = f"grad of parameter {path}.{name} (summed over ranks)"
            assert (expected[name] is None) == (p.grad is None), f"{what}: missing on one side"
            if p.grad is not None:
                total = p.grad.clone()
                dist.all_reduce(total)
                assert_rel_close(total, expected[name], what, scale, rtol)
