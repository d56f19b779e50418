"""Constructor arguments checked where they are given: a bad value raises a ``ValueError`` naming the argument, its
value and what it takes, at construction (in a Hydra run: ``full_key`` names the config group), not in a
DataLoader worker or a kernel at the first step."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any


def integers(minimum: int, /, **values: Any) -> None:
    """Each value an integer >= ``minimum``: counts and sizes (0 where an empty set is meaningful)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def numbers(minimum: float, /, **values: Any) -> None:
    """Each value a real number >= ``minimum``."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, Real) or not value >= minimum:  # NaN fails too
            raise ValueError(f"{name} must be a number >= {minimum}, got {value!r}")


def positive(**values: Any) -> None:
    """Each value a real number > 0 (a learning rate, a length)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, Real) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")


def sizes(name: str, value: Sequence[Any], count: int = 2) -> tuple[int, ...]:
    """``count`` integers >= 1 (an image's [H, W], a grid's [X, Y]), as a tuple."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != count:
        raise ValueError(f"{name} must be {count} integers >= 1, got {value!r}")
    integers(1, **{f"{name}[{i}]": v for i, v in enumerate(value)})
    return tuple(int(v) for v in value)
