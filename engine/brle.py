"""Pie's binary run-length encoding (``pie:core/inference``'s ``brle``).

A BRLE is a list of run lengths that alternate false, true, false, ... starting with a
false run (which may be 0): ``[0, 5]`` is five trues, ``[2, 3, 1]`` is
``F F T T T F``. Attention masks (one per input row, over the context's K/V rows) and
logit masks (over the vocabulary) travel in it. Decoding is one ``np.repeat``; the
checks say what was wrong and what was expected, since the runs come from guests.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from engine.errors import EngineError, InvalidRequestError

MAX_RUNS = 1 << 20
"""Most runs one BRLE may have (a mask alternating on every token of a 1M-row context)."""


class BrleError(EngineError, InvalidRequestError):
    """A BRLE that does not describe the mask asked for: negative or non-integer runs, or
    runs that do not add up to the length the mask must have (``details``: ``length``,
    ``expected``)."""

    code = "invalid_brle"


def decode(runs: Sequence[int], length: int, *, what: str = "mask") -> np.ndarray:
    """(length,) bool array of ``runs`` (True = kept / attended). Raises ``BrleError``
    unless the runs are non-negative integers adding up to exactly ``length``."""
    if len(runs) > MAX_RUNS:
        raise BrleError(f"the {what} has {len(runs)} runs; at most {MAX_RUNS}", length=len(runs))
    arr = np.asarray(runs)
    if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0):
        raise BrleError(f"the {what}'s runs must be non-negative integers, got {list(runs)[:8]}")
    total = int(arr.sum()) if arr.size else 0
    if total != length:
        raise BrleError(
            f"the {what}'s runs add up to {total}; it must cover exactly {length}",
            length=total,
            expected=length,
        )
    values = np.arange(arr.size) % 2 == 1  # run 0 false, run 1 true, ...
    return np.repeat(values, arr)


def encode(mask: Iterable[bool] | np.ndarray) -> list[int]:
    """The BRLE of a boolean mask (the shortest: a leading false run of 0 only when the
    mask starts true)."""
    m = np.asarray(mask, dtype=bool).reshape(-1)
    if m.size == 0:
        return []
    edges = np.flatnonzero(m[1:] != m[:-1]) + 1
    bounds = np.concatenate(([0], edges, [m.size]))
    runs = np.diff(bounds).tolist()
    return [0, *runs] if m[0] else runs


def from_ranges(length: int, keep: Iterable[tuple[int, int]]) -> list[int]:
    """The BRLE over ``[0, length)`` that is true on the ``[start, end)`` ranges of ``keep``
    (clipped to the length; overlapping ranges merge)."""
    m = np.zeros(length, dtype=bool)
    for start, end in keep:
        m[max(0, start) : max(0, min(length, end))] = True
    return encode(m)


def count_true(runs: Sequence[int]) -> int:
    """How many positions a BRLE keeps (its odd runs)."""
    return int(sum(runs[1::2]))
