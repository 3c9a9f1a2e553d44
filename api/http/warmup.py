"""Every path an upload takes, run once before ``/ready`` (issue 43: ``/ready`` said ready,
then the first ``POST /v1/media`` took 10-12 s).

Where that first upload's time went (a 24 KB PNG, ``--model tiny --model tiny-gemma4``, 2
shared cores, cProfile in-process): 6.2 s waiting for numba's process-wide compile lock,
held by the engine's sampling kernel compiling on a background thread after the models
loaded; 1.3 s compiling the PNG fast path's unfilter kernel (warmed only as a dispatcher,
and never found in numba's disk cache: ``media/png_unfilter.py``); 0.8 s compiling the
resize kernel for a read-only source (decoded pixels are read-only; the load-time probe
had compiled the writable kind only); 0.4 s building each model's media encoder on first
use (its tokenizer read). Other kinds' first uploads paid PyAV's import and a codec's
first open, Pillow's plugin registry and the same encoder build.

``media.warm_kernels`` (at model load) now calls every kernel with a request's argument
types, before the engine's compile starts; :func:`warm_uploads` runs what
``routes/media.py``'s ``ingest`` runs (``open_media``, then ``token_counts``: every chat
model's ``prepare``) on tiny media generated here, one per common kind: PNG (the fast
path, resized by each model), JPEG, WAV, MP3 and H.264 MP4 (~0.8 s in all). The lifespan
awaits it before the registry says ready. A sample that cannot be made or read here (no
PyAV, no encoder for it) is skipped with a log line: its kind then fails or succeeds on a
request exactly as it would have.

It then waits for the engine's CPU sampling kernel (:func:`wait_for_sampler`), which
compiles on a thread of its own from model load: ~0.5 s from numba's cache, done by now
at every start but the first after ``engine/sampling_kernel_jit.py`` changes (a clean
clone), where it compiles for 7-15 s. Not waiting made that first start's ``/ready``
come early and its first sampled request wait the rest (~10 s) instead.
"""

from __future__ import annotations

import io
import logging
import math
import time
import wave
from collections.abc import Callable
from typing import Any

import numpy as np

from media import MediaLimits, open_media

__all__ = ["SAMPLES", "wait_for_sampler", "warm_uploads"]

log = logging.getLogger("pie_media.http.warmup")

_W, _H = 96, 64  # bigger than every tiny model's patch grid, so each one resizes
_RATE = 16_000


def _pixels() -> np.ndarray:
    """A smooth RGB gradient with some texture (so PNG rows use more than one filter)."""
    y, x = np.mgrid[0:_H, 0:_W]
    rgb = np.stack([x * 255 // _W, y * 255 // _H, (x * y) % 251], axis=-1)
    return rgb.astype(np.uint8)


def _image(fmt: str) -> bytes:
    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.fromarray(_pixels()).save(buf, fmt)
    return buf.getvalue()


def _tone(seconds: float = 0.5) -> np.ndarray:
    t = np.arange(int(_RATE * seconds)) / _RATE
    return (0.3 * np.sin(2 * math.pi * 440.0 * t)).astype(np.float32)


def _wav() -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(_RATE)
        w.writeframes((_tone() * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def _mp3() -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp3") as out:
        stream = out.add_stream("libmp3lame", rate=_RATE, layout="mono")
        samples = _tone()
        for at in range(0, len(samples), 1152):
            frame = av.AudioFrame.from_ndarray(samples[None, at : at + 1152], format="fltp", layout="mono")
            frame.sample_rate = _RATE
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def _mp4() -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = _W, _H, "yuv420p"
        base = _pixels()
        for i in range(8):  # one second
            frame = av.VideoFrame.from_ndarray(np.roll(base, 4 * i, axis=1), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


SAMPLES: dict[str, Callable[[], bytes]] = {
    "png": lambda: _image("PNG"),
    "jpeg": lambda: _image("JPEG"),
    "wav": _wav,
    "mp3": _mp3,
    "mp4": _mp4,
}
"""Name -> a function making one tiny file of that kind."""


def warm_uploads(
    token_counts: Callable[[Any], object],
    limits: MediaLimits,
    samples: dict[str, Callable[[], bytes]] = SAMPLES,
) -> dict[str, float]:
    """Run each sample through ``open_media(data, limits)`` and ``token_counts(media)`` (the
    upload route's steps); returns the seconds each took (absent: skipped, logged). Then
    waits for the sampling kernel (:func:`wait_for_sampler`): ``/ready`` comes after both."""
    took: dict[str, float] = {}
    for name, make in samples.items():
        start = time.perf_counter()
        try:
            data = make()
        except Exception as e:  # no PyAV, or no encoder for it here: nothing to warm with
            log.info("warm-up: no %s sample here (%s: %s); skipped", name, type(e).__name__, e)
            continue
        try:
            token_counts(open_media(data, limits))
        except Exception as e:  # a request of this kind would meet the same, and report it
            log.warning("warm-up: the %s sample failed (%s: %s)", name, type(e).__name__, e)
            continue
        took[name] = time.perf_counter() - start
    log.info("warm-up: uploads' paths ran in %s", ", ".join(f"{k} {v:.2f} s" for k, v in took.items()))
    wait_for_sampler()
    return took


def wait_for_sampler() -> float:
    """Wait for the CPU sampling kernel's warm-up thread (``engine.sampling_kernel``; none
    where no model runs on the CPU); returns the seconds waited."""
    from engine import sampling_kernel

    start = time.perf_counter()
    sampling_kernel.wait_warm()
    waited = time.perf_counter() - start
    log.info("warm-up: waited %.2f s for the sampling kernel", waited)
    return waited
