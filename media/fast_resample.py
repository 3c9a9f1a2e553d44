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

PRECISION_BITS = 22  # Pillow: 32 - 8 - 2
ROW_BLOCK = 32  # rows per transposed block in the horizontal kernel

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
    """The numba kernels, compiled (or loaded from numba's cache) on first use."""
    try:
        import numba
    except ImportError:
        return None

    njit = numba.njit(nogil=True, cache=True)
    half = np.int32(1 << (PRECISION_BITS - 1))
    shift = PRECISION_BITS
    block = ROW_BLOCK

    @numba.njit(cache=True)
    def weight(fid, x):
        if fid == 0:  # box
            return 1.0 if (x > -0.5 and x <= 0.5) else 0.0
        if fid == 1:  # bilinear
            if x < 0.0:
                x = -x
            return 1.0 - x if x < 1.0 else 0.0
        if fid == 2:  # hamming; Pillow's constants are the floats 0.54f and 0.46f
            if x < 0.0:
                x = -x
            if x == 0.0:
                return 1.0
            if x >= 1.0:
                return 0.0
            x = x * np.pi
            return np.sin(x) / x * (np.float64(np.float32(0.54)) + np.float64(np.float32(0.46)) * np.cos(x))
        if fid == 3:  # bicubic, a = -0.5
            a = -0.5
            if x < 0.0:
                x = -x
            if x < 1.0:
                return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
            if x < 2.0:
                return (((x - 5) * x + 8) * x - 4) * a
            return 0.0
        # lanczos: sinc(x) * sinc(x / 3) on [-3, 3)
        if not (-3.0 <= x and x < 3.0):
            return 0.0
        s1 = 1.0
        if x != 0.0:
            y = x * np.pi
            s1 = np.sin(y) / y
        x3 = x / 3
        s2 = 1.0
        if x3 != 0.0:
            y = x3 * np.pi
            s2 = np.sin(y) / y
        return s1 * s2

    @njit
    def coefficients(in_size, out_size, fid, support_unit):
        scale = np.float64(in_size) / out_size
        filterscale = scale if scale >= 1.0 else 1.0
        support = support_unit * filterscale
        ksize = int(np.ceil(support)) * 2 + 1
        kk = np.zeros((out_size, ksize), np.int32)
        taps = np.zeros((out_size, 2), np.int32)
        w = np.zeros(ksize, np.float64)
        ss = 1.0 / filterscale
        for xx in range(out_size):
            center = (xx + 0.5) * scale
            xmin = int(center - support + 0.5)
            if xmin < 0:
                xmin = 0
            xmax = int(center + support + 0.5)
            if xmax > in_size:
                xmax = in_size
            xmax -= xmin
            ww = 0.0
            for x in range(xmax):
                w[x] = weight(fid, (x + xmin - center + 0.5) * ss)
                ww += w[x]
            for x in range(xmax):
                v = w[x] / ww if ww != 0.0 else w[x]
                kk[xx, x] = int(-0.5 + v * 4194304.0) if v < 0 else int(0.5 + v * 4194304.0)
            taps[xx, 0] = xmin
            taps[xx, 1] = xmax
        return taps, kk

    @njit
    def vertical(src, dst, cin, cout, taps, kk, y0, y1):
        # src (h_in, w * cin), dst (h_out, w * cout) uint8; output rows y0..y1.
        n = src.shape[1]
        width = n // cin
        acc = np.empty(n, np.int32)
        for y in range(y0, y1):
            ymin = taps[y, 0]
            for i in range(n):
                acc[i] = half
            for t in range(taps[y, 1]):
                k = kk[y, t]
                row = src[ymin + t]
                for i in range(n):
                    acc[i] += np.int32(row[i]) * k
            out = dst[y]
            if cin == cout:
                for i in range(n):
                    v = acc[i] >> shift
                    out[i] = 0 if v < 0 else (255 if v > 255 else v)
            else:
                for x in range(width):
                    for c in range(cout):
                        v = acc[x * cin + c] >> shift
                        out[x * cout + c] = 0 if v < 0 else (255 if v > 255 else v)

    @njit
    def horizontal(src, dst, taps, kk, y0, y1):
        # src (h, w_in, cin >= 3), dst (h, w_out, 3) uint8; rows y0..y1. A block of rows is
        # transposed into packed 0x00BBGGRR words so each tap is one contiguous vector.
        w_in = src.shape[1]
        w_out = dst.shape[1]
        table = np.empty((w_in, block), np.int32)
        a0 = np.empty(block, np.int32)
        a1 = np.empty(block, np.int32)
        a2 = np.empty(block, np.int32)
        for r0 in range(y0, y1, block):
            rows = min(block, y1 - r0)
            for r in range(rows):
                line = src[r0 + r]
                for x in range(w_in):
                    table[x, r] = (
                        np.int32(line[x, 0]) | (np.int32(line[x, 1]) << 8) | (np.int32(line[x, 2]) << 16)
                    )
            for xx in range(w_out):
                xmin = taps[xx, 0]
                for r in range(block):
                    a0[r] = half
                    a1[r] = half
                    a2[r] = half
                for t in range(taps[xx, 1]):
                    k = kk[xx, t]
                    col = table[xmin + t]
                    for r in range(block):
                        p = col[r]
                        a0[r] += (p & 255) * k
                        a1[r] += ((p >> 8) & 255) * k
                        a2[r] += ((p >> 16) & 255) * k
                for r in range(rows):
                    v0 = a0[r] >> shift
                    v1 = a1[r] >> shift
                    v2 = a2[r] >> shift
                    out = dst[r0 + r, xx]
                    out[0] = 0 if v0 < 0 else (255 if v0 > 255 else v0)
                    out[1] = 0 if v1 < 0 else (255 if v1 > 255 else v1)
                    out[2] = 0 if v2 < 0 else (255 if v2 > 255 else v2)

    return {"coefficients": coefficients, "vertical": vertical, "horizontal": horizontal}


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
    _run_bands(kernels["horizontal"], h, width * 3, bands, ROW_BLOCK, src, out, taps, kk)
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
    every filter, both pass orders, up- and down-scales, 3- and 4-channel input; if
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
