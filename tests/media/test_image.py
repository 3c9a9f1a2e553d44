"""media.Image: every format and mode, orientation, compositing, limits, hostile input,
reduced decode, hashing, and fuzzing (only MediaError may escape from_bytes)."""

from __future__ import annotations

import base64
import json
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image as PILImage
from PIL import ImageFile, ImageOps

from media import (
    CorruptMediaError,
    EmptyMediaError,
    Image,
    InvalidRequestError,
    MediaError,
    MediaLimits,
    MediaTooLargeError,
    UnsupportedFormatError,
)
from media.image import EXCLUDED_FORMATS

FAST = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)

# Fuzzed headers may declare anything: keep accidental allocations small and quick.
FUZZ_LIMITS = MediaLimits(max_image_pixels=2_000_000, max_image_side=4096)


@pytest.fixture(scope="session")
def images(samples: Path) -> Path:
    return samples / "images"


@pytest.fixture(scope="session")
def hostile(samples: Path) -> Path:
    return samples / "hostile"


def load(images: Path, name: str, **kw) -> Image:
    return Image.from_path(images / name, **kw)


def close(pixel, expected, tol: int = 3) -> bool:
    return bool(np.all(np.abs(np.asarray(pixel, dtype=int) - np.asarray(expected, dtype=int)) <= tol))


# ---------------------------------------------------------------------- formats and modes

FORMATS = [
    # name, format, (width, height) as displayed, source mode
    ("photo_640x480.jpg", "JPEG", (640, 480), "RGB"),
    ("photo_4032x3024.jpg", "JPEG", (4032, 3024), "RGB"),
    ("photo_1024x768.png", "PNG", (1024, 768), "RGB"),
    ("exif_rotated_6.jpg", "JPEG", (480, 640), "RGB"),
    ("rgba.png", "PNG", (96, 48), "RGBA"),
    ("la.png", "PNG", (64, 32), "LA"),
    ("p_transparent.png", "PNG", (64, 32), "P"),
    ("cmyk.jpg", "JPEG", (256, 64), "CMYK"),
    ("gray16.png", "PNG", (256, 3), "I;16"),
    ("rgb16.png", "PNG", (64, 4), "RGB"),
    ("gray.png", "PNG", (256, 32), "L"),
    ("bilevel.png", "PNG", (64, 48), "1"),
    ("lossy.webp", "WEBP", (320, 240), "RGB"),
    ("lossless_rgba.webp", "WEBP", (64, 32), "RGBA"),
    ("animated.gif", "GIF", (64, 48), "P"),
    ("image.bmp", "BMP", (96, 64), "RGB"),
    ("image.tiff", "TIFF", (96, 64), "RGB"),
    ("image.tga", "TGA", (96, 64), "RGB"),
    ("image.ppm", "PPM", (96, 64), "RGB"),
    ("icon.ico", "ICO", (64, 43), "RGB"),
    ("float.tif", "TIFF", (64, 16), "F"),
    ("image.avif", "AVIF", (96, 64), "RGB"),
    ("odd_1x37.png", "PNG", (1, 37), "RGB"),
    ("odd_37x1.png", "PNG", (37, 1), "RGB"),
    ("odd_7x13.png", "PNG", (7, 13), "RGB"),
    ("odd_7x13.jpg", "JPEG", (7, 13), "RGB"),
]


@pytest.mark.parametrize(("name", "fmt", "size", "mode"), FORMATS, ids=[f[0] for f in FORMATS])
def test_every_format_decodes_to_rgb_uint8(images: Path, name: str, fmt: str, size, mode: str) -> None:
    path = images / name
    if not path.exists():
        pytest.skip(f"{name} not built here (codec missing)")
    img = Image.from_path(path)
    assert img.format == fmt
    assert img.size == size == (img.width, img.height)
    assert img.source_mode == mode
    arr = img.to_numpy()
    assert arr.dtype == np.uint8 and arr.shape == (size[1], size[0], 3)
    assert arr.flags.c_contiguous
    assert img.nbytes == arr.nbytes
    pil = img.to_pil()
    assert pil.mode == "RGB" and pil.size == size
    assert np.array_equal(np.asarray(pil), arr)


