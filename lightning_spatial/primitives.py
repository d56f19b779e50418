"""The building blocks under the strategies, for writing spatial handlers and tools of your own.

- the data model: ``Axis`` (one mesh axis as a rank sees it), ``DimShard`` (one sharded dim or factor),
  ``Layout`` (which dims of a tensor are sharded), ``partition`` (the rows each rank holds), ``SpatialDims`` (the
  data x spatial decomposition of the world);
- tensors: ``wrap`` (a local shard and its layout as a ``SpatialTensor``), ``unwrap`` (back), ``shard_batch``
  (this rank's part of a batch, as the strategy's collate hook cuts it);
- communication: ``fetch_window`` (rows ``[a, b)`` of a sharded dim, with halos from the neighbours, and its
  adjoint), ``all_reduce`` and ``all_gather`` along an axis, autograd-correct under the split-gradient convention
  (docs/design.md); ``counting_halo_bytes`` (the halo bytes a block sends);
- handlers: ``planned`` (the one plan cache), ``fallback`` (gather, run, reshard). The contract a handler keeps is
  in docs/design.md, "Writing a handler"; ``lightning_spatial.register_handler`` registers one;
- training loops of your own (as the strategy runs the model, for benchmarks): ``CUDAGraphed`` (a module's
  training forward and backward replayed as CUDA graphs), ``noting_bucket_views`` (a DDP communication hook's
  wrapper that lets replays write gradients into DDP's buckets), ``gradients_laid_out_like_parameters`` (before
  DDP wraps a model: gradients with their parameter's strides, so DDP neither warns nor copies).
"""

from __future__ import annotations

from .collectives import all_gather, all_reduce
from .fallback import fallback
from .graphs import CUDAGraphed, noting_bucket_views
from .halo import fetch_window
from .layout import DimShard, Layout, partition
from .mesh import Axis, SpatialDims
from .plans import planned
from .run import HaloBytes, counting_halo_bytes
from .sharding import shard_batch
from .strategies._gradients import gradients_laid_out_like_parameters
from .tensor import unwrap, wrap

__all__ = [
    "Axis",
    "CUDAGraphed",
    "DimShard",
    "HaloBytes",
    "Layout",
    "SpatialDims",
    "all_gather",
    "all_reduce",
    "counting_halo_bytes",
    "fallback",
    "fetch_window",
    "gradients_laid_out_like_parameters",
    "partition",
    "noting_bucket_views",
    "planned",
    "shard_batch",
    "unwrap",
    "wrap",
]
