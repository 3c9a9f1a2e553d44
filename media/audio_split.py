"""Cut a long clip into pieces a model takes whole, at its quietest moments.

An audio encoder with a clip limit (Gemma-4's is 30 s) would otherwise drop everything
past it. Each cut falls in the last ``search_seconds`` before the limit, at the start of
the quietest ``window_seconds`` there (least RMS energy, mono), so a word is rarely split
in two. Written here because the libraries that split on silence (pydub, librosa's
``effects.split``) cut at every pause instead of packing pieces up to a length.
"""

from __future__ import annotations

import numpy as np

from media.audio import Audio
from media.errors import InvalidRequestError


def split_audio(
    audio: Audio, max_seconds: float, *, search_seconds: float = 2.0, window_seconds: float = 0.05
) -> list[Audio]:
    """``audio`` as consecutive pieces of at most ``max_seconds`` each that together hold
    every frame; one piece (``audio`` itself) when it already fits."""
    if not max_seconds > 0:
        raise InvalidRequestError(f"max_seconds must be positive, got {max_seconds}")
    rate = audio.sample_rate
    limit = max(1, int(max_seconds * rate))
    if audio.frames <= limit:
        return [audio]
    search = min(limit - 1, max(0, int(search_seconds * rate)))
    window = max(1, min(int(window_seconds * rate), search or 1))
    mono = audio.samples.mean(axis=1) if audio.channels > 1 else audio.samples[:, 0]
    pieces: list[Audio] = []
    start = 0
    while audio.frames - start > limit:
        end = start + limit
        cut = end
        if search >= window:
            region = mono[end - search : end].astype(np.float64)
            energy = np.convolve(region * region, np.ones(window), mode="valid")  # per window start
            cut = end - search + int(np.argmin(energy))
        cut = max(cut, start + 1)
        pieces.append(audio.segment(start, cut))
        start = cut
    pieces.append(audio.segment(start, audio.frames))
    return pieces