def test_exif_orientation_applied(images: Path) -> None:
    img = load(images, "exif_rotated_6.jpg")
    assert img.size == (480, 640) and img.source_size == (480, 640)
    a = img.to_numpy()
    # Stored quadrants red/green (top), blue/yellow (bottom), rotated 90 degrees clockwise.
    assert close(a[10, 10], (0, 0, 255), 8)  # top-left: blue
    assert close(a[10, -10], (255, 0, 0), 8)  # top-right: red
    assert close(a[-10, -10], (0, 255, 0), 8)  # bottom-right: green
    assert close(a[-10, 10], (255, 255, 0), 8)  # bottom-left: yellow
    ref = np.asarray(ImageOps.exif_transpose(PILImage.open(images / "exif_rotated_6.jpg")).convert("RGB"))
    assert np.array_equal(a, ref)


def test_rgba_composited_over_background(images: Path) -> None:
    a = load(images, "rgba.png").to_numpy()
    assert close(a[5, 10], (255, 255, 255), 0)  # alpha 0 (blue underneath) -> white
    assert close(a[5, 48], (127, 255, 127), 1)  # green at alpha 128 over white
    assert close(a[5, 80], (255, 0, 0), 0)  # opaque red
    black = Image.from_path(images / "rgba.png", background=(0, 0, 0)).to_numpy()
    assert close(black[5, 10], (0, 0, 0), 0)
    assert close(black[5, 48], (0, 128, 0), 1)
    assert close(black[5, 80], (255, 0, 0), 0)


@pytest.mark.parametrize("name", ["la.png", "p_transparent.png", "lossless_rgba.webp"])
def test_transparent_modes_composite(images: Path, name: str) -> None:
    a = load(images, name).to_numpy()
    assert close(a[5, 5], (255, 255, 255), 0)
    opaque = {"la.png": (0, 0, 0), "p_transparent.png": (255, 0, 0), "lossless_rgba.webp": (255, 0, 0)}[name]
    assert close(a[5, -5], opaque, 0)
    grey = Image.from_path(images / name, background=(10, 20, 30)).to_numpy()
    assert close(grey[5, 5], (10, 20, 30), 0)


def test_cmyk_colours(images: Path) -> None:
    a = load(images, "cmyk.jpg").to_numpy().astype(int)
    for i, rgb in enumerate([(0, 255, 255), (255, 0, 255), (255, 255, 0), (0, 0, 0)]):
        assert close(a[32, 64 * i + 32], rgb, 40), (i, a[32, 64 * i + 32])


def test_sixteen_bit_grey_keeps_high_byte(images: Path) -> None:
    a = load(images, "gray16.png").to_numpy()
    x = np.arange(256, dtype=np.uint8)
    for row in range(3):  # x*257, x*256+255 and x*256 all read back as x
        assert np.array_equal(a[row, :, 0], x)
        assert np.array_equal(a[row, :, 1], x) and np.array_equal(a[row, :, 2], x)


def test_sixteen_bit_rgb(images: Path) -> None:
    a = load(images, "rgb16.png").to_numpy()
    assert np.array_equal(a[0, :, 0], np.arange(64, dtype=np.uint8) * 4)
    assert np.all(a[..., 1] == 255) and np.all(a[..., 2] == 0x80)


def test_float_tiff_ramp(images: Path) -> None:
    row = load(images, "float.tif").to_numpy()[0, :, 0].astype(int)
    assert row[0] == 0 and row[-1] == 255 and np.all(np.diff(row) >= 0)


