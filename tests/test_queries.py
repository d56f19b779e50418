"""Queries that read no data answer without communicating; questions about the data answer globally.

The single-process tests build a SpatialTensor over an axis that has no process group in this process: any
message (a gather, an all-reduce) raises, so a query that answers at all answered from the shard and layout.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

from lightning_spatial import SpatialTensor, fallback_mode, gather, shard
from lightning_spatial.primitives import Axis, DimShard, Layout
from lightning_spatial.sharding import ShardingCollate
from lightning_spatial.tensor import wrap
from tests.oracle import check
from tests.spmd import LAYOUTS, axes, run_spmd


def _sharded(local: torch.Tensor, size: int) -> SpatialTensor:
    """This rank's ``local`` part of a tensor whose last dim has global ``size``, split over 2 ranks."""
    return wrap(local, Layout((DimShard(-1, Axis((0, 1), 0), size),)))


def test_metadata_queries_never_gather():
    x = _sharded(torch.randn(2, 3, 4, 5), 10)  # global (2, 3, 4, 10)
    y = torch.randn(2, 3, 4, 10)
    assert torch.is_floating_point(x) and x.is_floating_point()
    assert not torch.is_complex(x) and not x.is_complex()
    assert torch.is_signed(x) and x.is_signed()
    assert torch.result_type(x, y.double()) == torch.float64
    assert torch.is_same_size(x, y) and x.is_same_size(y) and not x.is_same_size(y[..., :5])
    assert not torch.is_inference(x) and not x.is_inference() and not x.is_shared()
    assert x.dim_order() == (0, 1, 2, 3)
    assert x.dim() == x.ndim == 4 and x.numel() == torch.numel(x) == 240 and len(x) == 2
    assert x.size() == x.shape == (2, 3, 4, 10) and x.size(-1) == 10
    assert x.stride() == (120, 40, 10, 1) and x.stride(-2) == 10  # the global tensor's, as its shape
    assert x.element_size() == x.itemsize == 4 and x.nbytes == 960
    assert x.is_contiguous() and x.dtype == torch.float32 and x.device.type == "cpu" and x.get_device() == -1
    assert x.data_ptr() != 0 and x.untyped_storage().nbytes() == 480
    assert x.type() == "torch.FloatTensor" and not x.requires_grad and x.is_leaf
    for new in (x.new_zeros(5), x.new_full((2, 5), 1.5), x.new_tensor([1.0, 2.0]), x.new_empty_strided((2, 3), (3, 1))):
        assert type(new) is torch.Tensor  # new replicated tensors of the size asked for
    assert x.new_full((2, 5), 1.5).shape == (2, 5)


def test_stride_describes_the_global_tensor_in_the_shards_memory_format():
    x = _sharded(torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last), 10)
    assert x.stride() == (120, 1, 30, 3)  # channels_last strides of (2, 3, 4, 10)
    assert _sharded(torch.randn(3, 5, 7), 14).stride() == (70, 14, 1)


def test_tensor_properties_keep_the_layout():
    local = torch.randn(6, 5)
    x = _sharded(local, 10)  # global (6, 10)
    for prop in (x.data, x.real, x.detach()):
        assert isinstance(prop, SpatialTensor) and prop.shape == (6, 10) and prop.shard_layout == x.shard_layout
    t = x.T  # dims reversed globally: the sharded dim moves
    assert t.shape == (10, 6) and t.shard_layout.shards[0].dim == -2 and torch.equal(t.to_local(), local.T)
    assert x.mH.shape == x.H.shape == (10, 6)
    with pytest.raises(RuntimeError, match="only supported on matrices"):  # torch's check, on the global shape
        _sharded(torch.randn(2, 3, 4, 5), 10).H
    leaf = _sharded(torch.randn(6, 5), 10).requires_grad_()
    (leaf * 3).to_local().sum().backward()
    assert isinstance(leaf.grad, SpatialTensor) and leaf.grad.shape == (6, 10)
    assert torch.equal(leaf.grad.to_local(), torch.full((6, 5), 3.0))
    leaf.grad = torch.arange(60.0).view(6, 10)  # a replicated value of the global shape: our part of it
    assert torch.equal(leaf.grad.to_local(), torch.arange(60.0).view(6, 10)[:, :5])
    x.data = torch.zeros(6, 10)
    assert torch.equal(x.to_local(), torch.zeros(6, 5))
    copied = copy.deepcopy(x)
    assert isinstance(copied, SpatialTensor) and copied.shard_layout == x.shard_layout
    assert copied.to_local().data_ptr() != x.to_local().data_ptr()


