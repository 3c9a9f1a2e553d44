"""The media layer's one thread pool, for work split into bands (resizes) and for the
PNG inflate that runs beside its unfilter (:mod:`media.png_fast`).

The work handed to it releases the GIL (Pillow's resample, zlib, the numba kernels of
:mod:`media.fast_resample` and :mod:`media.png_fast`), so it runs on separate cores. Fork-safe: a forked child
(Ray workers, multiprocessing) starts its own pool.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

# At most this many bands per pass (and threads in the pool).
MAX_BANDS = 8

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def usable_cores() -> int:
    """Cores this process may run on (the affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_bands() -> int:
    """Bands per pass when the caller does not say: the usable cores, at most ``MAX_BANDS``."""
    return max(1, min(usable_cores(), MAX_BANDS))


_THREAD_PREFIX = "pie-media-pool"


def in_pool() -> bool:
    """Whether the calling thread is one of the pool's (work that waits on other pool
    tasks must not run there: with every worker waiting, nothing would progress)."""
    return threading.current_thread().name.startswith(_THREAD_PREFIX)


def executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=MAX_BANDS, thread_name_prefix=_THREAD_PREFIX)
        return _pool


def _forget_pool_in_child() -> None:
    # A forked child inherits the pool object but not its threads: it must start its own.
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def bounds(length: int, bands: int, multiple: int = 1) -> list[tuple[int, int]]:
    """``length`` cut into at most ``bands`` non-empty ranges, inner cuts on multiples of
    ``multiple``."""
    cuts = [min(length, (length * i // bands) // multiple * multiple) for i in range(bands)] + [length]
    return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
