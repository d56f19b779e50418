"""Bind a handler's arguments as torch binds them for the function the handler stands in for.

A handler receives a call as the user spelled it: positional or keyword, defaults left out, in any overload of
the function (``x.var(False)`` passes ``unbiased``, ``x.var(1)`` passes ``dim``). ``bound`` reads the function's
own signature once (the aten schemas of a builtin, overloads tried in order with the Python parser's strict
types, so a bool is not an int; ``inspect.signature`` of a Python function) and calls the implementation with
keywords only: every parameter of the matching overload, defaults filled in, ``self`` named ``input``. A call
that matches no overload raises torch's own error (from the same call on meta tensors), before any communication.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._jit_internal import boolean_dispatched

from ..fallback import fallback, name_of
from ..layout import LayoutError
from ..plans import planned
from ._meta import raise_torch_error

_ALIASES = {"axis": "dim", "keepdims": "keepdim"}  # numpy spellings torch's parser accepts


@dataclass(frozen=True)
class _Overload:
    names: tuple[str, ...]
    positional: int  # how many leading parameters may be passed positionally
    defaults: dict[str, Any]
    checks: dict[str, Callable[[Any], bool]]  # builtins only: the parser's type test per parameter
    position: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "position", {n: i for i, n in enumerate(self.names)})

    def bind(self, args: tuple, kwargs: dict, check: bool = True) -> dict[str, Any] | None:
        """The arguments by name, or ``None`` if the call does not fit (``check``: also test the types)."""
        if len(args) > self.positional:
            return None
        out = dict(self.defaults)
        out.update(zip(self.names, args))
        for key, value in kwargs.items():
            key = _ALIASES.get(key, key) if self.checks else key
            if self.position.get(key, -1) < len(args):  # unknown, or also given positionally
                return None
            out[key] = value
        if len(out) < len(self.names):  # a required parameter is missing
            return None
        if check and not all(test(out[name]) for name, test in self.checks.items()):
            return None
        return out


@dataclass(frozen=True)
class Call:
    """How a handler receives calls of one shape: the overload they match (``None``: torch accepts a call none
    here matches, so only the exact fallback is safe), and ``add``, the defaults to pass along with the call as it
    is, or ``None`` where the handler must be called with the arguments by name."""

    overload: _Overload | None
    add: dict[str, Any] | None


class Binding:
    """The overloads of one torch function, and how a handler (``positional``: its positional-or-keyword parameter
    names, ``names``: all it takes by name) receives calls of it."""

    def __init__(self, func: Callable, positional: tuple[str, ...] = (), names: frozenset[str] = frozenset()) -> None:
        self.func, self.positional, self.names = func, positional, names
        self.overloads = _overloads(func)
        # a Python function has one signature: its binding depends on the count and keywords, not the types
        self.call_shape = _shape_of if self.overloads[0].checks else _count_and_keywords

    def plan(self, args: tuple, kwargs: dict) -> Call:
        """The ``Call`` of ``args``/``kwargs``, decided once per call shape; a call torch rejects raises torch's
        error."""
        return _call(self, self.call_shape(args, kwargs), args, kwargs)

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any] | None:
        """The arguments by name; ``None`` if torch accepts a call no overload here matches."""
        overload = self.plan(args, kwargs).overload
        return None if overload is None else overload.bind(args, kwargs, check=False)


@planned(keyed_by=2)  # (binding, call shape): the call itself is the example the plan is computed from
def _call(binding: Binding, shape: tuple, args: tuple, kwargs: dict) -> Call:
    """``Binding.plan``: the first overload whose parameters and types fit (the same types fit again, so a call
    shape decides it), and whether the handler can take the call as it is: its positional parameters are the
    overload's for the arguments given by position, it takes every keyword given and every default to add by
    those names, and no numpy alias or ``out=`` is involved."""
    overload = next((o for o in binding.overloads if o.bind(args, kwargs) is not None), None)
    if overload is None:
        raise_torch_error(binding.func, args, kwargs)  # a call torch rejects raises torch's own error
        return Call(None, None)
    arguments = overload.bind(args, kwargs, check=False)
    add = None
    if binding.positional[: len(args)] == overload.names[: len(args)]:
        rest = [n for n in overload.names[len(args) :] if n not in kwargs and n != "out"]
        if all(k in binding.names and k != "out" for k in kwargs) and all(n in binding.names for n in rest):
            add = {n: arguments[n] for n in rest}
    return Call(overload, add)


def bound(impl: Callable, *funcs: Callable) -> dict[Callable, Callable]:
    """Handlers for ``funcs`` that call ``impl`` with the arguments bound by each function's own signature."""
    return {func: _handler(func, impl) for func in funcs}


