"""Warm-up of the media layer's compiled fast paths.

The numba kernels (:mod:`media.fast_resample`, :mod:`media.png_fast`) compile, or load
from numba's on-disk cache, on their first call: :func:`warm` takes ~5.6 s here with an
empty cache, ~1.1 s from the cache (numba's import and the Pillow probe included). A
server calls it while it loads a model, so no request pays for it.

Warm means called, not just made: numba compiles per argument types (a read-only array
is another type than a writable one), so each kernel is run here with the types a
request's decode or resize gives it. And it must happen before anything else compiles:
numba compiles under one process-wide lock, so a request whose kernel is not compiled yet
waits for every other compile in the process (the engine's sampling kernel takes ~15 s
on a background thread after a model loads), not only for its own.
"""

from __future__ import annotations

import io
import threading

import numpy as np

from media import fast_resample, png_fast

__all__ = ["warm"]

_png_ok: bool | None = None
_png_lock = threading.Lock()


def _warm_png() -> bool:
    """Decode a tiny RGB and a tiny grey PNG through the fast path (its kernel's one
    signature), checked against Pillow; False where the path is off here."""
    global _png_ok
    with _png_lock:
        if _png_ok is None:
            from PIL import Image as PILImage

            ok = bool(png_fast._kernel())
            rng = np.random.default_rng(0)
            for shape in ((5, 7, 3), (5, 7)):  # RGB, grey
                pixels = rng.integers(0, 256, shape, dtype=np.uint8)
                buf = io.BytesIO()
                PILImage.fromarray(pixels).save(buf, "PNG")
                got = png_fast.decode_png(buf.getvalue()) if ok else None
                want = pixels if pixels.ndim == 3 else np.repeat(pixels[:, :, None], 3, axis=2)
                ok = got is not None and np.array_equal(got, want)
            _png_ok = ok
        return _png_ok


def warm() -> dict[str, bool]:
    """Compile (or load) and probe every fast path; returns which ones are on here
    (``False`` where numba is missing or a probe disagreed with Pillow)."""
    return {"resize": fast_resample.is_exact(), "png": _warm_png()}
