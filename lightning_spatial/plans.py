"""Plans: what a handler decides before it runs a kernel, computed once per distinct arguments.

A *plan* is a pure function of layouts, shapes, dtypes, devices and non-tensor arguments: which rows a rank's
window spans, which messages it sends, the output's layout, an index tensor of fixed rows. ``@planned`` is the one
cache of the op layer: a plan is computed the first time its arguments are seen and looked up after that, in a
table of its own (bounded: cleared when full, since shapes vary with batches and crops). Plans that eager code asks
for at every op about one layout (``x.shape``'s global shape) are kept with that layout instead
(``per_layout=True``, in ``Layout.plans``): looking one up hashes no layout (a dataclass hash walks every shard and
axis, about 0.3 us).

The rule under ``torch.compile``: while dynamo traces, a plan is computed, never looked up. Its arguments are
constants of the trace, so the plan's code folds into constants of the graph; a lookup would make dynamo guard on
the table (a filled one would recompile) and wrap it entries and all. Arguments that cannot be hashed (a list)
are planned every time, as in traced code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")

_tracing = torch.compiler.is_dynamo_compiling  # read once: every plan lookup of eager code asks


def planned(
    func: Callable[P, R] | None = None,
    *,
    maxsize: int = 4096,
    per_layout: bool = False,
    keyed_by: int | None = None,
) -> Callable[P, R] | Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a pure function of hashable arguments (positional only) so that each distinct call is computed
    once; see the module docstring for the rule under ``torch.compile``.

    ``per_layout``: the first argument is a ``Layout``, which keeps the plans about it (at most ``maxsize``).
    ``keyed_by``: the plan depends on its first ``keyed_by`` arguments only; the others are an example it is computed
    from (e.g. a call whose argument types, not values, decide its binding)."""
    if func is None:
        return functools.partial(planned, maxsize=maxsize, per_layout=per_layout, keyed_by=keyed_by)
    if per_layout:
        return _per_layout(func, maxsize)
    table: dict = {}

    @functools.wraps(func)
    def plan(*args):
        if _tracing():
            return func(*args)
        k = args if keyed_by is None else args[:keyed_by]
        try:
            return table[k]
        except KeyError:
            pass
        except TypeError:  # an unhashable argument
            return func(*args)
        if len(table) >= maxsize:
            table.clear()
        result = table[k] = func(*args)
        return result

    return plan


def _per_layout(func: Callable, maxsize: int) -> Callable:
    @functools.wraps(func)
    def plan(layout, *args):
        if _tracing():
            return func(layout, *args)
        table = layout.plans.get(func)  # one table per plan function: keyed by the arguments as they came
        if table is None:
            table = layout.plans[func] = {}
        try:
            return table[args]
        except KeyError:
            pass
        except TypeError:
            return func(layout, *args)
        if len(table) >= maxsize:
            table.clear()
        result = table[args] = func(layout, *args)
        return result

    return plan


__all__ = ["planned"]
