"""pixel_view reads a Pillow image's memory in place: the same pixels, read-only, alive as
long as the view, and None where Pillow cannot export the image in one piece."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from PIL import Image as PILImage

from media.pil_pixels import pixel_view, single_block_images


def _noise(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_rgb_view_is_the_pixels_in_place() -> None:
    rgb = _noise(37, 53)
    pil = PILImage.fromarray(rgb)
    view = pixel_view(pil)
    assert view is not None and view.shape == (37, 53, 4)
    assert np.array_equal(view[:, :, :3], rgb)
    assert not view.flags.writeable
    # In place: drawing on the image shows through the view.
    pil.putpixel((5, 3), (1, 2, 3))
    assert tuple(view[3, 5, :3]) == (1, 2, 3)


def test_grey_view_and_unsupported_modes() -> None:
    grey = PILImage.fromarray(_noise(20, 30)[:, :, 0])
    view = pixel_view(grey)
    assert view is not None and view.shape == (20, 30)
    assert np.array_equal(view, np.asarray(grey))
    assert pixel_view(grey.convert("P")) is None
    assert pixel_view(PILImage.new("I;16", (4, 4))) is None
    assert pixel_view(PILImage.new("F", (4, 4))) is None


def test_view_keeps_the_image_alive() -> None:
    rgb = _noise(64, 64, seed=3)
    view = pixel_view(PILImage.fromarray(rgb))  # no other reference to the image
    gc.collect()
    _ = [np.ones((64, 64, 4), np.uint8) * 9 for _ in range(20)]  # reuse freed memory, if any
    assert view is not None and np.array_equal(view[:, :, :3], rgb)


def test_large_images_are_viewable_once_single_block_is_on() -> None:
    assert single_block_images()
    big = PILImage.new("RGB", (2500, 2000), (10, 20, 30))  # 20 MB: over Pillow's 16 MB block
    view = pixel_view(big)
    assert view is not None and view.shape == (2000, 2500, 4)
    assert (view[-1, -1, :3] == (10, 20, 30)).all()


def test_multi_block_image_gives_none() -> None:
    core = PILImage.core
    if not hasattr(core, "set_use_block_allocator"):
        pytest.skip("Pillow without the block allocator switch")
    before = core.get_use_block_allocator()
    core.set_use_block_allocator(0)
    try:
        big = PILImage.new("RGB", (2500, 2000))  # several 16 MB blocks
    finally:
        core.set_use_block_allocator(before)
    assert pixel_view(big) is None


def test_empty_image_gives_none() -> None:
    assert pixel_view(PILImage.new("RGB", (0, 5))) is None
