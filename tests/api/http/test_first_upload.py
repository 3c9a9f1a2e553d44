"""Issue 43, item 5: ``/ready`` said ready, then the first upload took 10-12 s (a client
on httpx's default 5 s timeout failed it). Whatever the first upload pays is now paid
before ``/ready`` (``api/http/warmup.py``; ``media/kernels.py`` compiles the numba
kernels the upload path runs, and they load from numba's cache on later starts).

The server gets an empty numba cache, as on a clean clone (CI), so a warm cache on disk
cannot hide a compile that still happens on the first request."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from PIL import Image as PILImage

from api.http.warmup import SAMPLES, warm_uploads
from media import DEFAULT_LIMITS, open_media
from tests.api.http.conftest import Server, start_server, stop_server

FIRST_UPLOAD_S = 1.0
"""The issue's acceptance check; measured here: 0.28-0.40 s with the machine otherwise idle,
0.34 s at a load average of 11 on its 2 cores (before the fix: 10 s idle, 20-34 s loaded)."""


def _photo_png() -> bytes:
    """A ~25 KB 8-bit RGB PNG (the fast decode path's kind), 200x150: each model resizes it."""
    rng = np.random.default_rng(43)
    pixels = np.linspace(0, 255, 150 * 200 * 3).reshape(150, 200, 3).astype(np.uint8)
    pixels[::3] += rng.integers(0, 40, (50, 200, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PILImage.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def cold_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("first-upload")
    s = start_server(tmp, env={"NUMBA_CACHE_DIR": str(tmp / "numba-cache")})
    yield s
    stop_server(s)


def test_the_first_upload_after_ready_is_quick(cold_server: Server) -> None:
    data = _photo_png()
    start = time.perf_counter()
    r = httpx.post(f"{cold_server.v1}/media", files={"file": ("photo.png", data, "image/png")}, timeout=120)
    took = time.perf_counter() - start
    assert r.status_code == 200, r.text
    media = r.json()["data"][0]["media"]
    assert media["kind"] == "image" and all(n > 0 for n in media["token_counts"].values())
    assert took < FIRST_UPLOAD_S, f"the first upload after /ready took {took:.2f} s"


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_warm_up_sample_is_read_as_its_kind(name: str) -> None:
    kind = {"png": "image", "jpeg": "image", "wav": "audio", "mp3": "audio", "mp4": "video"}[name]
    assert open_media(SAMPLES[name](), DEFAULT_LIMITS).kind == kind


def test_warm_up_runs_each_sample_through_the_upload_steps(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pie_media.http.warmup")
    seen: list[str] = []
    took = warm_uploads(lambda media: seen.append(media.kind), DEFAULT_LIMITS)
    assert sorted(took) == sorted(SAMPLES) and seen == ["image", "image", "audio", "audio", "video"]

    def broken() -> bytes:
        raise OSError("no encoder here")

    # A sample that cannot be made, or fails, is logged and skipped: start-up goes on.
    took = warm_uploads(lambda media: 1 / 0, DEFAULT_LIMITS, {"png": SAMPLES["png"], "x": broken})
    assert took == {}
    assert "no x sample here" in caplog.text and "the png sample failed" in caplog.text
