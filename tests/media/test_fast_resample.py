"""The numba resize kernels give Pillow's pixels, bit for bit, and resize_array takes them
only where they are proven exact (otherwise Pillow)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage
from PIL import ImageFilter

import media.fast_resample as fr
import media.resize as mr
from media import Image
from media.pil_pixels import pixel_view

R = PILImage.Resampling

pytestmark = pytest.mark.skipif(not fr.available(), reason="numba is not installed")


def _pillow(rgb: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray:
    return np.asarray(PILImage.fromarray(rgb).resize(size, resample=resample))


def _rgbx(rgb: np.ndarray, fill: int = 255) -> np.ndarray:
    return np.concatenate([rgb, np.full(rgb.shape[:2] + (1,), fill, np.uint8)], axis=2)


@pytest.fixture(scope="module")
def photo(samples: Path) -> np.ndarray:
    # A real photo (sharp edges, noise, flat sky) cut to an odd size.
    with PILImage.open(samples / "images" / "photo_4032x3024.jpg") as im:
        return np.asarray(im.convert("RGB").crop((517, 311, 517 + 1001, 311 + 757)))


@pytest.mark.parametrize("resample", list(fr.FILTERS))
@pytest.mark.parametrize(
    "size",
    [(448, 336), (1001, 250), (333, 757), (1600, 1210), (17, 9), (2002, 252), (91, 700), (1000, 757)],
    ids=["down", "vertical-only", "horizontal-only", "up", "tiny", "up-x-down-y", "thin", "one-column-less"],
)
def test_photo_equals_pillow(photo: np.ndarray, size: tuple[int, int], resample: int) -> None:
    ref = _pillow(photo, size, resample)
    for bands in (1, 3):
        got = fr.resample(photo, size, resample, bands=bands)
        assert got.shape == ref.shape and got.flags.c_contiguous
        assert np.array_equal(got, ref), (size, resample, bands)
    # Pillow's own RGBX storage (fourth byte ignored, whatever it holds) gives the same.
    assert np.array_equal(fr.resample(_rgbx(photo, 7), size, resample, bands=2), ref)


def test_both_pass_orders_are_exercised_and_exact(photo: np.ndarray) -> None:
    sizes = [(900, 100), (100, 700), (1001, 10), (10, 757), (5000, 300)]
    orders = {fr.vertical_first((1001, 757), s) for s in sizes}
    if int(PILImage.__version__.split(".")[0]) >= 13:
        assert orders == {True, False}
    for size in sizes:
        assert np.array_equal(fr.resample(photo, size, R.BICUBIC, bands=2), _pillow(photo, size, R.BICUBIC))


def test_random_shapes_and_extremes() -> None:
    """Random pictures (noise, and blurred noise whose values sit near the clamp edges less
    often) at random sizes, including 1-pixel sides, every filter."""
    rng = np.random.default_rng(7)
    for trial in range(60):
        h, w = (int(v) for v in rng.integers(1, 160, 2))
        src = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        if trial % 2:
            src = np.asarray(PILImage.fromarray(src).filter(ImageFilter.GaussianBlur(1.5)))
        size = (int(rng.integers(1, 260)), int(rng.integers(1, 260)))
        if trial % 5 == 0:
            size = (w, size[1])
        if trial % 7 == 0:
            size = (size[0], h)
        for resample in fr.FILTERS:
            got = fr.resample(src, size, resample, bands=int(rng.integers(1, 5)))
            assert np.array_equal(got, _pillow(src, size, resample)), (src.shape, size, resample)


def test_saturated_pixels_clamp_like_pillow() -> None:
    # Black/white edges make Lanczos and bicubic overshoot: the clamps must agree.
    src = np.zeros((64, 64, 3), np.uint8)
    src[::2, :, :] = 255
    src[:, ::3, 1] = 255
    for resample in fr.FILTERS:
        for size in ((31, 97), (97, 31), (200, 200), (5, 5)):
            assert np.array_equal(fr.resample(src, size, resample), _pillow(src, size, resample))


def test_same_size_is_a_copy_and_bad_input_is_refused(photo: np.ndarray) -> None:
    same = fr.resample(photo, (1001, 757), R.BICUBIC)
    assert np.array_equal(same, photo) and not np.shares_memory(same, photo)
    with pytest.raises(ValueError, match="uint8"):
        fr.resample(photo.astype(np.float32), (10, 10), R.BICUBIC)
    with pytest.raises(ValueError, match="convolution filter"):
        fr.resample(photo, (10, 10), R.NEAREST)
    with pytest.raises(ValueError, match="positive"):
        fr.resample(photo, (0, 10), R.BICUBIC)


def test_concurrent_callers_share_the_pool(photo: np.ndarray) -> None:
    sizes = [(448, 336), (640, 480), (300, 700), (1200, 900)]
    refs = {s: _pillow(photo, s, R.BICUBIC) for s in sizes}
    errors: list[str] = []

    def work(i: int) -> None:
        for k in range(3):
            s = sizes[(i + k) % len(sizes)]
            if not np.array_equal(fr.resample(photo, s, R.BICUBIC, bands=2), refs[s]):
                errors.append(f"thread {i} size {s}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)


def test_probe_passes_here() -> None:
    assert fr.is_exact()


# ----------------------------------------------------------------------- resize_array


def test_resize_array_reads_pil_memory_in_place(photo: np.ndarray) -> None:
    pil = PILImage.fromarray(photo)
    assert pixel_view(pil) is not None
    for size in ((448, 336), (1001, 300)):
        got = mr.resize_array(pil, size, R.BICUBIC)
        assert np.array_equal(got, np.asarray(pil.resize(size, R.BICUBIC)))
        assert np.array_equal(mr.resize_array(photo, size, R.BICUBIC), got)


def test_resize_array_falls_back_to_pillow_when_the_probe_fails(
    photo: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(fr, "_verified", False)
    monkeypatch.setattr(fr, "resample", lambda *a, **k: calls.append(a[1]))
    got = mr.resize_array(photo, (448, 336), R.BICUBIC)
    assert calls == [] and np.array_equal(got, _pillow(photo, (448, 336), R.BICUBIC))


def test_probe_catches_a_kernel_that_rounds_differently(monkeypatch: pytest.MonkeyPatch) -> None:
    real = fr.resample

    def off_by_one(pixels, size, resample, *, bands=None):
        out = real(pixels, size, resample, bands=bands)
        out[0, 0, 0] ^= 1
        return out

    monkeypatch.setattr(fr, "_verified", None)
    monkeypatch.setattr(fr, "resample", off_by_one)
    assert fr.is_exact() is False


def test_resize_array_other_modes_and_filters_use_pillow(photo: np.ndarray) -> None:
    grey = PILImage.fromarray(photo).convert("L")
    got = mr.resize_array(grey, (300, 200), R.BICUBIC)
    assert np.array_equal(got, np.asarray(grey.resize((300, 200), R.BICUBIC)))
    nearest = mr.resize_array(photo, (300, 200), R.NEAREST)
    assert np.array_equal(nearest, _pillow(photo, (300, 200), R.NEAREST))


def test_image_resized_array_and_rgb_view(samples: Path) -> None:
    data = (samples / "images" / "photo_1024x768.png").read_bytes()
    img = Image.from_bytes(data)
    ref_pil = img.to_pil()
    view = img.rgb_view()
    assert not view.flags.writeable
    assert np.array_equal(view, img.to_numpy())
    for size in ((912, 672), (448, 336), (1024, 700)):
        assert np.array_equal(img.resized_array(size, R.BICUBIC), np.asarray(ref_pil.resize(size, R.BICUBIC)))
    from_array = Image.from_array(img.to_numpy())
    assert np.array_equal(
        from_array.resized_array((448, 336), R.BICUBIC), np.asarray(ref_pil.resize((448, 336)))
    )


def test_warm_reports_the_fast_paths() -> None:
    from media import warm_kernels

    assert warm_kernels() == {"resize": True, "png": True}
