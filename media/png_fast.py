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
    """The numba unfilter kernel (:mod:`media.png_unfilter`; compiled, or loaded from
    numba's cache, on its first call), or ``False`` where numba is unavailable."""
    global _unfilter
    with _unfilter_lock:
        if _unfilter is None:
            try:
                from media.png_unfilter import unfilter
            except ImportError:
                unfilter = False
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
