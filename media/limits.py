"""Every limit the media layer enforces, in one place, with defaults that admit
real-world media and refuse abuse (decompression bombs, hour-long uploads)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from media.errors import MediaTooLargeError

MiB = 1024 * 1024


@dataclass(frozen=True)
class MediaLimits:
    """Limits checked before and during decoding.

    Pixel and duration limits are checked against the container's header before
    the full decode, so a lying or bomb-like file is refused without allocating.
    """

    max_bytes: int = 256 * MiB
    """Largest accepted input, any kind."""
    max_image_pixels: int = 64_000_000
    """Width x height of a still image (a 8000x8000 photo fits; Pillow's own bomb limit is ~89 M)."""
    max_image_side: int = 32_768
    """Longest side of a still image."""
    max_audio_seconds: float = 600.0
    """Duration of an audio clip (or of a video's audio track when it is extracted)."""
    max_audio_channels: int = 16
    max_sample_rate: int = 384_000
    max_video_seconds: float = 3600.0
    """Duration of a video (metadata only is read for the check)."""
    max_frame_pixels: int = 3840 * 2160
    """Width x height of one video frame (4K UHD)."""
    max_frames: int = 1024
    """Frames returned by one sample() call."""
    max_sample_bytes: int = 2 * 1024 * MiB
    """Decoded RGB bytes one sample() call may hold (frames x width x height x 3): 1024
    frames of 4K would be ~25 GB, so the frame count alone is not a memory bound."""
    max_container_frames: int = 1_000_000
    """Frames a video may declare or contain (animated GIF/WebP bombs)."""

    def with_(self, **changes: object) -> MediaLimits:
        return replace(self, **changes)

    def check_bytes(self, n: int, kind: str) -> None:
        if n > self.max_bytes:
            raise MediaTooLargeError(
                f"{kind} is {n} bytes, over the limit of {self.max_bytes} bytes",
                limit=self.max_bytes,
                actual=n,
                kind=kind,
            )


DEFAULT_LIMITS = MediaLimits()
