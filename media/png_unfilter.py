"""The numba kernel of :mod:`media.png_fast`: undo a PNG's per-row filters.

Imported on first use by ``png_fast._kernel`` (an ``ImportError`` here means no numba:
Pillow decodes). The functions are module-level on purpose: numba's on-disk cache keys a
function by its bytecode and the pickled contents of its closure, and a closure holding
another jitted function pickles that dispatcher with a fresh uuid in every process, so
a kernel defined inside a function (as this one was) missed the cache at every start,
compiled again (~2 s here) and added one more file to ``__pycache__`` each time. A
global callee is not part of the key: this module's kernel is loaded from the cache.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["unfilter"]


@numba.njit(nogil=True, cache=True, inline="always")
def paeth(a, b, c):
    # Branch-free (photos make the branches unpredictable): the predictor is
    # a if pa <= pb and pa <= pc, else b if pb <= pc, else c.
    pa = abs(b - c)
    pb = abs(a - c)
    pc = abs(a + b - 2 * c)
    bc = c + (b - c) * np.int32(pb <= pc)
    return bc + (a - bc) * np.int32((pa <= pb) & (pa <= pc))


@numba.njit(nogil=True, cache=True)
def unfilter(raw, out, bpp, y0):
    # raw: rows y0, y0 + 1, ... of (filter byte, stride bytes); out: (height,
    # stride), rows before y0 already done. Returns -1, or the row of an
    # unknown filter type. The left and upper-left bytes are carried in
    # variables, the channels interleaved so their chains overlap.
    stride = out.shape[1]
    rows = raw.shape[0] // (stride + 1)
    zero = np.zeros(stride, np.uint8)
    for y in range(y0, y0 + rows):
        base = (y - y0) * (stride + 1)
        f = raw[base]
        src = raw[base + 1 : base + 1 + stride]
        row = out[y]
        up = out[y - 1] if y > 0 else zero
        if f == 0:
            for i in range(stride):
                row[i] = src[i]
        elif f == 2:  # Up
            for i in range(stride):
                row[i] = (src[i] + up[i]) & 255
        elif f > 4:
            return y  # unknown filter type: the row it is in
        elif bpp == 3:  # the three channel chains interleaved, one pixel a step
            a0 = a1 = a2 = c0 = c1 = c2 = np.int32(0)  # left, upper-left
            for i in range(0, stride, 3):
                b0 = np.int32(up[i])
                b1 = np.int32(up[i + 1])
                b2 = np.int32(up[i + 2])
                if f == 1:
                    p0, p1, p2 = a0, a1, a2
                elif f == 3:
                    p0, p1, p2 = (a0 + b0) >> 1, (a1 + b1) >> 1, (a2 + b2) >> 1
                else:
                    p0, p1, p2 = paeth(a0, b0, c0), paeth(a1, b1, c1), paeth(a2, b2, c2)
                a0 = (np.int32(src[i]) + p0) & 255
                a1 = (np.int32(src[i + 1]) + p1) & 255
                a2 = (np.int32(src[i + 2]) + p2) & 255
                row[i] = a0
                row[i + 1] = a1
                row[i + 2] = a2
                c0, c1, c2 = b0, b1, b2
        else:
            for ch in range(bpp):  # each channel is an independent chain
                a = np.int32(0)  # left
                c = np.int32(0)  # upper left
                for i in range(ch, stride, bpp):
                    b = np.int32(up[i])
                    if f == 1:  # Sub
                        v = (np.int32(src[i]) + a) & 255
                    elif f == 3:  # Average
                        v = (np.int32(src[i]) + ((a + b) >> 1)) & 255
                    else:  # Paeth
                        v = (np.int32(src[i]) + paeth(a, b, c)) & 255
                    row[i] = v
                    a = v
                    c = b
    return -1
