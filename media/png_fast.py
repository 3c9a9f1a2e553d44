"""A fast decode for the most common PNG: 8-bit RGB or grey, not interlaced, no
transparency, no animation, no EXIF orientation. Every other PNG (and any PNG this
path finds anything odd in) is left to Pillow, which also gives every error.

Why by hand: PNG is lossless, so any correct decoder gives the reference's pixels, but
Pillow's is slow here (15-17 ms for a 1024x768 photo, more than everything else our
preparation does) and the faster libraries we measured are not faster enough
(libspng through pyspng: ~10.6 ms). The work is two steps: inflate the concatenated
IDAT data (``isal``'s zlib-compatible inflate where it is installed, ~1.6x zlib's speed;
``zlib`` otherwise), then undo the per-row filters (None, Sub, Up, Average, Paeth) in a
numba kernel; for a large image the two run at once (the inflate on a pool thread,
a chunk of rows at a time, the unfilter on the caller's). Output is bounded by the header's size (which the caller has checked
against the limits): the inflater is never asked for more than the exact image size.

Checked before this runs: every chunk's CRC (:func:`media.integrity.verify_png`) and the
size limits. What returns ``None`` (Pillow decodes): another bit depth or colour type,
interlacing, a ``tRNS``/``acTL``/``eXIf`` chunk or EXIF in a text chunk, a zlib error, a stream that ends early
(Pillow's behaviour for those is kept, see :mod:`media.image`), an unknown filter byte,
or numba missing.
"""

from __future__ import annotations

import logging
import struct
import threading
import zlib
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

import numpy as np

from media.integrity import PNG_SIGNATURE
from media.worker_pool import default_bands, executor, in_pool

__all__ = ["decode_png"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I4s")
_IHDR = struct.Struct(">IIBBBBB")
# Chunks that change the pixels or the picture's orientation: Pillow handles them.
_DEFER = frozenset({b"tRNS", b"acTL", b"eXIf", b"fcTL"})
# Pillow also reads EXIF (and so an orientation) from a text chunk of this name.
_TEXT = frozenset({b"tEXt", b"zTXt", b"iTXt"})
_EXIF_TEXT = b"Raw profile type exif"

# Images whose filtered data exceed this are inflated and unfiltered on two threads,
# in chunks of about PIPELINE_CHUNK_BYTES.
PIPELINE_MIN_BYTES = 1 << 19
PIPELINE_CHUNK_BYTES = 1 << 17

_unfilter: Any = None
_unfilter_lock = threading.Lock()


def _kernel() -> Any:
    """The numba unfilter kernel (compiled or loaded from numba's cache on first use), or
    ``False`` where numba is unavailable."""
    global _unfilter
    with _unfilter_lock:
        if _unfilter is None:
            try:
                import numba
            except ImportError:
                _unfilter = False
                return _unfilter

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

            _unfilter = unfilter
        return _unfilter


def _inflater() -> Any:
    try:
        from isal import isal_zlib

        return isal_zlib.decompressobj()
    except ImportError:
        return zlib.decompressobj()


def _inflate_chunks(data: bytes, row_bytes: int, rows: int, chunk_rows: int) -> Any:
    """The inflated image, ``chunk_rows`` whole rows at a time (never more than ``rows``
    rows in all); stops early at the end of the stream. zlib errors propagate."""
    inflater = _inflater()
    left = rows
    tail = data
    while left > 0:
        want = min(chunk_rows, left) * row_bytes
        chunk = inflater.decompress(tail, want)
        tail = inflater.unconsumed_tail
        if len(chunk) != want:
            if chunk:
                yield chunk
            return
        yield chunk
        left -= want // row_bytes


def _inflate_and_unfilter(
    data: bytes, out: np.ndarray, bpp: int, unfilter: Any, meanwhile: Callable[[], object] | None
) -> bool:
    """Fill ``out`` from the zlib ``data``; False where the stream is bad or short, or a row
    has an unknown filter. A large image is inflated on a pool thread while this thread
    undoes the filters of the rows already inflated (the two halves take about as long)."""
    height, stride = out.shape
    row_bytes = stride + 1
    if height * row_bytes < PIPELINE_MIN_BYTES or default_bands() < 2 or in_pool():
        if meanwhile is not None:
            meanwhile()
        try:
            raw = _inflater().decompress(data, height * row_bytes)
        except Exception:  # zlib.error, or isal's own error type: Pillow reports it
            return False
        if len(raw) != height * row_bytes:
            return False
        return unfilter(np.frombuffer(raw, np.uint8), out, bpp, 0) == -1

    chunk_rows = max(1, PIPELINE_CHUNK_BYTES // row_bytes)
    queue: SimpleQueue[Any] = SimpleQueue()
    stop = threading.Event()

    def produce() -> None:
        try:
            for chunk in _inflate_chunks(data, row_bytes, height, chunk_rows):
                if stop.is_set():
                    return
                queue.put(chunk)
            queue.put(None)
        except BaseException as e:  # handed to the consumer, which gives up
            queue.put(e)

    executor().submit(produce)
    y = 0
    try:
        if meanwhile is not None:  # this thread would wait for the first rows anyway
            meanwhile()
        while True:
            item = queue.get()
            if item is None:
                return y == height
            if isinstance(item, BaseException):
                return False
            if len(item) % row_bytes or unfilter(np.frombuffer(item, np.uint8), out, bpp, y) != -1:
                return False
            y += len(item) // row_bytes
    finally:
        stop.set()


def decode_png(data: bytes, *, meanwhile: Callable[[], object] | None = None) -> np.ndarray | None:
    """``(height, width, 3)`` uint8 RGB pixels of an 8-bit RGB or grey PNG without
    interlacing, transparency, animation or EXIF, exactly as Pillow decodes them (then
    converts grey to RGB); ``None`` for any other PNG, or where this path is unavailable.
    ``data`` must have passed :func:`media.integrity.verify_png` and the size limits.

    ``meanwhile`` (the caller's other work on the same bytes, such as hashing them) is
    called once on this thread while the inflate runs, if this path decodes the image;
    an exception from it propagates."""
    if not data.startswith(PNG_SIGNATURE) or len(data) < 33:
        return None
    view = memoryview(data)
    length, ctype = _HEADER.unpack_from(view, 8)
    if ctype != b"IHDR" or length != 13:
        return None
    width, height, depth, colour, compression, filtering, interlace = _IHDR.unpack_from(view, 16)
    if depth != 8 or colour not in (0, 2) or compression or filtering or interlace or not width or not height:
        return None
    idat: list[memoryview] = []
    at = 8
    end = len(view)
    while at + 12 <= end:
        length, ctype = _HEADER.unpack_from(view, at)
        body = at + 8
        if ctype in _DEFER or (ctype in _TEXT and bytes(view[body : body + len(_EXIF_TEXT)]) == _EXIF_TEXT):
            return None
        if ctype == b"IDAT":
            idat.append(view[body : body + length])
        elif ctype == b"IEND":
            break
        at = body + length + 4
    if not idat:
        return None
    unfilter = _kernel()
    if not unfilter:
        return None
    bpp = 3 if colour == 2 else 1
    stride = width * bpp
    out = np.empty((height, stride), np.uint8)
    ok = _inflate_and_unfilter(b"".join(idat), out, bpp, unfilter, meanwhile)
    if not ok:
        return None
    if bpp == 3:
        return out.reshape(height, width, 3)
    rgb = np.empty((height, width, 3), np.uint8)
    rgb[...] = out[:, :, None]
    return rgb
