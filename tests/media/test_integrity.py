"""Formats' own integrity data is checked: damaged PNG/APNG pixels are corrupt, not garbage."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image as PILImage

from media import CorruptMediaError, Image, Video, decode_data_url
from media.integrity import verify_png


def _png(frames: int = 1) -> bytes:
    rng = np.random.default_rng(0)
    ims = [PILImage.fromarray(rng.integers(0, 255, (32, 48, 3), dtype=np.uint8)) for _ in range(frames)]
    buf = io.BytesIO()
    if frames == 1:
        ims[0].save(buf, "PNG")
    else:
        ims[0].save(buf, "PNG", save_all=True, append_images=ims[1:], duration=100, loop=0)
    return buf.getvalue()


def _chunk_offset(data: bytes, ctype: bytes) -> int:
    at = 8
    while at < len(data):
        length, t = struct.unpack_from(">I4s", data, at)
        if t == ctype:
            return at
        at += 12 + length
    raise AssertionError(ctype)


def _flip_in(data: bytes, ctype: bytes) -> bytes:
    at = _chunk_offset(data, ctype)
    b = bytearray(data)
    b[at + 8 + 20] ^= 0x01  # one bit of the chunk's data; its CRC now disagrees
    return bytes(b)


def test_valid_png_passes_and_decodes() -> None:
    data = _png()
    verify_png(data)
    assert Image.from_bytes(data).size == (48, 32)


def test_flipped_bit_in_pixel_data_is_corrupt_and_says_crc() -> None:
    """The CRC names the damaged chunk before any decoder runs (zlib alone may or may not
    notice, and when it does, its message does not say the file is damaged)."""
    with pytest.raises(CorruptMediaError, match="'IDAT'.*CRC"):
        Image.from_bytes(_flip_in(_png(), b"IDAT"))


def test_truncated_chunk_and_missing_iend_are_corrupt() -> None:
    data = _png()
    with pytest.raises(CorruptMediaError, match="truncated"):
        verify_png(data[: _chunk_offset(data, b"IDAT") + 30])
    with pytest.raises(CorruptMediaError, match="truncated"):
        verify_png(data[: _chunk_offset(data, b"IEND")])


def test_bytes_after_iend_are_ignored() -> None:
    verify_png(_png() + b"trailing junk")


def test_apng_frame_data_crc_checked_by_video() -> None:
    data = _png(frames=3)
    assert Video.from_bytes(data).info.frame_count == 3
    with pytest.raises(CorruptMediaError, match="CRC"):
        Video.from_bytes(_flip_in(data, b"fdAT"))


def test_crc_matches_zlib_definition() -> None:
    data = _png()
    at = _chunk_offset(data, b"IHDR")
    length = struct.unpack_from(">I", data, at)[0]
    assert zlib.crc32(data[at + 4 : at + 8 + length]) == struct.unpack_from(">I", data, at + 8 + length)[0]


@pytest.mark.parametrize(
    ("kind", "mime"),
    [("image", "image/png"), ("audio", "audio/wav"), ("video", "video/mp4"), ("video", "image/gif")],
)
def test_decode_data_url_for_each_kind(kind: str, mime: str) -> None:
    import base64

    assert decode_data_url(f"data:{mime};base64,{base64.b64encode(b'abc').decode()}", kind=kind) == b"abc"


def test_decode_data_url_refuses_other_kinds_and_schemes() -> None:
    from media import InvalidRequestError, UnsupportedFormatError

    with pytest.raises(UnsupportedFormatError):
        decode_data_url("data:text/plain;base64,YQ==", kind="audio")
    with pytest.raises(InvalidRequestError):
        decode_data_url("https://example.com/a.wav", kind="audio")
    with pytest.raises(InvalidRequestError):
        decode_data_url("data:audio/wav,plain", kind="audio")