def test_grey_bilevel_gif(images: Path) -> None:
    g = load(images, "gray.png").to_numpy()
    assert np.array_equal(g[0, :, 0], np.arange(256)) and np.array_equal(g[..., 0], g[..., 2])
    b = load(images, "bilevel.png").to_numpy()
    assert set(np.unique(b).tolist()) == {0, 255}
    assert close(b[0, 0], (0, 0, 0), 0) and close(b[0, 8], (255, 255, 255), 0)
    gif = load(images, "animated.gif").to_numpy()
    assert np.all(gif == np.array([255, 0, 0], dtype=np.uint8))  # first of four frames


# ---------------------------------------------------------------------- other constructors


def test_data_url_round_trip(images: Path) -> None:
    data = (images / "rgba.png").read_bytes()
    b64 = base64.b64encode(data).decode()
    direct = Image.from_bytes(data)
    via_url = Image.from_data_url(f"data:image/png;base64,{b64}")
    assert via_url.content_hash == direct.content_hash
    assert np.array_equal(via_url.to_numpy(), direct.to_numpy())
    # Declared subtype is not trusted, whitespace and missing padding are tolerated.
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76)).rstrip("=")
    assert (
        Image.from_data_url(f"DATA:image/jpeg;name=x.png;base64,{wrapped}").content_hash
        == direct.content_hash
    )
    small = Image.from_data_url(f"data:image/png;base64,{b64}", background=(0, 0, 0))
    assert small.content_hash != direct.content_hash


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("https://example.com/cat.png", InvalidRequestError),
        ("http://169.254.169.254/latest/meta-data", InvalidRequestError),
        ("file:///etc/passwd", InvalidRequestError),
        ("cat.png", InvalidRequestError),
        ("data:text/plain;base64,aGVsbG8=", UnsupportedFormatError),
        ("data:;base64,aGVsbG8=", UnsupportedFormatError),
        ("data:image/png,%89PNG", InvalidRequestError),
        ("data:image/png;base64", InvalidRequestError),
        ("data:image/png;base64,@@@@", InvalidRequestError),
        ("data:image/png;base64,", EmptyMediaError),
        (
            "data:image/svg+xml;base64,"
            + base64.b64encode(b"<svg xmlns='http://www.w3.org/2000/svg'/>").decode(),
            UnsupportedFormatError,
        ),
    ],
)
def test_data_url_refusals(url: str, error: type[MediaError]) -> None:
    with pytest.raises(error):
        Image.from_data_url(url)


def test_data_url_size_checked_before_decoding() -> None:
    limits = MediaLimits(max_bytes=1000)
    with pytest.raises(MediaTooLargeError) as e:
        Image.from_data_url("data:image/png;base64," + "A" * 10_000, limits)
    assert e.value.actual > e.value.limit


def test_from_pil_and_from_array(images: Path) -> None:
    img = load(images, "photo_640x480.jpg")
    arr = img.to_numpy()
    a = Image.from_array(arr)
    p = Image.from_pil(PILImage.fromarray(arr))
    assert np.array_equal(a.to_numpy(), arr) and np.array_equal(p.to_numpy(), arr)
    assert a.content_hash == p.content_hash != img.content_hash
    # from_pil hashes band by band (256 rows): an odd height over several bands, and one
    # shorter than a band, still hash like the whole array.
    for h in (757, 13):
        cut = PILImage.open(images / "photo_4032x3024.jpg").convert("RGB").crop((5, 7, 1006, 7 + h))
        assert Image.from_pil(cut).content_hash == Image.from_array(np.asarray(cut)).content_hash
    # from_pil on a lazily opened file applies the same normalisation as from_bytes.
    rot = Image.from_pil(PILImage.open(images / "exif_rotated_6.jpg"))
    assert np.array_equal(rot.to_numpy(), load(images, "exif_rotated_6.jpg").to_numpy())
    src = PILImage.open(images / "rgba.png")
    assert np.array_equal(Image.from_pil(src).to_numpy(), load(images, "rgba.png").to_numpy())
    assert src.mode == "RGBA"  # caller's image untouched
    # The array is copied: mutating the caller's array does not reach the image.
    mine = arr.copy()
    held = Image.from_array(mine)
    mine[:] = 0
    assert np.array_equal(held.to_numpy(), arr)
    grey = Image.from_array(np.full((4, 5), 7, dtype=np.uint8))
    assert grey.size == (5, 4) and np.all(grey.to_numpy() == 7)
    rgba = np.zeros((2, 2, 4), dtype=np.uint8)
    assert np.all(Image.from_array(rgba).to_numpy() == 255)  # transparent -> white
    for bad in (np.zeros((2, 2), dtype=np.float32), np.zeros((2, 2, 2), dtype=np.uint8), [[1, 2]]):
        with pytest.raises(InvalidRequestError):
            Image.from_array(bad)  # type: ignore[arg-type]
    with pytest.raises(MediaTooLargeError):
        Image.from_array(np.zeros((10, 10, 3), np.uint8), MediaLimits(max_image_pixels=50))


