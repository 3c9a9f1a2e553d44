"""Pillow's 8-bit convolution resize, computed by vectorised numba kernels on several
threads, with the same pixels as ``PIL.Image.resize`` (bit for bit).

Why by hand: no library reproduces Pillow's resize exactly and fast. torch's antialiased
uint8 interpolation is modelled on it but rounds its coefficients to 16 bits (results
differ by a level here and there); Pillow itself runs scalar code on one core. The
reference processors resize with Pillow, so the pixels must be Pillow's.

What is reproduced (Pillow's ``Resample.c``, 8 bits per channel):

* per output position, the filter taps and weights (``precompute_coeffs``: centre,
  support scaled by the downscale factor, window clipped to the image, weights divided by
  their sum) in double precision, then fixed point with 22 fractional bits
  (``normalize_coeffs_8bpc``). Computed by a numba function written operation for
  operation like the C (no fast-math, so no reassociation or fused multiply-add);
* each pass accumulates ``pixel * weight`` in 32-bit integers starting from half a unit,
  shifts right by 22 and clamps to 0..255; the first pass's result is rounded to 8 bits
  before the second pass reads it;
* the pass order of the installed Pillow (:func:`vertical_first`): horizontal first up
  to Pillow 12; from Pillow 13 vertical first when the height shrinks by more than twice
  as many pixels as the width.

How it is fast: the vertical pass adds whole rows (contiguous, so the loop is SIMD);
the horizontal pass transposes a block of 32 rows into a ``(width, 32)`` table of packed
pixels, so that each tap is again one contiguous vector of 32 rows. Both passes are cut
into row bands run on :mod:`media.worker_pool` (the kernels release the GIL). Measured on
this 2-core machine, one thread: vertical pass 4-7x Pillow's, horizontal pass 1.5-2.5x.

Integer arithmetic cannot differ from Pillow's; the weights could only differ through
the platform's floating point (libm ``sin``/``cos`` for Hamming and Lanczos), so the
first use runs a probe against the installed Pillow over both pass orders and all five
filters (:func:`is_exact`); a mismatch turns this path off for the process (logged).
numba is imported on first use; without it, :func:`available` is false and callers
use Pillow.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import numpy as np
from PIL import Image as PILImage

from media.worker_pool import bounds, default_bands, executor, in_pool

__all__ = ["FILTERS", "available", "is_exact", "resample", "vertical_first"]

log = logging.getLogger(__name__)

R = PILImage.Resampling
# Pillow filter -> (our kernel's filter id, support)
FILTERS: dict[int, tuple[int, float]] = {
    R.BOX: (0, 0.5),
    R.BILINEAR: (1, 1.0),
    R.HAMMING: (2, 1.0),
    R.BICUBIC: (3, 2.0),
    R.LANCZOS: (4, 3.0),
}

# Below this many output values the thread hand-off costs more than it saves.
MIN_SPLIT_VALUES = 1 << 16


def _pillow_major() -> int:
    try:
        return int(PILImage.__version__.split(".")[0])
    except (AttributeError, ValueError):
        return 0


def vertical_first(src: tuple[int, int], dst: tuple[int, int]) -> bool:
    """Whether the installed Pillow runs the vertical pass first for this resize."""
    if _pillow_major() < 13:
        return False
    (sw, sh), (dw, dh) = src, dst
    return (sh - dh) > 0 and (sh - dh) > (sw - dw) * 2


# --------------------------------------------------------------------------- kernels

_kernels: dict[str, Any] | None = None
_kernels_lock = threading.Lock()


def _compile() -> dict[str, Any] | None:
    """The numba kernels (:mod:`media.resample_kernels`; each compiled, or loaded from
    numba's cache, on its first call), or None without numba."""
    try:
        from media import resample_kernels as k
    except ImportError:
        return None
    return {
        "coefficients": k.coefficients,
        "vertical": k.vertical,
        "horizontal": k.horizontal,
        "row_block": k.ROW_BLOCK,  # the horizontal kernel's bands start at multiples of it
    }


def _get_kernels() -> dict[str, Any] | None:
    global _kernels
    with _kernels_lock:
        if _kernels is None:
            try:
                _kernels = _compile() or {}
            except Exception as e:  # a numba that cannot compile here: Pillow does the work
                log.warning("numba resize kernels unavailable (%s): resizing with Pillow", e)
                _kernels = {}
        return _kernels or None


def available() -> bool:
    """Whether the numba kernels can run here (numba importable and compiling)."""
    return _get_kernels() is not None


@functools.lru_cache(maxsize=256)
def _coefficients(in_size: int, out_size: int, resample: int) -> tuple[np.ndarray, np.ndarray]:
    kernels = _get_kernels()
    assert kernels is not None
    fid, support = FILTERS[resample]
    taps, kk = kernels["coefficients"](in_size, out_size, fid, support)
    taps.flags.writeable = False
    kk.flags.writeable = False
    return taps, kk


# --------------------------------------------------------------------------- driver


def _run_bands(fn: Any, rows: int, width_values: int, bands: int, multiple: int, *args: Any) -> None:
    """``fn(*args, y0, y1)`` over ``rows`` output rows, split into bands on the pool when
    the pass is big enough to pay for it."""
    if bands < 2 or rows * width_values < MIN_SPLIT_VALUES or rows < 2 or in_pool():
        fn(*args, 0, rows)
        return
    parts = bounds(rows, bands, multiple)
    futures = [executor().submit(fn, *args, y0, y1) for y0, y1 in parts[1:]]
    fn(*args, *parts[0])  # this thread does the first band
    for f in futures:
        f.result()


def _vertical(src: np.ndarray, height: int, resample: int, cout: int, bands: int) -> np.ndarray:
    h, w, cin = src.shape
    taps, kk = _coefficients(h, height, resample)
    out = np.empty((height, w, cout), np.uint8)
    kernels = _get_kernels()
    assert kernels is not None
    _run_bands(
        kernels["vertical"],
        height,
        w * cout,
        bands,
        1,
        src.reshape(h, w * cin),
        out.reshape(height, w * cout),
        cin,
        cout,
        taps,
        kk,
    )
    return out


def _horizontal(src: np.ndarray, width: int, resample: int, bands: int) -> np.ndarray:
    h, w, _ = src.shape
    taps, kk = _coefficients(w, width, resample)
    out = np.empty((h, width, 3), np.uint8)
    kernels = _get_kernels()
    assert kernels is not None
    _run_bands(kernels["horizontal"], h, width * 3, bands, kernels["row_block"], src, out, taps, kk)
    return out


def resample(
    pixels: np.ndarray, size: tuple[int, int], resample: int, *, bands: int | None = None
) -> np.ndarray:
    """RGB pixels ``(h, w, 3)`` or ``(h, w, 4)`` uint8 (the fourth channel, if any, is
    ignored: Pillow's RGBX storage) resized to ``size`` = (width, height) with a Pillow
    filter: a new C-contiguous ``(height, width, 3)`` uint8 array with the pixels
    ``Image.fromarray(rgb).resize(size, resample)`` gives. Needs :func:`available`."""
    if pixels.ndim != 3 or pixels.shape[2] not in (3, 4) or pixels.dtype != np.uint8:
        raise ValueError(f"expected (h, w, 3|4) uint8 pixels, got {pixels.dtype} {pixels.shape}")
    if resample not in FILTERS:
        raise ValueError(f"filter {resample!r} is not a convolution filter Pillow resamples with")
    width, height = int(size[0]), int(size[1])
    if width < 1 or height < 1:
        raise ValueError(f"size must be positive, got {size!r}")
    if bands is None:
        bands = default_bands()
    h, w = pixels.shape[:2]
    if (w, h) == (width, height):
        return np.array(pixels[:, :, :3], order="C")  # a new array, as documented
    if not pixels.flags.c_contiguous:
        pixels = np.ascontiguousarray(pixels)
    out = pixels
    if vertical_first((w, h), (width, height)):
        if height != h:
            out = _vertical(out, height, resample, 3, bands)
        if width != w:
            out = _horizontal(out, width, resample, bands)
    else:
        if width != w:
            out = _horizontal(out, width, resample, bands)
        if height != h:
            out = _vertical(out, height, resample, 3, bands)
    return out


_verified: bool | None = None


def is_exact() -> bool:
    """Probe once per process that these kernels give the installed Pillow's pixels for
    every filter, both pass orders, up- and down-scales, 3- and 4-channel input (the
    4-channel one read-only, as a decoded image's pixels come: numba compiles read-only
    arrays apart, so the probe also compiles, or loads, what a request's resize runs); if
    not (or numba is missing) this path is never used."""
    global _verified
    if _verified is None:
        if not available():
            _verified = False
            return False
        rng = np.random.default_rng(0)
        src = rng.integers(0, 256, (61, 83, 3), dtype=np.uint8)
        pil = PILImage.fromarray(src)
        rgbx = np.concatenate([src, np.full((61, 83, 1), 255, np.uint8)], axis=2)
        rgbx.flags.writeable = False
        cases = [(40, 17), (120, 20), (30, 90), (200, 150), (83, 30), (50, 61), (83, 200)]
        _verified = all(
            np.array_equal(resample(arr, size, f, bands=2), np.asarray(pil.resize(size, resample=f)))
            for size in cases
            for f in FILTERS
            for arr in (src, rgbx)
        )
        if not _verified:
            log.warning(
                "numba resize kernels disagree with Pillow %s here: resizing with Pillow",
                PILImage.__version__,
            )
    return _verified
