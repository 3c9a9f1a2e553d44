"""Argument checks shared by every room: numbers that must be ints (never bools), in a
range, finite. Each failure is an ``InvalidRequestError`` that names the argument, the
value and what was expected."""

from __future__ import annotations

import math
import numbers
from typing import Any

from media.errors import InvalidRequestError


def _describe_range(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high}")
    return " and ".join(parts)


def _check_range(
    name: str,
    value: Any,
    what: str,
    low: float | None,
    high: float | None,
    low_open: bool,
    high_open: bool,
    kind: str | None,
) -> None:
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        bounds = _describe_range(low, high, low_open, high_open)
        raise InvalidRequestError(
            f"{name} must be {what} {bounds}, got {value!r}", kind=kind, limit=bounds, actual=value
        )


def check_int(
    name: str,
    value: Any,
    *,
    min: int | None = None,
    max: int | None = None,
    kind: str | None = None,
) -> int:
    """``value`` as a Python int; a bool, a float or anything else is refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", kind=kind, actual=repr(value))
    value = int(value)
    _check_range(name, value, "an integer", min, max, False, False, kind)
    return value


def check_number(
    name: str,
    value: Any,
    *,
    min: float | None = None,
    max: float | None = None,
    min_open: bool = False,
    max_open: bool = False,
    kind: str | None = None,
) -> float:
    """``value`` as a finite float; bools, NaN, infinities and non-numbers are refused.
    ``min_open`` / ``max_open`` make a bound exclusive."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", kind=kind, actual=repr(value))
    value = float(value)
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", kind=kind, actual=value)
    _check_range(name, value, "a number", min, max, min_open, max_open, kind)
    return value
