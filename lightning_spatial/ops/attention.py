"""Attention over sharded tokens, exact, without gathering the keys of cross-attention.

``F.scaled_dot_product_attention`` meets three layouts in a BEV model (``nn.MultiheadAttention`` and the
transformer layers reach it through torch's own ``multi_head_attention_forward``, run on the sharded tensors):

- **replicated queries, keys/values sharded along the key dim** (decoder cross-attention over camera tokens):
  each rank attends to its keys with a fused kernel (flash attention where it applies) that also returns the
  log-sum-exp ``lse_i`` of every query row; one all-reduce of the max and one of the rescaled outputs packed with
  their weights give ``lse = log sum_i exp(lse_i)`` and ``O = sum_i exp(lse_i - lse) O_i``. No rank ever holds all
  keys or a score matrix. The backward all-reduces the output gradient (the sum of its shares) and runs the local
  kernel backward with the *global* ``O`` and ``lse``: dk/dv are local, dq is this rank's share of the
  query gradient (the split convention: DDP sums the shares).
- **sharded queries, replicated keys**: local.
- **both sharded**: fewer queries than keys (BEV queries over camera tokens, without a mask, causality or
  dropout): the queries are all-gathered, then it is the replicated-queries case above with the merge per query
  owner: the max and the weights' sums are all-reduced (a number per query row), the rescaled outputs are
  reduce-scattered, so each rank receives its own queries' rows and never holds all outputs; the backward
  all-gathers the output and its gradient (the kernel's backward reads every query row). Otherwise
  (self-attention over camera tokens):
  keys and values, so every rank holds all of K/V (and the adjoint reduce-scatters their gradients), then it is
  the local case.

Dropout, a float mask that needs a gradient, empty attention (no query rows), or a device or dtype without a fused
kernel take torch's math
formula written on the sharded tensors: scores, softmax, dropout (its mask drawn for the global attention
matrix, as for every sharded dropout) and the value product dispatch to their own exact handlers.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F

from ..collectives import MAX, across_detached
from ..fallback import fallback
from ..layout import Layout
from ..tensor import SpatialTensor, adopt, gather, unwrap, wrap
from ._common import eager_backward, localize, moved_shards
from ._meta import meta_check
from .pending import reduced_into


def _along(layout: Layout | None, dim: int) -> bool:
    return layout is None or all(s.dim == dim for s in layout.shards)


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    args, kwargs = (query, key, value, attn_mask, dropout_p, is_causal), {"scale": scale, "enable_gqa": enable_gqa}
    meta_check(F.scaled_dot_product_attention, *args, **kwargs)  # torch's own argument errors, before any message
    lq, lk, lv = (unwrap(t)[1] for t in (query, key, value))
    if lk != lv or not (_along(lq, -2) and _along(lk, -2)) or lq is lk is None:
        return fallback(F.scaled_dot_product_attention, args, kwargs)
    if lq is not None and lk is not None:  # every query needs every key
        if attn_mask is None and not is_causal and dropout_p == 0 and query.shape[-2] < key.shape[-2]:
            return _queries_gathered(query, key, value, lq, lk, scale, enable_gqa)  # fewer queries: gather those
        key, value, lk = gather(key), gather(value), None  # gather K/V, keep 1/S of the queries
        if isinstance(attn_mask, SpatialTensor) and any(s.dim == -1 for s in attn_mask.shard_layout.shards):
            attn_mask = gather(attn_mask)
    return _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, owners: Layout | None = None):
    """Queries sharded or replicated, keys sharded or not. ``owners``: the layout of the (all-gathered) queries'
    owners, who receive the merged rows."""
    lq, lk = unwrap(query)[1], unwrap(key)[1]
    if is_causal:
        attn_mask = _causal(lq, lk, query.shape[-2], key.shape[-2], query.device)
    if enable_gqa:
        key, value = _repeat_heads(key, query.shape[-3]), _repeat_heads(value, query.shape[-3])
    q, k, v = (unwrap(t)[0] for t in (query, key, value))
    if autocast := _autocast_dtype(q):
        q, k, v = q.to(autocast), k.to(autocast), v.to(autocast)
    if lk is None:  # queries sharded (or replicated), all keys here: torch's own attention on our queries
        if dropout_p > 0:
            return _math(query, key, value, attn_mask, dropout_p, scale)
        return adopt(F.scaled_dot_product_attention(q, k, v, _local_mask(attn_mask, lq), scale=scale), lq)
    if dropout_p > 0 or (isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad):
        return _owned(_math(query, key, value, attn_mask, dropout_p, scale), owners)
    # the fused kernels want rows of unit stride: torch 2.11's CPU flash kernel reads strided ones wrongly, silently
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    bias, blind = _bias(_local_mask(attn_mask, Layout(moved_shards(lk.shards, -1))), q, k)
    if not _fused(q, k, v, bias):
        return _owned(_math(query, key, value, attn_mask, dropout_p, scale), owners)
    return adopt(_ShardedKeys.apply(q, k, v, bias, blind, scale, lk.shards, owners), owners)


def _queries_gathered(query, key, value, lq: Layout, lk: Layout, scale, enable_gqa: bool) -> torch.Tensor:
    """Both sharded, the queries the smaller (BEV queries over camera tokens): every rank attends with all queries to
    its own keys and the per-rank results merge by their log-sum-exp at each query's owner. No rank holds all keys;
    the query gradient's shares meet at their owners (all-gather's adjoint). Queries sharded over a mesh axis the
    keys are not sharded over are whole along it already: merged everywhere, each rank keeps its rows."""
    whole = gather(query)
    if not {s.axis.ranks for s in lq.shards} <= {s.axis.ranks for s in lk.shards}:
        return _owned(_attend(whole, key, value, None, 0.0, False, scale, enable_gqa), lq)
    return _attend(whole, key, value, None, 0.0, False, scale, enable_gqa, owners=lq)


def _owned(out: torch.Tensor, owners: Layout | None) -> torch.Tensor:
    """A merged result for all queries: the owners' rows of it."""
    return out if owners is None else wrap(owners.take_local(out), owners)


