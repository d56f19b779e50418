"""Attention over camera tokens of sharded feature maps: SDPA, hand-written attention, nn.MultiheadAttention,
nn.TransformerDecoderLayer, against one process (outputs and every gradient, weights included)."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from lightning_spatial import SpatialTensor, shard
from tests.ops.cases import DTYPES, check_cases, raises_like_one_device
from tests.oracle import assert_rel_close, check
from tests.spmd import LAYOUTS, axes, run_spmd

B, HEADS, E, LQ, H = 2, 2, 4, 6, 5
C = HEADS * E


def _w(layout: str) -> int:
    return 19 if layout == "w3" else 8  # w3: uneven widths 7, 6, 6


def tokens(fmap: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h*w, C): tokens in single-device order, sharded like the map."""
    return fmap.flatten(2).transpose(1, 2)


def heads(t: torch.Tensor, n: int = HEADS) -> torch.Tensor:
    return t.unflatten(-1, (n, -1)).transpose(1, 2)  # (B, L, n*E) -> (B, n, L, E)


def kv(fmap):
    k, v = tokens(fmap).chunk(2, -1)
    return heads(k), heads(v)


def _maps(layout, channels=2 * C):
    return torch.randn(B, channels, H, _w(layout))


def _q():
    return torch.randn(B, HEADS, LQ, E)


