"""Checks of a declared audio stream (sample rate, channels) against the limits; no decoder
is needed for them, so arrays made in memory are checked without importing one."""

from __future__ import annotations

from media.errors import CorruptMediaError, MediaTooLargeError
from media.limits import MediaLimits

KIND = "audio"


def check_stream(rate: int, channels: int, limits: MediaLimits, label: str) -> None:
    """Refuse a declared sample rate or channel count that is impossible or over ``limits``."""
    if rate <= 0:
        raise CorruptMediaError(f"{label} audio declares sample rate {rate}", actual=rate, kind=KIND)
    if channels <= 0:
        raise CorruptMediaError(f"{label} audio declares {channels} channels", actual=channels, kind=KIND)
    if rate > limits.max_sample_rate:
        raise MediaTooLargeError(
            f"{label} audio sample rate {rate} Hz is over the limit of {limits.max_sample_rate} Hz",
            limit=limits.max_sample_rate,
            actual=rate,
            kind=KIND,
        )
    if channels > limits.max_audio_channels:
        raise MediaTooLargeError(
            f"{label} audio has {channels} channels, over the limit of {limits.max_audio_channels}",
            limit=limits.max_audio_channels,
            actual=channels,
            kind=KIND,
        )
