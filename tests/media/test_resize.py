"""The banded, threaded resize equals one Pillow ``resize`` call, bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage

from media import Image
from media.resize import MIN_SPLIT_PIXELS, resize, split_is_exact, split_resize, vertical_first

R = PILImage.Resampling


@pytest.fixture(scope="module")
def photo(samples: Path) -> PILImage.Image:
    # A real photo (sharp edges, noise) cut to an odd size so bands do not divide evenly.
    with PILImage.open(samples / "images" / "photo_4032x3024.jpg") as im:
        return im.convert("RGB").crop((517, 311, 517 + 1001, 311 + 757))


@pytest.mark.parametrize("resample", [R.BICUBIC, R.BILINEAR, R.LANCZOS, R.BOX, R.HAMMING])
@pytest.mark.parametrize(
    "size",
    [(448, 336), (333, 757), (1001, 250), (1600, 1210), (17, 9), (1001 * 2, 757 // 3)],
    ids=["down", "vertical-only", "horizontal-only", "up", "tiny", "up-x-down-y"],
)
def test_equals_one_pillow_call(photo: PILImage.Image, size: tuple[int, int], resample: int) -> None:
    ref = np.asarray(photo.resize(size, resample=resample))
    for bands in (2, 3, 8):
        got = split_resize(photo, *size, resample, bands)
        assert got.size == size and got.mode == "RGB"
        assert np.array_equal(np.asarray(got), ref), (size, resample, bands)
        # The public entry point: split where it pays, the plain call where not.
        assert np.array_equal(np.asarray(resize(photo, size, resample, bands=bands)), ref)


def test_grey_and_more_bands_than_rows(photo: PILImage.Image) -> None:
    grey = photo.convert("L")
    for size in [(500, 3), (2, 700)]:  # fewer output rows/columns than bands
        ref = np.asarray(grey.resize(size, resample=R.BICUBIC))
        assert np.array_equal(np.asarray(split_resize(grey, *size, R.BICUBIC, 8)), ref)
    tall = grey.crop((0, 0, 1000, 757)).resize((300, 1000))  # wide output, few rows
    assert np.array_equal(
        np.asarray(split_resize(tall, 7, 5, R.LANCZOS, 8)), np.asarray(tall.resize((7, 5), R.LANCZOS))
    )


def test_fallbacks_are_the_plain_call(photo: PILImage.Image) -> None:
    rgba = photo.convert("RGBA")
    rgba.putalpha(PILImage.linear_gradient("L").resize(rgba.size))
    for im, resample in [(rgba, R.BICUBIC), (photo, R.NEAREST), (photo.crop((0, 0, 64, 64)), R.BICUBIC)]:
        size = (im.width // 3, im.height // 2)
        assert np.array_equal(
            np.asarray(resize(im, size, resample, bands=4)), np.asarray(im.resize(size, resample=resample))
        )
    assert photo.crop((0, 0, 64, 64)).width * 64 < MIN_SPLIT_PIXELS
    with pytest.raises(ValueError):  # Pillow's own error for a zero size, unchanged
        resize(photo, (0, 10), R.BICUBIC, bands=4)


def test_image_resized_uses_it_and_keeps_pixels(samples: Path) -> None:
    data = (samples / "images" / "photo_1024x768.png").read_bytes()
    img = Image.from_bytes(data)
    pil = PILImage.open(samples / "images" / "photo_1024x768.png").convert("RGB")
    for size in [(768, 576), (448, 448), (1100, 800)]:
        assert np.array_equal(
            np.asarray(img.resized(size, R.BICUBIC)), np.asarray(pil.resize(size, R.BICUBIC))
        )


def test_both_pass_orders_over_a_random_sweep(photo: PILImage.Image) -> None:
    """Pillow 13 runs the vertical pass first when the height shrinks much more than the
    width; each pass rounds to 8 bits, so the split must follow the same order."""
    rng = np.random.default_rng(7)
    orders = set()
    for _ in range(24):
        sw, sh = int(rng.integers(600, 1002)), int(rng.integers(440, 758))  # >= MIN_SPLIT_PIXELS
        src = photo.crop((0, 0, sw, sh))
        assert sw * sh >= MIN_SPLIT_PIXELS
        size = (int(rng.integers(20, 1400)), int(rng.integers(20, 1400)))
        orders.add(vertical_first(src.size, size))
        ref = np.asarray(src.resize(size, resample=R.BICUBIC))
        assert np.array_equal(np.asarray(split_resize(src, *size, R.BICUBIC, 2)), ref), (src.size, size)
        assert np.array_equal(np.asarray(resize(src, size, R.BICUBIC, bands=2)), ref)
    assert split_is_exact()
    if int(PILImage.__version__.split(".")[0]) >= 13:
        assert orders == {True, False}


def test_when_it_splits(photo: PILImage.Image, monkeypatch: pytest.MonkeyPatch) -> None:
    import media.resize as mr

    calls: list[tuple[int, int]] = []
    real = mr.split_resize

    def spy(im, w, h, resample, bands):
        calls.append((w, h))
        return real(im, w, h, resample, bands)

    monkeypatch.setattr(mr, "split_resize", spy)
    mr.resize(photo, (448, 336), R.BICUBIC, bands=2)  # a 0.76 MP source shrunk: split
    mr.resize(photo, (448, 336), R.BICUBIC, bands=1)  # one band: the plain call
    mr.resize(photo.crop((0, 0, 300, 300)), (100, 100), R.BICUBIC, bands=2)  # small source
    monkeypatch.setattr(mr, "MAX_SPLIT_OUTPUT_PIXELS", 448 * 336 - 1)
    mr.resize(photo, (448, 336), R.BICUBIC, bands=2)  # output over the cap
    assert calls == [(448, 336)]
