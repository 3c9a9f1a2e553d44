"""Warm-up of the media layer's compiled fast paths.

The numba kernels (:mod:`media.fast_resample`, :mod:`media.png_fast`) compile, or load
from numba's on-disk cache, on first use: about a second each cold. A server calls
:func:`warm` while it loads a model, so no request pays for it.
"""

from __future__ import annotations

from media import fast_resample, png_fast

__all__ = ["warm"]


def warm() -> dict[str, bool]:
    """Compile (or load) and probe every fast path; returns which ones are on here
    (``False`` where numba is missing or a probe disagreed with Pillow)."""
    return {"resize": fast_resample.is_exact(), "png": bool(png_fast._kernel())}