def _local_mask(mask, target: Layout | None) -> torch.Tensor | None:
    """This rank's part of a mask given for the global (queries, keys) matrix: sharded like the attention,
    replicated (full size or broadcast), or sharded otherwise (gathered first: a mask is small)."""
    local, layout = unwrap(mask)
    if layout is not None and layout == target:
        return local
    if layout is not None:
        local = gather(mask)
    return localize(F.scaled_dot_product_attention, local, target) if target is not None else local


def _causal(lq: Layout | None, lk: Layout | None, nq: int, nk: int, device) -> torch.Tensor:
    """torch's ``is_causal`` mask (query i sees keys j <= i), only this rank's rows and columns of it."""
    rows = lq.positions(-2, device) if lq else torch.arange(nq, device=device)
    cols = lk.positions(-2, device) if lk else torch.arange(nk, device=device)
    shards = (*(lq.shards if lq else ()), *moved_shards(lk.shards if lk else (), -1))
    return wrap(rows[:, None] >= cols[None, :], Layout(shards) if shards else None)


def _repeat_heads(t, heads: int):
    """``enable_gqa``: each key/value head serves ``heads // kv_heads`` query heads (the head dim is never sharded)."""
    local, layout = unwrap(t)
    return wrap(local.repeat_interleave(heads // local.shape[-3], -3), layout)


def _autocast_dtype(q: torch.Tensor) -> torch.dtype | None:
    return torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else None


def _math(query, key, value, mask, dropout_p: float, scale: float | None):
    """torch's math attention (``_scaled_dot_product_attention_math``) on the sharded tensors."""
    factor = math.sqrt(scale if scale is not None else 1 / math.sqrt(query.shape[-1]))
    scores = (query * factor) @ (key * factor).transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(mask.logical_not(), -math.inf) if mask.dtype == torch.bool else scores + mask
    blind = torch.isneginf(scores.detach().amax(-1, keepdim=True))  # rows that see no key: 0, as torch's safe softmax
    weights = scores.masked_fill(blind, 0).softmax(-1).masked_fill(blind, 0)
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p)
    return weights @ value


# -- replicated queries, sharded keys: fused kernels that return the log-sum-exp -------------------------


def _bias(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor):
    """The mask as the kernels take it: additive, in the query dtype; on CUDA expanded to 4-D with rows aligned
    to 16 elements, as torch's own SDPA prepares it for the memory-efficient kernel. Also the query rows that
    see none of this rank's keys (from the compact mask, before any expansion)."""
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(mask.logical_not(), -math.inf)
    mask = mask.to(q.dtype)
    blind = torch.isneginf(mask).all(-1)
    if q.is_cuda:
        mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        n = mask.shape[-1]
        if n % 16 or mask.stride(-1) != 1 or any(stride % 16 for stride in mask.stride()[:-1]):
            mask = F.pad(mask, (0, -n % 16))[..., :n]
    return mask, blind


def _fused(q, k, v, bias) -> bool:
    """Whether a fused kernel takes these shards. Not with no query rows (or any empty dim): the CPU flash kernel
    divides by their count (SIGFPE), and the math path is exact for empty attention as for any other."""
    if q.dim() != 4 or not q.is_floating_point() or q.numel() == 0 or k.numel() == 0:
        return False
    if q.is_cuda:
        params = torch.backends.cuda.SDPAParams(q, k, v, bias, 0.0, False, False)
        return torch.backends.cuda.can_use_efficient_attention(params)
    return q.device.type == "cpu"


def _kernel(q, k, v, bias, scale):
    """(this rank's output, its log-sum-exp per query row, the kernel: its name and its state for the backward).
    On CUDA the flash kernel where it takes the shards (fp16/bf16, no mask; torch's own choice unless turned off),
    else the memory-efficient one, whose backward is several times slower: on an H100, in bf16, PETR's six
    cross-attentions to a rank's camera tokens took 7.4 ms of backward and 1.7 ms of forward with it, and a rank of
    4 took 0.431x one device's step against 0.377x with flash attention (docs/benchmarks.md)."""
    if q.is_cuda and bias is None and _flash(q, k, v):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, False, False, scale=scale
        )
        return out, lse, ("flash", (max_q, max_k), (cum_q, cum_k, seed, offset))
    if q.is_cuda:
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, False, scale=scale
        )
        return out, lse, ("efficient", (), (seed, offset))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=bias, scale=scale
    )
    return out, lse, ("cpu", (), ())


