"""Spatial op handlers, one module per family; ``install`` registers them all (CPU and GPU alike)."""

from __future__ import annotations

from ..tensor import HANDLERS, index_handlers
from . import (
    attention,
    autograd,
    conv,
    elementwise,
    index,
    loss,
    matmul,
    norm,
    pad,
    pool,
    queries,
    random,
    reduce,
    resample,
    sample,
    select,
    shape,
)

# Later families override earlier ones (e.g. ``shape`` handles the ``mT`` property ``queries`` would answer,
# ``autograd`` the ``grad`` property).
FAMILIES = (
    elementwise,
    queries,
    autograd,
    conv,
    pad,
    pool,
    norm,
    resample,
    sample,
    random,
    reduce,
    shape,
    loss,
    matmul,
    attention,
    index,
    select,
)


def install() -> None:
    """Route the torch functions each family handles to its handlers for every ``SpatialTensor``."""
    for family in FAMILIES:
        HANDLERS.update(family.HANDLERS)
    index_handlers()


__all__ = ["FAMILIES", "install"]
