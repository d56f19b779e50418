"""Lightning strategies: spatial x data parallel, and Horovod data parallel."""

from .horovod import HorovodStrategy
from .spatial import SpatialParallelStrategy

__all__ = ["HorovodStrategy", "SpatialParallelStrategy"]
