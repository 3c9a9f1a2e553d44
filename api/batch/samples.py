"""What flows through a batch job: a ``Sample`` read from a source shard, the
``WorkItem`` the preparation stage makes of it for the engine, and the ``ShardEnd``
that says a shard has been read through."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

IMAGE_EXTS = frozenset(
    {"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "avif", "ppm", "tga", "ico", "heic"}
)
VIDEO_EXTS = frozenset({"mp4", "webm", "mkv", "mov", "avi", "m4v", "mpg", "mpeg", "ts"})
AUDIO_EXTS = frozenset({"mp3", "wav", "flac", "ogg", "opus", "m4a", "aac", "aiff", "aif"})
MEDIA_EXTS = IMAGE_EXTS | VIDEO_EXTS | AUDIO_EXTS


@dataclass
class Sample:
    """One sample of a source shard: its media bytes (or a URL to fetch, or the error
    found while reading it) and its metadata (a WebDataset sample's ``.json``/``.txt``, a
    Parquet row's other columns)."""

    key: str
    shard: str
    name: str
    """The record's ``file``: a path, ``shard.tar/member``, ``file.parquet#row`` or the URL."""
    data: bytes | None = None
    url: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None


@dataclass
class Segment:
    """A caption target within a sample: the whole media, or a time range of a video."""

    prepared: Any  # encoders.Prepared, or None when the segment failed
    start: float | None = None
    end: float | None = None
    error: dict[str, Any] | None = None


@dataclass
class WorkItem:
    """A sample prepared for the engine (or the error that stopped it), with the prompts
    to run on it."""

    key: str
    shard: str
    name: str
    content_hash: str | None
    prompts: list[str]
    segments: list[Segment] = field(default_factory=list)
    error: dict[str, Any] | None = None
    kind: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    skip: bool = False
    """Every record of this sample is already in the output (resume)."""
    skip_errors: int = 0
    """Of a skipped sample: how many of its recorded outcomes were errors."""


@dataclass
class ShardEnd:
    """Every sample of ``shard`` has been sent (``samples`` of them)."""

    shard: str
    samples: int
