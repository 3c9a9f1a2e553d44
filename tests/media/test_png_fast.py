"""The fast PNG path gives Pillow's pixels for every filter type, chunk split and size,
and leaves every PNG it does not take (or finds anything wrong in) to Pillow."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage

import media.png_fast as pf
from media import CorruptMediaError, Image
from media.hashing import content_hash

pytestmark = pytest.mark.skipif(not pf._kernel(), reason="numba is not installed")


# -- a PNG writer that applies the filters we choose (Pillow's encoder picks its own) -----


def _chunk(ctype: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + ctype + body + struct.pack(">I", zlib.crc32(ctype + body))


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else (b if pb <= pc else c)


def _filter_row(kind: int, row: np.ndarray, up: np.ndarray, bpp: int) -> bytes:
    x = row.astype(np.int32)
    u = up.astype(np.int32)
    left = np.concatenate([np.zeros(bpp, np.int32), x[:-bpp]])
    ul = np.concatenate([np.zeros(bpp, np.int32), u[:-bpp]])
    if kind == 0:
        pred = np.zeros_like(x)
    elif kind == 1:
        pred = left
    elif kind == 2:
        pred = u
    elif kind == 3:
        pred = (left + u) >> 1
    else:
        pred = np.array([_paeth(a, b, c) for a, b, c in zip(left, u, ul, strict=True)], np.int32)
    return bytes([kind]) + ((x - pred) & 255).astype(np.uint8).tobytes()


def write_png(
    pixels: np.ndarray,
    filters: list[int],
    *,
    idat_size: int = 8192,
    extra: list[tuple[bytes, bytes]] = (),
    stream: bytes | None = None,
) -> bytes:
    """An 8-bit RGB (h, w, 3) or grey (h, w) PNG, row y filtered with filters[y % len]."""
    h, w = pixels.shape[:2]
    grey = pixels.ndim == 2
    bpp = 1 if grey else 3
    rows = pixels.reshape(h, w * bpp)
    up = np.zeros(w * bpp, np.uint8)
    raw = b""
    for y in range(h):
        raw += _filter_row(filters[y % len(filters)], rows[y], up, bpp)
        up = rows[y]
    data = zlib.compress(raw, 6) if stream is None else stream
    out = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0 if grey else 2, 0, 0, 0))
    for ctype, body in extra:
        out += _chunk(ctype, body)
    for at in range(0, len(data), idat_size):
        out += _chunk(b"IDAT", data[at : at + idat_size])
    return out + _chunk(b"IEND", b"")


def _pillow(data: bytes) -> np.ndarray:
    with PILImage.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def _photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients plus noise: predictors matter, values cross 0/255."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([(xx * 3 + yy) % 256, (yy * 5) % 256, (xx * yy) % 256], axis=2)
    return ((base + rng.integers(-20, 21, (h, w, 3))) % 256).astype(np.uint8)


# -- pixels ---------------------------------------------------------------------------


@pytest.mark.parametrize("filters", [[0], [1], [2], [3], [4], [4, 2, 1, 3, 0], [2, 4]])
@pytest.mark.parametrize("grey", [False, True], ids=["rgb", "grey"])
def test_every_filter_equals_pillow(filters: list[int], grey: bool) -> None:
    pixels = _photo(23, 37)
    if grey:
        pixels = pixels[:, :, 1].copy()
    data = write_png(pixels, filters, idat_size=97)  # many small IDAT chunks
    got = pf.decode_png(data)
    assert got is not None and got.shape == (23, 37, 3)
    assert np.array_equal(got, _pillow(data))


def test_one_pixel_sides_and_pillow_written_files() -> None:
    for shape in ((1, 1, 3), (1, 50, 3), (50, 1, 3)):
        px = _photo(*shape[:2], seed=2)
        for filters in ([4], [3], [1, 2]):
            data = write_png(px, filters)
            assert np.array_equal(pf.decode_png(data), _pillow(data))
    rng = np.random.default_rng(5)
    for trial in range(12):
        h, w = (int(v) for v in rng.integers(1, 120, 2))
        im = PILImage.fromarray(_photo(h, w, seed=trial)).convert("L" if trial % 3 == 0 else "RGB")
        buf = io.BytesIO()
        im.save(buf, "PNG", optimize=bool(trial % 2))
        assert np.array_equal(pf.decode_png(buf.getvalue()), _pillow(buf.getvalue()))


@pytest.mark.parametrize("chunk_bytes", [1, 5000, 1 << 17])
def test_pipelined_inflate_over_chunk_boundaries(chunk_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large image is inflated on a pool thread while its rows are unfiltered here; chunk
    sizes from one row at a time up make rows land on every kind of boundary."""
    monkeypatch.setattr(pf, "PIPELINE_MIN_BYTES", 0)
    monkeypatch.setattr(pf, "PIPELINE_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(pf, "default_bands", lambda: 2)
    px = _photo(301, 257, seed=9)
    data = write_png(px, [4, 1, 2, 3, 0, 4, 4])
    assert np.array_equal(pf.decode_png(data), px)
    grey = write_png(px[:, :, 0].copy(), [3, 4])
    assert np.array_equal(pf.decode_png(grey), _pillow(grey))


def test_real_photo_png(samples: Path) -> None:
    data = (samples / "images" / "photo_1024x768.png").read_bytes()
    assert np.array_equal(pf.decode_png(data), _pillow(data))


# -- what is left to Pillow --------------------------------------------------------------


def _pillow_encoded(mode: str, **save: object) -> bytes:
    im = PILImage.fromarray(_photo(20, 30)).convert(mode)
    buf = io.BytesIO()
    im.save(buf, "PNG", **save)
    return buf.getvalue()


@pytest.mark.parametrize(
    "data",
    [
        _pillow_encoded("RGBA"),
        _pillow_encoded("P"),
        _pillow_encoded("LA"),
        _pillow_encoded("I;16"),
        _pillow_encoded("1"),
        _pillow_encoded("RGB", transparency=(1, 2, 3)),
        write_png(_photo(8, 8), [0], extra=[(b"eXIf", b"MM\x00*\x00\x00\x00\x08\x00\x00")]),
        write_png(_photo(8, 8), [0], extra=[(b"tEXt", b"Raw profile type exif\x00\nexif\n 4\n00000000")]),
        write_png(_photo(8, 8), [0], extra=[(b"acTL", struct.pack(">II", 1, 0))]),
    ],
    ids=["rgba", "palette", "la", "16-bit", "1-bit", "trns", "exif", "exif-text", "apng"],
)
def test_other_pngs_are_left_to_pillow(data: bytes) -> None:
    assert pf.decode_png(data) is None
    img = Image.from_bytes(data)  # Pillow's path decodes them as before
    assert img._pil is not None


def test_interlaced_is_left_to_pillow() -> None:
    data = bytearray(write_png(_photo(8, 8), [0]))
    data[8 + 8 + 12] = 1  # IHDR interlace byte
    body = bytes(data[12:29])
    data[29:33] = struct.pack(">I", zlib.crc32(body))
    assert pf.decode_png(bytes(data)) is None


@pytest.mark.parametrize("pipelined", [False, True])
def test_bad_data_is_left_to_pillow_and_its_error(pipelined: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if pipelined:
        monkeypatch.setattr(pf, "PIPELINE_MIN_BYTES", 0)
        monkeypatch.setattr(pf, "PIPELINE_CHUNK_BYTES", 300)
        monkeypatch.setattr(pf, "default_bands", lambda: 2)
    px = _photo(40, 40)
    # An unknown filter type (5) in a late row: CRCs valid, the stream valid.
    raw = bytearray()
    for y in range(40):
        raw += bytes([5 if y == 33 else 0]) + px[y].tobytes()
    bad_filter = write_png(px, [0], stream=zlib.compress(bytes(raw)))
    assert pf.decode_png(bad_filter) is None
    with pytest.raises(CorruptMediaError):
        Image.from_bytes(bad_filter)
    # A damaged deflate stream (valid CRCs): Pillow's error, as before.
    stream = bytearray(zlib.compress(bytes(raw).replace(b"\x05", b"\x00")))
    stream[len(stream) // 2 : len(stream) // 2 + 8] = b"\xff" * 8
    damaged = write_png(px, [0], stream=bytes(stream))
    assert pf.decode_png(damaged) is None
    with pytest.raises(CorruptMediaError):
        Image.from_bytes(damaged)


def test_short_stream_keeps_pillows_behaviour() -> None:
    """A stream that ends cleanly before the last row: this path declines, and the image
    decodes exactly as it did before it existed (media.image documents the behaviour)."""
    px = _photo(30, 30)
    raw = b"".join(b"\x00" + px[y].tobytes() for y in range(20))  # 20 of 30 rows
    data = write_png(px, [0], stream=zlib.compress(raw))
    assert pf.decode_png(data) is None
    with PILImage.open(io.BytesIO(data)) as im:
        try:
            expected = np.asarray(im.convert("RGB"))
        except OSError:
            expected = None
    if expected is None:
        with pytest.raises(CorruptMediaError):
            Image.from_bytes(data)
    else:
        assert np.array_equal(Image.from_bytes(data).to_numpy(), expected)


def test_image_from_bytes_takes_the_fast_path(samples: Path) -> None:
    data = (samples / "images" / "photo_1024x768.png").read_bytes()
    img = Image.from_bytes(data)
    assert img._pil is None and img._array is not None  # decoded here, not by Pillow
    assert (img.format, img.source_mode, img.size) == ("PNG", "RGB", (1024, 768))
    assert img.content_hash == content_hash(data)
    assert np.array_equal(img.to_numpy(), _pillow(data))
    assert not img.to_numpy().flags.writeable
    grey = write_png(_photo(12, 9)[:, :, 0].copy(), [4])
    g = Image.from_bytes(grey)
    assert g.source_mode == "L" and np.array_equal(g.to_numpy(), _pillow(grey))


def test_limits_are_checked_before_inflating() -> None:
    from media import MediaLimits, MediaTooLargeError

    data = write_png(_photo(64, 64), [0])
    with pytest.raises(MediaTooLargeError):
        Image.from_bytes(data, MediaLimits(max_image_pixels=64 * 64 - 1))


@pytest.mark.parametrize("pipelined", [False, True])
def test_meanwhile_runs_once_and_its_error_propagates(
    pipelined: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if pipelined:
        monkeypatch.setattr(pf, "PIPELINE_MIN_BYTES", 0)
        monkeypatch.setattr(pf, "PIPELINE_CHUNK_BYTES", 500)
        monkeypatch.setattr(pf, "default_bands", lambda: 2)
    px = _photo(50, 60)
    data = write_png(px, [4, 2])
    calls: list[int] = []
    assert np.array_equal(pf.decode_png(data, meanwhile=lambda: calls.append(1)), px)
    assert calls == [1]

    def boom() -> None:
        raise RuntimeError("hashing failed")

    with pytest.raises(RuntimeError, match="hashing failed"):
        pf.decode_png(data, meanwhile=boom)
    # A PNG this path declines does not run it: the caller does that work itself.
    assert pf.decode_png(_pillow_encoded("RGBA"), meanwhile=boom) is None


def test_pillow_path_reports_a_bad_filter_byte_too() -> None:
    """The bug the fast path's tests found (it was on main before it): reading EXIF loaded
    the pixels and swallowed the decode error, so an RGBA PNG (Pillow's path) with an
    unknown filter byte decoded half-filled. It is corrupt."""
    rgba = np.dstack([_photo(16, 16), np.full((16, 16), 200, np.uint8)])
    raw = b"".join(bytes([7 if y == 10 else 0]) + rgba[y].tobytes() for y in range(16))
    data = (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", struct.pack(">IIBBBBB", 16, 16, 8, 6, 0, 0, 0))
        + _chunk(b"IDAT", zlib.compress(raw))
        + _chunk(b"IEND", b"")
    )
    assert pf.decode_png(data) is None
    with pytest.raises(CorruptMediaError, match="malformed|truncated"):
        Image.from_bytes(data)