def _padding(layout):
    """Key padding as a (B, h, w) map: batch 0 masks the left half of the image, so some rank sees no key."""
    keep = torch.rand(B, H, _w(layout)) > 0.3
    keep[0, :, : _w(layout) // 2 + 1] = False
    return keep


SDPA = {
    "sdpa": (lambda lay: [_q(), _maps(lay)], lambda q, m: F.scaled_dot_product_attention(q, *kv(m)), [1]),
    # queries from a smaller map, sharded like the keys (BEV queries over camera tokens): the queries are gathered
    "sdpa_fewer_sharded_queries": (
        lambda lay: [torch.randn(B, C, 3, _w(lay)), _maps(lay)],
        lambda qm, m: F.scaled_dot_product_attention(heads(tokens(qm)), *kv(m)),
        [0, 1],
    ),
    "sdpa_sharded_bool_mask": (
        lambda lay: [_q(), _maps(lay), _padding(lay)],
        lambda q, m, keep: F.scaled_dot_product_attention(q, *kv(m), attn_mask=keep.flatten(1)[:, None, None]),
        [1, 2],
    ),
    "sdpa_replicated_bool_mask_with_blind_row": (
        lambda lay: [_q(), _maps(lay), torch.rand(LQ, H * _w(lay)) > 0.5],
        lambda q, m, keep: F.scaled_dot_product_attention(q, *kv(m), attn_mask=keep.index_fill(0, torch.tensor(1), 0)),
        [1],
    ),
    "sdpa_float_mask": (
        lambda lay: [_q(), _maps(lay), torch.randn(B, 1, LQ, H * _w(lay))],
        lambda q, m, bias: F.scaled_dot_product_attention(q, *kv(m), attn_mask=bias.detach()),
        [1],
    ),
    "sdpa_float_mask_with_gradient": (  # the math path, the mask's gradient checked
        lambda lay: [_q(), _maps(lay), torch.randn(LQ, H * _w(lay))],
        lambda q, m, bias: F.scaled_dot_product_attention(
            q, *kv(m), attn_mask=bias.index_fill(0, torch.tensor(1), -math.inf)
        ),
        [1],
    ),
    "sdpa_no_queries": (  # the fused kernels divide by the query rows: empty attention, as on one device
        lambda lay: [torch.randn(B, HEADS, 0, E), _maps(lay), _padding(lay)],
        lambda q, m, keep: F.scaled_dot_product_attention(q, *kv(m), attn_mask=keep.flatten(1)[:, None, None]),
        [1, 2],
    ),
    "sdpa_causal_scale_gqa": (
        lambda lay: [_q(), _maps(lay, 2 * E)],
        lambda q, m: F.scaled_dot_product_attention(
            q, *(heads(t, 1) for t in tokens(m).chunk(2, -1)), is_causal=True, scale=0.3, enable_gqa=True
        ),
        [1],
    ),
    "sdpa_dropout": (
        lambda lay: [_q(), _maps(lay)],
        lambda q, m: (torch.manual_seed(3), F.scaled_dot_product_attention(q, *kv(m), dropout_p=0.3))[1],
        [1],
    ),
    "queries_sharded_keys_replicated": (
        lambda lay: [_maps(lay, C), torch.randn(B, HEADS, 7, E), torch.randn(B, HEADS, 7, E), torch.randn(1, 7)],
        lambda m, k, v, bias: F.scaled_dot_product_attention(heads(tokens(m)), k, v, attn_mask=bias.detach()),
        [0],
    ),
    "self_attention_both_sharded": (
        lambda lay: [_maps(lay, 3 * C), _padding(lay)],
        lambda m, keep: F.scaled_dot_product_attention(
            *(heads(t) for t in tokens(m).chunk(3, -1)), attn_mask=keep.flatten(1)[:, None, None]
        ),
        [0, 1],
    ),
    "self_attention_causal_dropout": (
        lambda lay: [_maps(lay, 3 * C)],
        lambda m: (
            torch.manual_seed(4),
            F.scaled_dot_product_attention(*(heads(t) for t in tokens(m).chunk(3, -1)), is_causal=True, dropout_p=0.2),
        )[1],
        [0],
    ),
    "hand_written": (
        lambda lay: [_q(), _maps(lay)],
        lambda q, m: (lambda k, v: (q @ k.mT * E**-0.5).softmax(-1) @ v)(*kv(m)),
        [1],
    ),
}


def _mha_case(make_module, call):
    """A module case: its parameters are oracle inputs too, so that their gradients are checked."""
    module = make_module()
    names = [n for n, _ in module.named_parameters()]

    def make(layout):
        return [*(p.detach().clone() for _, p in module.named_parameters()), *call[0](layout)]

    def op(*args):
        return call[1](lambda *a, **k: functional_call(module, dict(zip(names, args)), a, k), *args[len(names) :])

    return make, op, [len(names) + i for i in call[2]]


def _mha(**kw):
    return lambda: torch.nn.MultiheadAttention(C, HEADS, **kw)


def _seq_first(t):
    return t.transpose(0, 1)


MODULES = {
    "mha_batch_first": (
        _mha(batch_first=True),
        (
            lambda lay: [torch.randn(B, LQ, C), _maps(lay, C)],
            lambda f, q, m: f(q, tokens(m), tokens(m), need_weights=False)[0],
            [1],
        ),
    ),
    "mha_no_queries": (  # PETR with num_queries=0: cross-attention from an empty query set
        _mha(batch_first=True),
        (
            lambda lay: [torch.randn(B, 0, C), _maps(lay, C)],
            lambda f, q, m: f(q, tokens(m), tokens(m), need_weights=False)[0],
            [1],
        ),
    ),
    "mha_weights_averaged": (
        _mha(batch_first=True),
        (lambda lay: [torch.randn(B, LQ, C), _maps(lay, C)], lambda f, q, m: f(q, tokens(m), tokens(m)), [1]),
    ),
    "mha_seq_first_masks_sharded_and_replicated": (
        _mha(),
        (
            lambda lay: [torch.randn(LQ, B, C), _maps(lay, 2 * C), _padding(lay), torch.rand(LQ, H * _w(lay)) > 0.8],
            lambda f, q, m, pad, block: f(
                q,
                *(_seq_first(t) for t in tokens(m).chunk(2, -1)),
                key_padding_mask=~pad.flatten(1),
                attn_mask=block,
                need_weights=False,
            )[0],
            [1, 2],
        ),
    ),
    "mha_per_head_weights_float_masks": (
        _mha(batch_first=True),
        (
            lambda lay: [
                torch.randn(B, LQ, C),
                _maps(lay, C),
                torch.randn(B, H * _w(lay)),
                torch.randn(B * HEADS, LQ, H * _w(lay)),
            ],
            lambda f, q, m, pad, bias: f(
                q,
                tokens(m),
                tokens(m),
                key_padding_mask=pad.detach(),
                attn_mask=bias.detach(),
                average_attn_weights=False,
            ),
            [1],
        ),
    ),
    "mha_sharded_attn_mask_weights": (
        _mha(batch_first=True),
        (
            lambda lay: [torch.randn(B, LQ, C), _maps(lay, C), torch.rand(LQ, H, _w(lay)) > 0.8],
            lambda f, q, m, block: f(q, tokens(m), tokens(m), attn_mask=block.flatten(1)),
            [1, 2],
        ),
    ),
    "mha_is_causal_hint": (
        _mha(batch_first=True),
        (
            lambda lay: [torch.randn(B, LQ, C), _maps(lay, C)],
            lambda f, q, m: f(
                q,
                tokens(m),
                tokens(m),
                attn_mask=torch.ones(LQ, m.shape[-2] * m.shape[-1], dtype=torch.bool).triu(1),
                is_causal=True,
                need_weights=False,
            )[0],
            [1],
        ),
    ),
    "mha_kdim_vdim": (
        _mha(batch_first=True, kdim=6, vdim=3),
        (
            lambda lay: [torch.randn(B, LQ, C), _maps(lay, 9)],
            lambda f, q, m: f(q, *tokens(m).split([6, 3], -1), need_weights=False)[0],
            [1],
        ),
    ),
    "mha_dropout_weights": (
        _mha(batch_first=True, dropout=0.3),
        (
            lambda lay: [torch.randn(B, LQ, C), _maps(lay, C)],
            lambda f, q, m: (torch.manual_seed(5), f(q, tokens(m), tokens(m)))[1],
            [1],
        ),
    ),
    "mha_dropout_no_weights": (
        _mha(batch_first=True, dropout=0.3),
        (
            lambda lay: [torch.randn(B, LQ, C), _maps(lay, C)],
            lambda f, q, m: (torch.manual_seed(5), f(q, tokens(m), tokens(m), need_weights=False))[1][0],
            [1],
        ),
    ),
    "mha_self_attention_over_sharded_tokens": (
        _mha(batch_first=True),
        (lambda lay: [_maps(lay, C)], lambda f, m: f(tokens(m), tokens(m), tokens(m), need_weights=False)[0], [0]),
    ),
    "transformer_decoder_layer": (
        lambda: torch.nn.TransformerDecoderLayer(C, HEADS, dim_feedforward=16, dropout=0.1, batch_first=True),
        (
            lambda lay: [torch.randn(B, LQ, C), _maps(lay, C)],
            lambda f, q, m: (torch.manual_seed(6), f(q, tokens(m)))[1],
            [1],
        ),
    ),
}


def _cases(layout, dtype):
    torch.manual_seed(0)
    cases = dict(SDPA)
    cases.update({name: _mha_case(make, call) for name, (make, call) in MODULES.items()})
    check_cases(layout, dtype, cases)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_attention_matches_one_device(layout, dtype):
    run_spmd(_cases, LAYOUTS[layout][0], layout, dtype)


def _queries_over_other_ranks(dtype):
    """Fewer queries than keys, the queries tiled over both axes of a 2x2 group, the keys sharded over its second
    axis only: along the first, every rank holds all of its keys' sums already, so the merge is not reduced there."""
    torch.manual_seed(0)
    ax = axes("2x2")

    def op(qm, m):
        if isinstance(qm, SpatialTensor):
            m = shard(m, {-1: ax[-1]})
        return F.scaled_dot_product_attention(heads(tokens(qm)), *kv(m))

    check(op, [torch.randn(B, C, 3, 8, dtype=dtype), torch.randn(B, 2 * C, H, 8, dtype=dtype)], [0], ax)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_queries_sharded_over_ranks_the_keys_are_not(dtype):
    run_spmd(_queries_over_other_ranks, 4, DTYPES[dtype])


ERRORS = {  # name -> (inputs, op, sharded, same message as one device)
    "sdpa_mask_of_another_key_count": (
        lambda: [_q(), _maps("w2"), torch.ones(LQ, H * 8 + 1, dtype=torch.bool)],
        lambda q, m, keep: F.scaled_dot_product_attention(q, *kv(m), attn_mask=keep),
        [1],
        False,  # torch's message depends on the kernel it picks; ours comes from its meta kernel
    ),
    "mha_attn_mask_of_another_key_count": (
        lambda: [torch.randn(B, LQ, C), _maps("w2", C), torch.ones(LQ, H * 8 - 1, dtype=torch.bool)],
        lambda q, m, block: _MHA(q, tokens(m), tokens(m), attn_mask=block),
        [1],
        True,
    ),
    "mha_key_padding_mask_of_another_key_count": (
        lambda: [torch.randn(B, LQ, C), _maps("w2", C), torch.ones(B, H * 8 - 2, dtype=torch.bool)],
        lambda q, m, pad: _MHA(q, tokens(m), tokens(m), key_padding_mask=pad),
        [1],
        True,
    ),
}
_MHA = torch.nn.MultiheadAttention(C, HEADS, batch_first=True)


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_masks_raise_torchs_error_before_communicating(case):
    make, op, sharded, message = ERRORS[case]
    run_spmd(raises_like_one_device, 2, "w2", op, make(), sharded, message, timeout=30)


def _appended_keys_case():
    torch.manual_seed(1)
    module = torch.nn.MultiheadAttention(C, HEADS, batch_first=True, add_bias_kv=True, add_zero_attn=True)
    names = [n for n, _ in module.named_parameters()]
    params = [p.detach().clone() for p in module.parameters()]

    def op(q, m, *weights):
        return functional_call(module, dict(zip(names, weights)), (q, tokens(m), tokens(m)))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(op, [torch.randn(B, LQ, C), _maps("w2", C), *params], [1], axes("w2"), allow_fallback=True)
    assert any(".cat has no spatial handler" in str(w.message) for w in caught)  # the announced gather


def test_bias_kv_and_zero_attention_append_a_key_exactly_through_the_fallback():
    run_spmd(_appended_keys_case, 2)


def _fused_kernel_case(device: str, dtype: torch.dtype):
    """The fused kernels (CPU flash; CUDA flash in bf16, memory-efficient in fp32) on shards of one rank's group,
    against torch's math attention on the same device: the merged output and log-sum-exp feed the kernel's backward
    exactly as the kernel wrote its own (the CUDA backward reads ``out`` with the forward's memory layout)."""
    from lightning_spatial.primitives import Axis
    from lightning_spatial.tensor import shard, unwrap

    torch.manual_seed(0)
    q = torch.randn(1, 8, 40, 32, device=device, dtype=dtype, requires_grad=True)
    fmap = torch.randn(1, 2 * 8 * 32, 6, 20, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(1, 8, 40, 32, device=device, dtype=dtype)
    results = []
    for sharded in (False, True):
        m = shard(fmap, {-1: Axis.from_group()}) if sharded else fmap
        k, v = (heads(t, 8) for t in tokens(m).chunk(2, -1))
        with (
            torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)
            if not sharded
            else contextlib.nullcontext()
        ):
            out = F.scaled_dot_product_attention(q, k, v)
        results.append((unwrap(out)[0].detach(), *torch.autograd.grad(out, (q, fmap), grad)))
    rtol = {torch.float32: None, torch.bfloat16: 2e-2}[dtype]  # None: the oracle's fp32 tolerance
    for name, ours, ref in zip(("output", "dq", "d features"), results[1], results[0]):
        assert_rel_close(ours.float(), ref.float(), name, rtol=rtol)  # a NaN fails it too


@pytest.mark.parametrize(
    "device,dtype",
    [
        ("cpu", torch.float32),
        pytest.param("cuda", torch.float32, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
        pytest.param("cuda", torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
    ],
)
def test_the_fused_kernels_backward_meets_the_merged_output_in_their_own_layout(device, dtype, tmp_path, monkeypatch):
    import torch.distributed as dist

    import lightning_spatial.mesh as mesh
    import lightning_spatial.ops.attention as attention

    calls, kernels = [], []
    forward, kernel = attention._ShardedKeys.forward, attention._kernel
    monkeypatch.setattr(attention._ShardedKeys, "forward", lambda *a: calls.append(a[1:4]) or forward(*a))
    monkeypatch.setattr(attention, "_kernel", lambda *a: (lambda r: kernels.append(r[2][0]) or r)(kernel(*a)))
    # one rank, in this process: a forked child could not use CUDA after the parent asked for devices. Its group
    # must not outlive the test in the axis registry: a later forked rank would inherit it and hang freeing it
    monkeypatch.setattr(mesh, "_GROUPS", {})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        _fused_kernel_case(device, dtype)
    finally:
        dist.destroy_process_group()
    assert calls, "the sharded-keys path did not run"
    assert kernels == [{"cpu": "cpu", "cuda": "flash" if dtype == torch.bfloat16 else "efficient"}[device]]
    # the tokens' channels are strided here; torch 2.11's CPU flash kernel silently misreads such rows (2.14's not)
    assert all(t.stride(-1) == 1 for t in calls[0]), [t.stride() for t in calls[0]]
