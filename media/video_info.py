"""``VideoInfo``: what a video's container header says, read once at open."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["VideoInfo"]


@dataclass(frozen=True)
class VideoInfo:
    """Metadata of a video, from its container header (``Video.info``)."""

    format: str
    """Container format as FFmpeg names it (e.g. ``mov,mp4,m4a,3gp,3g2,mj2``), or ``webp``."""
    codec: str
    width: int
    height: int
    fps: float
    """Average frame rate (the container's average rate; frames / duration as a fallback)."""
    duration: float
    """Duration in seconds: the video stream's, else the container's, else frames / fps."""
    frame_count: int
    """Number of frames; where it comes from is in :attr:`frame_count_source`.

    A truncated file may declare more frames than it holds; sampling reports the
    missing ones in ``SampledFrames.skipped``.
    """
    frame_count_source: str
    """* ``"container"``: the count the container declares (MP4/MOV sample tables, AVI,
      GIF, WebP), read from the header, exact for intact files;
    * ``"demux"``: the container does not say (Matroska/WebM, MPEG-TS), so the video
      packets were counted in a demux-only pass (no decoding), exact;
    * ``"estimate"``: demuxing failed part-way, so ``round(duration * fps)``.
    """
    has_audio: bool

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, in declaration order."""
        return asdict(self)
