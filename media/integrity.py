"""Integrity data that formats carry, checked before decoding, so damaged files are
reported as corrupt instead of decoded into garbage pixels.

PNG: every chunk has a CRC-32 over its type and data. Pillow checks the CRCs of the
header chunks it parses but skips those of the image data (IDAT / fdAT), so a flipped
bit in the pixels decodes silently into wrong pixels. zlib's CRC-32 runs at several
GB/s, so checking every chunk costs far less than decoding. (Written here because no
library exposes a check-only PNG chunk walk.)
"""

from __future__ import annotations

import struct
import zlib

from media.errors import CorruptMediaError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_HEADER = struct.Struct(">I4s")


try:  # isal's CRC-32 is ~10x zlib's here (same values); zlib where it is not installed
    from isal.isal_zlib import crc32 as _crc32
except ImportError:
    _crc32 = zlib.crc32


def verify_png(data: bytes | memoryview, *, kind: str = "image") -> None:
    """Raise ``CorruptMediaError`` unless every chunk of the PNG ``data`` (up to IEND)
    is whole and its CRC matches. Bytes after IEND are ignored, as decoders do."""
    view = memoryview(data)
    if bytes(view[:8]) != PNG_SIGNATURE:
        raise CorruptMediaError("not a PNG signature", kind=kind)
    at, end = 8, len(view)
    while True:
        if at + 12 > end:
            raise CorruptMediaError(
                f"PNG is truncated: chunk header at byte {at} is cut off (no IEND)", kind=kind
            )
        length, ctype = _HEADER.unpack_from(view, at)
        body_end = at + 8 + length
        if length > 0x7FFFFFFF or body_end + 4 > end:
            name = ctype.decode("latin-1")
            raise CorruptMediaError(
                f"PNG is truncated: the {name!r} chunk at byte {at} declares {length} bytes past the end",
                kind=kind,
            )
        stored = struct.unpack_from(">I", view, body_end)[0]
        if _crc32(view[at + 4 : body_end]) != stored:
            name = ctype.decode("latin-1")
            raise CorruptMediaError(
                f"PNG chunk {name!r} at byte {at} fails its CRC check (damaged data)", kind=kind
            )
        if ctype == b"IEND":
            return
        at = body_end + 4
