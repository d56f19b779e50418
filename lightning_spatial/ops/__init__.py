"""Spatial op handlers, one module per family; ``install`` registers them all (CPU and GPU alike)."""

from __future__ import annotations

from ..registry import add_handlers
from . import (
    attention,
    autograd,
    checkpointing,
    conv,
    elementwise,
    functions,
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
    scan,
    select,
    selection,
    shape,
)

# Later families override earlier ones (e.g. ``shape`` handles the ``mT`` property ``queries`` would answer,
# ``autograd`` the ``grad`` property).
FAMILIES = (
    elementwise,
    queries,
    autograd,
    checkpointing,
    conv,
    pad,
    pool,
    norm,
    resample,
    sample,
    random,
    reduce,
    scan,
    shape,
    loss,
    matmul,
    attention,
    index,
    select,
    selection,
)


def install() -> None:
    """Register every family's handlers (``registry``), later families over earlier ones, let user autograd
    Functions see shards (``functions``) and checkpoints recompute on shards (``checkpointing``)."""
    for family in FAMILIES:
        add_handlers(family.HANDLERS, override=True)
    functions.install()
    checkpointing.install()


__all__ = ["FAMILIES", "install"]