def _flash(q, k, v) -> bool:
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
    return torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.can_use_flash_attention(params)


def _kernel_backward(kernel, grad, q, k, v, bias, out, lse, state, scale):
    name, sizes = kernel
    if name == "flash":
        cum_q, cum_k, seed, offset = state
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cum_q, cum_k, *sizes, 0.0, False, seed, offset, scale=scale
        )
    if name == "efficient":
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, bias, out, lse, *state, 0.0, [True, True, True, False], False, scale=scale
        )
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale
    )


class _ShardedKeys(torch.autograd.Function):
    """Replicated queries attend to this rank's keys; the per-rank results merge exactly by their log-sum-exp, on
    every rank, or (``owners``) reduce-scattered to the rank that holds each query row."""

    @staticmethod
    def forward(ctx, q, k, v, bias, blind, scale, shards, owners):
        out, lse, (name, sizes, state) = _kernel(q, k, v, bias, scale)
        rows = q.shape[-2]  # the memory-efficient kernel pads lse's query dim
        mine = lse[..., :rows]
        if blind is not None:  # a row that sees none of this rank's keys must weigh nothing
            mine = mine.masked_fill(blind, -math.inf)
        top = across_detached(mine, shards, MAX)
        top = top.masked_fill(torch.isneginf(top), 0)  # rows no rank sees: every weight is 0
        weight = torch.exp(mine - top).unsqueeze(-1)
        part = torch.where(weight > 0, out.to(weight.dtype) * weight, 0)
        if owners is None:
            total = across_detached(torch.cat([part, weight], -1), shards)
            part, den = total[..., :-1], total[..., -1]
        else:  # the weights' sums everywhere (the backward's lse), the outputs' only at their owners
            den = across_detached(weight[..., 0], shards)
            part = unwrap(reduced_into(part, [s.axis for s in shards], owners.shards))[0]
        lse = lse.clone()
        lse[..., :rows] = torch.where(den > 0, top + den.log(), 0)  # 0: the kernels' own value for a masked row
        den = den if owners is None else owners.take_local(den.unsqueeze(-1)).squeeze(-1)
        # in the kernel output's memory layout: the CUDA backward reads ``out`` with the strides it wrote it with
        merged = torch.empty_like(out if owners is None else part)  # den below: 0 or >= 1
        merged.copy_(part / den.clamp_min(1).unsqueeze(-1))
        ctx.save_for_backward(q, k, v, bias, merged, lse, *state)
        ctx.scale, ctx.shards, ctx.owners, ctx.strides, ctx.kernel = scale, shards, owners, out.stride(), (name, sizes)
        return merged

    @staticmethod
    @eager_backward
    def backward(ctx, grad):
        q, k, v, bias, out, lse, *state = ctx.saved_tensors
        if ctx.owners is None:
            grad = across_detached(grad, ctx.shards).contiguous()  # the sum of the output gradient's shares
        else:  # every query row's output and its (exact, owned) gradient
            grad = gather(wrap(grad, ctx.owners)).contiguous()
            whole = gather(wrap(out, ctx.owners))
            out = torch.empty_strided(whole.shape, ctx.strides, dtype=whole.dtype, device=whole.device).copy_(whole)
        dq, dk, dv = _kernel_backward(ctx.kernel, grad, q, k, v, bias, out, lse, state, ctx.scale)
        return dq, dk, dv, None, None, None, None, None


# -- nn.MultiheadAttention -----------------------------------------------------------------------------------


def _mha_body():
    """torch's own ``multi_head_attention_forward`` without its ``__torch_function__`` entry check.

    Run on the sharded tensors, its argument checks (the same errors as on one device, before any message),
    in-projections (``F.linear``: local on sharded tokens), head views, mask canonicalisation, and the attention
    (``F.scaled_dot_product_attention``, or scores, softmax, dropout and the weights' product when
    ``need_weights=True``) each dispatch to their spatial handlers. ``bias_k``/``add_zero_attn`` append a key
    along the sharded dim: ``torch.cat`` takes the exact (announced) fallback there.
    """
    f = F.multi_head_attention_forward
    scope = {**vars(F), "has_torch_function": lambda *_: False}
    body = types.FunctionType(f.__code__, scope, f.__name__, f.__defaults__, f.__closure__)
    body.__kwdefaults__ = f.__kwdefaults__
    return body


HANDLERS = {
    F.scaled_dot_product_attention: scaled_dot_product_attention,
    F.multi_head_attention_forward: _mha_body(),
}

__all__ = ["HANDLERS"]