def test_conversions_and_factories_need_no_communication():
    x = _sharded(torch.randn(2, 3, 4, 5, dtype=torch.float64), 10)
    t = torch.randn(7, 2)  # plain: x only names a dtype and a device
    for converted in (t.to(x), t.type_as(x)):
        assert type(converted) is torch.Tensor and converted.shape == (7, 2) and converted.dtype == torch.float64
    for like in (torch.zeros_like(x), torch.full_like(x, 2.0), x.long(), x.bool(), x.to(torch.float32)):
        assert isinstance(like, SpatialTensor) and like.shape == (2, 3, 4, 10)
        assert like.to_local().shape == (2, 3, 4, 5)
    noise = torch.randn_like(x, requires_grad=True)  # a global draw needs no message either
    assert isinstance(noise, SpatialTensor) and noise.is_leaf and noise.requires_grad


def test_saving_a_spatial_tensor_is_refused_with_what_to_save():
    x = _sharded(torch.randn(2, 3, 4, 5), 10)
    with pytest.raises(TypeError, match=r"gather\(x\).*x.to_local\(\)"):
        torch.save({"activation": x}, "/dev/null")
    with pytest.raises(TypeError, match="one rank's shard"):
        pickle.dumps(x)


def _global_truth_case(layout):
    with fallback_mode("error"):  # one boolean all-reduce each, never a gather
        _global_truths(layout)


def _global_truths(layout):
    ax = axes(layout)
    torch.manual_seed(4)
    full = torch.randn(2, 3, 6, 23 if layout == "w3" else 10)
    other = full.clone()
    other[-1, -1, -1, -1] += 1.0  # only the last rank holds the difference
    x, y = shard(full, ax), shard(other, ax)
    assert torch.equal(x, shard(full.clone(), ax)) and x.equal(full)  # a replicated operand: cut to our part
    assert not torch.equal(x, y) and not y.equal(full)  # every rank answers False, not only the last one
    assert not torch.equal(x, full[..., :4])
    assert torch.allclose(x, y, atol=1.5) and not torch.allclose(x, y) and not x.allclose(other)
    assert torch.isfinite(x).all() and not (x > 10).any()
    z = shard(torch.where(other > other.amax() - 1e-3, torch.inf, other), ax)  # one inf, on the last rank
    assert not torch.isfinite(z).all() and torch.isinf(z).any()
    x.data = shard(other, ax).data
    assert torch.equal(gather(x), other)


@pytest.mark.parametrize("layout", ["w3", "2x2"])
def test_equal_allclose_all_any_answer_for_the_global_tensor(layout):
    run_spmd(_global_truth_case, LAYOUTS[layout][0], layout)


def _as_strided_case(layout):
    torch.manual_seed(5)
    for fmt in (torch.contiguous_format, torch.channels_last):
        full = torch.randn(2, 3, 6, 10).contiguous(memory_format=fmt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check(lambda x: x.as_strided(x.size(), x.stride()), [full], [0], axes(layout), allow_fallback=True)


@pytest.mark.parametrize("layout", ["w2", "2x2"])
def test_as_strided_with_size_and_stride_is_the_identity(layout):
    run_spmd(_as_strided_case, LAYOUTS[layout][0], layout)


class _Images(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"image": torch.arange(3 * 8 * 10.0).view(3, 8, 10) + i, "label": torch.tensor(i)}


def _worker_case():
    collate = ShardingCollate(torch.utils.data.default_collate, axes("w2"))
    loader = torch.utils.data.DataLoader(_Images(), batch_size=2, num_workers=1, collate_fn=collate, timeout=30)
    for i, batch in enumerate(loader):
        assert isinstance(batch["image"], SpatialTensor) and batch["image"].shape == (2, 3, 8, 10)
        expected = torch.stack([_Images()[2 * i + k]["image"] for k in range(2)])
        assert torch.equal(gather(batch["image"]), expected)


def test_dataloader_workers_send_shards():
    run_spmd(_worker_case, 2)
