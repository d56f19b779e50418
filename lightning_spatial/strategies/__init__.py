"""Lightning strategies: spatial x data parallel, and Horovod data parallel."""

from .spatial import SpatialParallelStrategy

__all__ = ["SpatialParallelStrategy"]