def _handler(func: Callable, impl: Callable) -> Callable:
    params = inspect.signature(impl).parameters.values()
    names = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    positional = tuple(p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD)
    binding = Binding(func, positional, names)

    def handler(*args, **kwargs):
        call = binding.plan(args, kwargs)
        if call.add is not None:
            return impl(*args, **kwargs, **call.add) if call.add else impl(*args, **kwargs)
        if call.overload is None:
            return fallback(func, args, kwargs)
        arguments = call.overload.bind(args, kwargs, check=False)
        if arguments.pop("out", None) is not None:
            raise LayoutError(f"{name_of(func)}: out= is not supported on sharded tensors; assign the result instead")
        return impl(**arguments)

    handler.__name__ = getattr(impl, "__name__", "handler")
    return handler


def _overloads(func: Callable) -> tuple[_Overload, ...]:
    if inspect.isfunction(func):
        python = boolean_dispatched[func]["if_false"] if func in boolean_dispatched else func  # F.max_pool2d
        return (_from_python(python),)
    name = getattr(func, "__name__", "")
    schemas = [s for s in torch._C._jit_get_schemas_for_operator(f"aten::{name}") if s.arguments and _on_tensors(s)]
    if not schemas:
        raise TypeError(f"no signature found for {name_of(func)}")
    return tuple(_from_schema(s) for s in schemas)


def _on_tensors(schema) -> bool:
    """An overload whose first argument is a tensor (``self``) or a list of them (``cat``'s ``tensors``)."""
    first = schema.arguments[0]
    if first.name == "tensors":
        return first.type.kind() == "ListType" and first.type.getElementType().kind() == "TensorType"
    return first.name in ("self", "input") and first.type.kind() == "TensorType"


def _from_python(func: Callable) -> _Overload:
    params = list(inspect.signature(func).parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        raise TypeError(f"cannot bind {name_of(func)}: its signature takes *args or **kwargs")
    names = tuple("input" if i == 0 and p.name == "self" else p.name for i, p in enumerate(params))
    positional = sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    defaults = {n: p.default for n, p in zip(names, params) if p.default is not p.empty}
    return _Overload(names, positional, defaults, {})


def _from_schema(schema) -> _Overload:
    args = schema.arguments
    names = tuple("input" if a.name == "self" else a.name for a in args)
    positional = sum(1 for a in args if not a.kwarg_only)
    defaults = {n: _frozen(a.default_value) for n, a in zip(names, args) if a.has_default_value()}
    checks = {n: _check(a.real_type, a.N) for n, a in zip(names, args)}
    return _Overload(names, positional, defaults, checks)


def _frozen(default: Any) -> Any:
    """A schema's list default (``stride=[1, 1]``) as a tuple: hashable, so plans can be keyed by it."""
    return tuple(default) if isinstance(default, list) else default


def _is_int(v) -> bool:
    return isinstance(v, (numbers.Integral, torch.SymInt)) and not isinstance(v, bool)


def _check(t, n: int | None) -> Callable[[Any], bool]:
    """The Python parser's test for an argument of schema type ``t`` (``n``: fixed list length)."""
    kind = t.kind()
    if kind == "OptionalType":
        inner = _check(t.getElementType(), n)
        return lambda v: v is None or inner(v)
    if kind == "ListType":
        element = _check(t.getElementType(), None)
        single = n is not None and element is _is_int  # int[2] also takes one int
        return lambda v: (isinstance(v, (list, tuple, torch.Size)) and all(map(element, v))) or (single and element(v))
    return _SCALARS.get(kind, lambda v: True)


_SCALARS: dict[str, Callable[[Any], bool]] = {
    "TensorType": lambda v: isinstance(v, torch.Tensor),
    "BoolType": lambda v: isinstance(v, bool),
    "IntType": _is_int,
    "SymIntType": _is_int,
    "FloatType": lambda v: isinstance(v, numbers.Real),
    "NumberType": lambda v: isinstance(v, numbers.Number) or (isinstance(v, torch.Tensor) and v.dim() == 0),
    "StringType": lambda v: isinstance(v, str),
    "ScalarTypeType": lambda v: isinstance(v, torch.dtype),
}


def _shape_of(args: tuple, kwargs: dict) -> tuple:
    """What decides the overload and the binding of a call: the count of positional arguments, the keywords, and
    the kinds of values."""
    return (len(args), tuple(kwargs), *map(_kind, args), *map(_kind, kwargs.values()))


def _count_and_keywords(args: tuple, kwargs: dict) -> tuple:
    return (len(args), *kwargs)


def _kind(v) -> Any:
    """What decides the overload: the type of a value, and of a list's elements."""
    t = type(v)
    if t is list or t is tuple or t is torch.Size:
        return (t, *map(type, v))
    return t


__all__ = ["Binding", "Call", "bound"]
