"""Shared timing helper for the side-by-side benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, object]]:
    """Median wall-clock seconds of each function and its last result, called round-robin
    (one warm-up each first) so that changing machine load hits every variant alike."""
    outs: dict[str, object] = {k: fn() for k, fn in fns.items()}
    walls: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            outs[k] = fn()
            walls[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(walls[k]), outs[k]) for k in fns}


def median_ms(fn: Callable[[], object], repeats: int, *, warmup: bool = True) -> float:
    """Median wall-clock milliseconds of ``repeats`` calls of ``fn`` (after one untimed
    call when ``warmup``)."""
    if warmup:
        fn()
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls) * 1e3