def test_accessors_are_safe(images: Path) -> None:
    img = load(images, "photo_640x480.jpg")
    arr = img.to_numpy()
    assert not arr.flags.writeable and img.to_numpy() is arr
    mine = img.to_numpy(copy=True)
    mine[:] = 0
    pil = img.to_pil()
    pil.paste((0, 0, 0), (0, 0, 640, 480))
    assert img.to_numpy().max() > 0 and np.array_equal(np.asarray(img.to_pil()), arr)
    assert "640x480" in repr(img)


def test_from_path_errors(tmp_path: Path, images: Path) -> None:
    with pytest.raises(InvalidRequestError):
        Image.from_path(tmp_path / "missing.png")
    with pytest.raises(InvalidRequestError):
        Image.from_path(tmp_path)
    with pytest.raises(MediaTooLargeError) as e:  # refused from stat, before reading
        Image.from_path(images / "photo_4032x3024.jpg", MediaLimits(max_bytes=1000))
    assert e.value.limit == 1000 and e.value.actual > 1000
    if os.path.exists("/dev/zero"):  # a special file cannot stream forever
        with pytest.raises(MediaTooLargeError):
            Image.from_path("/dev/zero", MediaLimits(max_bytes=4096))


@pytest.mark.parametrize(
    "kw",
    [
        {"background": (0, 0)},
        {"background": (0, 0, 256)},
        {"background": "white"},
        {"reduce_to": (0, 10)},
        {"reduce_to": (10,)},
        {"reduce_to": "big"},
        {"limits": {"max_bytes": 1}},
    ],
)
def test_invalid_arguments(images: Path, kw) -> None:
    data = (images / "gray.png").read_bytes()
    with pytest.raises(InvalidRequestError):
        Image.from_bytes(data, **kw)


def test_non_bytes_input_refused() -> None:
    for bad in ("a string", None, 12, [1, 2, 3]):
        with pytest.raises(InvalidRequestError):
            Image.from_bytes(bad)  # type: ignore[arg-type]
    assert Image.from_bytes(bytearray(_tiny_png())).size == (2, 2)
    assert Image.from_bytes(memoryview(_tiny_png())).size == (2, 2)


