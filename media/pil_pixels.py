"""A zero-copy numpy view of a Pillow image's pixel memory, through Pillow's Arrow export.

Why by hand: ``np.asarray(pil_image)`` goes through ``tobytes()``, which packs Pillow's
4-bytes-per-pixel storage into a new 3-bytes-per-pixel buffer (a 12 MP photo: ~20 ms
and 36 MB here). Pillow (>= 11.2) exports its memory through the Arrow C data
interface (``__arrow_c_array__``), but numpy cannot import Arrow, and pyarrow is a heavy
import for one pointer. The Arrow C structure is a stable ABI, so reading its buffer
pointer with ctypes takes a few lines.

Pillow stores ``RGB`` as ``RGBX`` (the fourth byte is padding), so an RGB image is viewed
as ``(height, width, 4)`` and readers use the first three channels; ``L`` is
``(height, width)``. Only images whose rows are one memory block can be exported:
Pillow's default allocator splits images over 16 MB into several blocks, so
:func:`single_block_images` asks it (process-wide) to allocate every image in one block,
which is what Pillow's own documentation gives for zero-copy Arrow access. Where any of
this is unavailable, :func:`pixel_view` returns ``None`` and callers copy as before.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np
from PIL import Image as PILImage

__all__ = ["pixel_view", "single_block_images"]

log = logging.getLogger(__name__)

_CHANNELS = {"RGB": 4, "RGBA": 4, "RGBX": 4, "L": 1}


class _ArrowArray(ctypes.Structure):
    pass


_ArrowArray._fields_ = [
    ("length", ctypes.c_int64),
    ("null_count", ctypes.c_int64),
    ("offset", ctypes.c_int64),
    ("n_buffers", ctypes.c_int64),
    ("n_children", ctypes.c_int64),
    ("buffers", ctypes.POINTER(ctypes.c_void_p)),
    ("children", ctypes.POINTER(ctypes.POINTER(_ArrowArray))),
    ("dictionary", ctypes.c_void_p),
    ("release", ctypes.c_void_p),
    ("private_data", ctypes.c_void_p),
]

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _View:
    """Owner of an exported Arrow array: numpy's ``base`` for the view, so the capsule
    (whose destructor releases the export) and the image live as long as the array."""

    def __init__(self, image: PILImage.Image, capsule: Any, address: int, shape: tuple[int, ...]):
        self._image = image
        self._capsule = capsule
        self.__array_interface__ = {
            "data": (address, True),  # read-only
            "shape": shape,
            "typestr": "|u1",
            "version": 3,
        }


def _data_buffer(arr: _ArrowArray, expected_bytes: int) -> int | None:
    # uint8 array: buffers = [validity, data]; fixed-size list: one child holding the bytes.
    if arr.n_children == 1 and arr.n_buffers == 1:
        if arr.offset != 0:
            return None
        child = arr.children[0].contents
        return _data_buffer(child, expected_bytes)
    if arr.n_children == 0 and arr.n_buffers == 2 and arr.offset == 0 and arr.length == expected_bytes:
        return arr.buffers[1] or None
    return None


def pixel_view(image: PILImage.Image) -> np.ndarray | None:
    """A read-only ``(h, w, 4)`` (RGB/RGBA/RGBX) or ``(h, w)`` (L) uint8 view of
    ``image``'s pixels without copying them, or ``None`` where Pillow cannot export them
    in one piece (rows in several blocks, an old Pillow, another mode)."""
    channels = _CHANNELS.get(image.mode)
    if channels is None or not hasattr(image, "__arrow_c_array__"):
        return None
    w, h = image.size
    if w == 0 or h == 0:
        return None
    try:
        image.load()
        _schema, capsule = image.__arrow_c_array__()
    except (ValueError, OSError, AttributeError):
        return None
    try:
        arr = _ArrowArray.from_address(_get_pointer(capsule, b"arrow_array"))
        if arr.length != w * h:
            return None
        address = _data_buffer(arr, w * h * channels)
    except (ValueError, TypeError):
        return None
    if address is None:
        return None
    shape = (h, w, channels) if channels > 1 else (h, w)
    return np.asarray(_View(image, capsule, address, shape))


_single_block: bool | None = None


def single_block_images() -> bool:
    """Ask Pillow to allocate each image in one block (so :func:`pixel_view` works for
    images over Pillow's 16 MB block size too). Process-wide and idempotent; the
    pixels and Pillow's behaviour are unchanged, only how the memory is obtained.
    Returns whether the setting is on."""
    global _single_block
    if _single_block is None:
        core = PILImage.core
        try:
            if not core.get_use_block_allocator():
                core.set_use_block_allocator(1)
            _single_block = bool(core.get_use_block_allocator())
        except AttributeError:
            _single_block = False
    return _single_block
