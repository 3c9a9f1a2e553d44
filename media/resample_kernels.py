"""The numba kernels of :mod:`media.fast_resample` (Pillow's 8-bit convolution resize):
filter weights, fixed-point coefficients, the vertical and the horizontal pass.

Imported on first use by ``fast_resample._get_kernels`` (an ``ImportError`` here means no
numba: Pillow resizes). The functions are module-level on purpose: numba's on-disk cache
keys a function by its bytecode and the pickled contents of its closure, and a closure
holding another jitted function (``coefficients`` calls ``weight``) pickles that
dispatcher with a fresh uuid in every process, so the kernels defined inside a function
(as they were) missed the cache at every start and compiled again (~1.5 s here). Globals
are not part of the key; numba freezes their values into the code when it compiles.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["coefficients", "horizontal", "vertical"]

PRECISION_BITS = 22  # Pillow: 32 - 8 - 2
ROW_BLOCK = 32  # rows per transposed block in the horizontal kernel

njit = numba.njit(nogil=True, cache=True)
# The kernels' constants, frozen into their code (and so into numba's cache, which is
# stamped with this file: they must stay in it).
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