def _tiny_png() -> bytes:
    import io

    buf = io.BytesIO()
    PILImage.new("RGB", (2, 2), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


# ---------------------------------------------------------------------- reduced decode


def test_reduced_jpeg_decode(images: Path) -> None:
    data = (images / "photo_4032x3024.jpg").read_bytes()
    full = Image.from_bytes(data)
    small = Image.from_bytes(data, reduce_to=(1000, 750))
    assert small.size == (1008, 756)  # DCT scale 1/4; never below the request
    assert small.source_size == (4032, 3024) and full.source_size == (4032, 3024)
    # The reduction happens in the decoder (no full-size buffer): a 16th of the pixels.
    # (Its speed is a bench figure, never a timed assertion here.)
    assert small.nbytes * 10 < full.nbytes
    ref = np.asarray(full.to_pil().resize(small.size, PILImage.Resampling.BICUBIC), dtype=np.float32)
    diff = np.abs(small.to_numpy().astype(np.float32) - ref)
    assert diff.mean() < 4.0, diff.mean()
    assert small.content_hash != full.content_hash
    # The same output size gives the same hash (reduction is salted by result, not request).
    assert Image.from_bytes(data, reduce_to=(1001, 751)).content_hash == small.content_hash
    # An in-between request: 1/2 scale by DCT is the largest that stays at or above it.
    assert Image.from_bytes(data, reduce_to=(1152, 864)).size == (2016, 1512)
    # Tiny request: 1/8 by DCT, then a box reduce for the remaining factor.
    tiny = Image.from_bytes(data, reduce_to=(100, 100))
    assert tiny.width >= 100 and tiny.height >= 100 and tiny.width < 200


def test_reduced_decode_respects_orientation_and_other_formats(images: Path) -> None:
    rot = load(images, "exif_rotated_6.jpg", reduce_to=(120, 160))
    assert rot.size == (120, 160)
    assert close(rot.to_numpy()[5, 5], (0, 0, 255), 12)  # still rotated: top-left blue
    png = load(images, "photo_1024x768.png", reduce_to=(300, 200))
    assert png.size == (342, 256) and png.width >= 300 and png.height >= 200
    same = load(images, "photo_640x480.jpg", reduce_to=(4000, 4000))  # already smaller
    assert same.size == (640, 480)
    assert same.content_hash == load(images, "photo_640x480.jpg").content_hash


# ---------------------------------------------------------------------- hashing


def test_content_hash(images: Path) -> None:
    a = load(images, "photo_640x480.jpg")
    assert a.content_hash == load(images, "photo_640x480.jpg").content_hash
    assert len(a.content_hash) == 32
    assert a.content_hash != load(images, "lossy.webp").content_hash
    data = bytearray((images / "photo_640x480.jpg").read_bytes())
    data[-3] ^= 0x01  # one bit in the entropy-coded data
    assert Image.from_bytes(bytes(data)).content_hash != a.content_hash
    # Background salts the hash only where something was transparent.
    assert load(images, "photo_640x480.jpg", background=(0, 0, 0)).content_hash == a.content_hash
    white = load(images, "rgba.png").content_hash
    assert load(images, "rgba.png", background=(0, 0, 0)).content_hash != white


# ---------------------------------------------------------------------- hostile input

IMAGE_HOSTILE = {
    # name: (error class, limit field, actual value)
    "image_bomb_100000x100000.png": (MediaTooLargeError, "max_image_side", 100_000),
    "image_bomb_9000x9000.png": (MediaTooLargeError, "max_image_pixels", 81_000_000),
    "image_huge_side_40000x1.png": (MediaTooLargeError, "max_image_side", 40_000),
    "image_lying_sof_65000x65000.jpg": (MediaTooLargeError, "max_image_side", 65_000),
    "image_truncated.jpg": (CorruptMediaError, None, None),
    "image_truncated.png": (CorruptMediaError, None, None),
}


@pytest.mark.parametrize("name", sorted(IMAGE_HOSTILE))
def test_image_hostile_files(hostile: Path, name: str) -> None:
    error, limit_field, actual = IMAGE_HOSTILE[name]
    data = (hostile / name).read_bytes()
    assert len(data) < 1_000_000
    t0 = time.perf_counter()
    with pytest.raises(error) as e:
        Image.from_bytes(data)
    assert time.perf_counter() - t0 < 2.0
    assert e.value.code == error.code and e.value.kind == "image"
    if limit_field:
        assert e.value.limit == getattr(MediaLimits(), limit_field)
        assert e.value.actual == actual
        assert str(actual) in e.value.message and str(e.value.limit) in e.value.message


def test_pixel_limit_checked_when_side_allowed(hostile: Path) -> None:
    data = (hostile / "image_bomb_100000x100000.png").read_bytes()
    with pytest.raises(MediaTooLargeError) as e:
        Image.from_bytes(data, MediaLimits(max_image_side=1_000_000))
    assert e.value.limit == 64_000_000 and e.value.actual == 10**10


def _bounded_child(fn, headroom: int = 256 << 20) -> dict:
    """Run ``fn`` in a forked child whose address space may grow by ``headroom`` only."""
    resource = pytest.importorskip("resource")
    if not hasattr(os, "fork") or not os.path.exists("/proc/self/status"):
        pytest.skip("needs fork and /proc")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        out: dict = {}
        try:
            os.close(r)
            with open("/proc/self/status") as f:
                vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
            resource.setrlimit(resource.RLIMIT_AS, (vm_kb * 1024 + headroom, resource.RLIM_INFINITY))
            t0 = time.perf_counter()
            try:
                fn()
                out["result"] = "ok"
            except BaseException as e:  # report whatever escaped
                out.update(
                    result="raised",
                    error=type(e).__name__,
                    is_media_error=isinstance(e, MediaError),
                    code=getattr(e, "code", None),
                    limit=getattr(e, "limit", None),
                    actual=getattr(e, "actual", None),
                )
            out["seconds"] = time.perf_counter() - t0
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    assert chunks, "child died without reporting"
    return json.loads(b"".join(chunks))


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS accounting is Linux-specific")
@pytest.mark.parametrize("name", sorted(IMAGE_HOSTILE))
def test_hostile_memory_bounded(hostile: Path, name: str) -> None:
    data = (hostile / name).read_bytes()
    error, limit_field, actual = IMAGE_HOSTILE[name]
    out = _bounded_child(lambda: Image.from_bytes(data))
    assert out["result"] == "raised" and out["error"] == error.__name__, out
    if limit_field:  # refused by the header check, not by running out of memory
        assert out["actual"] == actual, out
    assert out["seconds"] < 2.0


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS accounting is Linux-specific")
def test_bomb_with_limits_raised_beyond_pillow_stays_typed(hostile: Path) -> None:
    # Limits far above Pillow's own guard: the allocation itself fails under the rlimit,
    # and still only a MediaError comes out.
    data = (hostile / "image_bomb_100000x100000.png").read_bytes()
    huge = MediaLimits(max_image_pixels=10**11, max_image_side=10**6)
    out = _bounded_child(lambda: Image.from_bytes(data, huge))
    assert out["result"] == "raised" and out["is_media_error"], out


def test_pillow_global_guard_is_not_ours(images: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = PILImage.MAX_IMAGE_PIXELS
    load(images, "photo_4032x3024.jpg", reduce_to=(500, 500))
    assert PILImage.MAX_IMAGE_PIXELS == before
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    # With Pillow's global limit absurdly low, our limits still decide, and the
    # plugins that run Pillow's check while loading (GIF) give a typed error.
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PILImage.DecompressionBombWarning)
        assert load(images, "photo_640x480.jpg").size == (640, 480)
        try:
            load(images, "animated.gif")
        except MediaError as e:
            assert isinstance(e, MediaTooLargeError)


def test_excluded_formats_refused() -> None:
    assert "EPS" in EXCLUDED_FORMATS
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n" + b"0 0 moveto\n" * 10
    with pytest.raises(UnsupportedFormatError):
        Image.from_bytes(eps)


GENERIC_HOSTILE = {
    "zero_bytes.bin": EmptyMediaError,
    "random_bytes.bin": UnsupportedFormatError,
    "text_file.txt": UnsupportedFormatError,
    "image.svg": UnsupportedFormatError,
    "wrong_magic_png.png": CorruptMediaError,
    "wrong_magic_wav.wav": UnsupportedFormatError,
}


@pytest.mark.parametrize("name", sorted(GENERIC_HOSTILE))
def test_generic_hostile_files(hostile: Path, name: str) -> None:
    with pytest.raises(GENERIC_HOSTILE[name]) as e:
        Image.from_path(hostile / name)
    assert isinstance(e.value, MediaError) and e.value.message


def test_byte_limit_first(images: Path) -> None:
    data = (images / "photo_640x480.jpg").read_bytes()
    with pytest.raises(MediaTooLargeError) as e:
        Image.from_bytes(data, MediaLimits(max_bytes=100))
    assert (e.value.limit, e.value.actual) == (100, len(data))


# ---------------------------------------------------------------------- fuzzing

CORPUS = [
    "photo_640x480.jpg",
    "rgba.png",
    "la.png",
    "p_transparent.png",
    "cmyk.jpg",
    "gray16.png",
    "rgb16.png",
    "bilevel.png",
    "lossy.webp",
    "lossless_rgba.webp",
    "animated.gif",
    "image.bmp",
    "image.tiff",
    "image.tga",
    "image.ppm",
    "icon.ico",
    "float.tif",
    "image.avif",
    "exif_rotated_6.jpg",
    "odd_7x13.jpg",
]


@pytest.fixture(scope="session")
def corpus(images: Path) -> dict[str, bytes]:
    return {n: (images / n).read_bytes() for n in CORPUS if (images / n).exists()}


def _decode_only_media_errors(data: bytes) -> None:
    try:
        img = Image.from_bytes(data, FUZZ_LIMITS)
    except MediaError:
        return
    arr = img.to_numpy()
    assert arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[2] == 3


@FAST
@given(st.binary(min_size=0, max_size=2048))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_only_media_errors(data)


MAGICS = [
    b"\x89PNG\r\n\x1a\n",
    b"\xff\xd8\xff",
    b"GIF89a",
    b"RIFF\x00\x01\x00\x00WEBPVP8 ",
    b"BM",
    b"II*\x00",
    b"MM\x00*",
    b"\x00\x00\x01\x00",
    b"\x00\x00\x02\x00",
    b"P6\n",
    b"\x00\x00\x00\x1cftypavif",
]


@FAST
@given(st.sampled_from(MAGICS), st.binary(max_size=512))
def test_fuzz_magic_then_garbage(magic: bytes, tail: bytes) -> None:
    _decode_only_media_errors(magic + tail)


_position = st.one_of(st.integers(0, 96), st.integers(0, 1 << 30))
_mutation = st.one_of(
    st.tuples(st.just("flip"), _position, st.integers(0, 7)),
    st.tuples(st.just("set"), _position, st.integers(0, 255)),
    st.tuples(st.just("truncate"), _position, st.just(0)),
    st.tuples(st.just("splice"), _position, st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), _position, st.integers(1, 64)),
)


def _mutate(data: bytes, ops) -> bytes:
    buf = bytearray(data)
    for op, pos, arg in ops:
        if not buf:
            break
        i = pos % len(buf)
        if op == "flip":
            buf[i] ^= 1 << arg
        elif op == "set":
            buf[i] = arg
        elif op == "truncate":
            del buf[max(i, 1) :]
        elif op == "splice":
            buf[i:i] = arg
        else:
            del buf[i : i + arg]
    return bytes(buf)


@FAST
@given(data=st.data())
def test_fuzz_mutated_samples(corpus: dict[str, bytes], data) -> None:
    name = data.draw(st.sampled_from(sorted(corpus)))
    ops = data.draw(st.lists(_mutation, min_size=1, max_size=4))
    _decode_only_media_errors(_mutate(corpus[name], ops))


@pytest.mark.parametrize("name", CORPUS)
def test_every_truncation_point_of_small_samples(corpus: dict[str, bytes], name: str) -> None:
    if name not in corpus:
        pytest.skip("not built here")
    data = corpus[name]
    step = max(1, len(data) // 40)
    for cut in range(0, len(data), step):
        _decode_only_media_errors(data[:cut])
