"""Video: container metadata, limit checks and frame sampling from raw bytes.

``Video.from_bytes`` reads only the container header and checks every limit on it
before a single frame is decoded (:mod:`media.frame_sources`); the header's facts are
``Video.info`` (a :class:`~media.video_info.VideoInfo`). Frames are decoded only by
``sample()`` / ``sample_indices()``, which hold exactly the requested frames and reach
them by seeking or decoding forward as the cost model in :mod:`media.timeline` says.

Still images (PNG, JPEG, a one-frame GIF, a still WebP) and audio files are refused
(use ``media.Image`` / ``media.Audio``); ``sample()`` returns at most
``limits.max_frames`` frames.

Errors: only ``PieMediaError`` subclasses leave ``from_bytes``, ``sample`` and
``sample_indices``; a requested frame that cannot be decoded is skipped and reported in
``SampledFrames.skipped``, and ``CorruptMediaError`` is raised only when none can be.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from media.errors import (
    CorruptMediaError,
    EmptyMediaError,
    InvalidRequestError,
    MediaError,
    MediaTooLargeError,
    PieMediaError,
    UnsupportedFormatError,
)
from media.hashing import content_hash
from media.limits import DEFAULT_LIMITS, MediaLimits
from media.timeline import STRATEGIES, DecodePlan, Strategy, plan_decode
from media.validation import check_int, check_number
from media.video_info import VideoInfo

if TYPE_CHECKING:
    from media.audio import Audio
    from media.frame_sources import FrameSource

# PyAV (FFmpeg) is imported by media.frame_sources and media.decode_errors on first use:
# images and text never need it, and a machine without it still imports the project.

__all__ = ["SampledFrames", "SkippedFrame", "Video"]


def _as_media_error(exc: BaseException, context: str) -> PieMediaError:
    """``media.decode_errors.as_media_error`` (it imports PyAV); without PyAV installed,
    the typed error that says so."""
    try:
        from media.decode_errors import as_media_error
    except ModuleNotFoundError as missing:
        return UnsupportedFormatError(f"{context}: video decoding needs PyAV ({missing})", kind=KIND)
    return as_media_error(exc, context, KIND)


KIND = "video"

_INTERRUPTS = (KeyboardInterrupt, SystemExit, GeneratorExit)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class SkippedFrame:
    """A requested frame that could not be returned."""

    index: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "reason": self.reason}


@dataclass(repr=False)
class SampledFrames:
    """Frames decoded from a video, in the order they were requested.

    ``frames[k]`` is the frame with index ``indices[k]`` shown at ``timestamps[k]``
    seconds from the start of the video stream (the frame's pts x time_base minus the
    stream's start time; ``index / fps`` where a frame has no pts). Requested frames
    that could not be decoded are absent from these three and listed in ``skipped``.
    Iterating gives ``(timestamp, frame)`` pairs.
    """

    frames: np.ndarray
    """(N, H, W, 3) uint8 RGB."""
    timestamps: list[float]
    indices: list[int]
    skipped: list[SkippedFrame] = field(default_factory=list)
    fps: float = 0.0
    """Average frame rate of the source."""
    duration: float = 0.0
    """Duration of the source in seconds."""
    strategy: str = "sequential"
    """How the frames were reached: ``sequential``, ``seek`` or ``mixed`` (auto used both)."""
    frames_decoded: int = 0
    """Frames the decoder produced to deliver these (a measure of the work done)."""
    seeks: int = 0

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[tuple[float, np.ndarray]]:
        return zip(self.timestamps, self.frames, strict=True)

    def __repr__(self) -> str:
        n = len(self.indices)
        size = f"{self.frames.shape[2]}x{self.frames.shape[1]}" if self.frames.ndim == 4 else "?"
        span = f"{self.timestamps[0]:.3f}..{self.timestamps[-1]:.3f} s" if self.timestamps else "-"
        return (
            f"SampledFrames({n} frame{'s' if n != 1 else ''} {size}, indices={_abbreviate(self.indices)}, "
            f"t={span}, skipped={len(self.skipped)}, strategy={self.strategy!r}, "
            f"frames_decoded={self.frames_decoded}, seeks={self.seeks})"
        )


def _abbreviate(values: list[int], keep: int = 3) -> str:
    if len(values) <= 2 * keep:
        return str(values)
    return f"[{', '.join(map(str, values[:keep]))}, ..., {', '.join(map(str, values[-keep:]))}]"


# --------------------------------------------------------------------------- Video


class Video:
    """A validated video: metadata from the container header, frames on demand.

    Build with :meth:`from_bytes` or :meth:`from_path`. Nothing is decoded until
    :meth:`sample` or :meth:`sample_indices`; every limit in ``MediaLimits`` that the
    header can answer (bytes, frame pixels, duration, frame count) is checked first.
    """

    kind = KIND

    def __init__(self, source: FrameSource, data_hash: str, size_bytes: int, limits: MediaLimits):
        self._src = source
        self._data = source.data
        self._limits = limits
        self.content_hash = data_hash
        """SHA-256/128 of the raw bytes (``media.hashing.content_hash``)."""
        self.size_bytes = size_bytes

    # -- construction

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, limits: MediaLimits | None = None) -> Video:
        """Open a video from its encoded bytes; raises only ``PieMediaError`` subclasses."""
        limits = limits or DEFAULT_LIMITS
        try:
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise InvalidRequestError(f"video data must be bytes, got {type(data).__name__}", kind=KIND)
            size = memoryview(data).nbytes
            if size == 0:
                raise EmptyMediaError("video data is empty (0 bytes)", kind=KIND, actual=0)
            limits.check_bytes(size, KIND)
            if not isinstance(data, bytes):
                data = bytes(data)  # own copy: the caller's buffer could change under the decoder
            from media.frame_sources import open_source

            return cls(open_source(data, limits), content_hash(data), len(data), limits)
        except BaseException as e:
            if isinstance(e, _INTERRUPTS):
                raise
            raise _as_media_error(e, "video could not be opened") from None

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], limits: MediaLimits | None = None) -> Video:
        """Open a video file. The size limit is checked on the file's size before reading it.

        I/O errors (missing file, permissions) propagate as ``OSError``; anything wrong
        with the content raises a ``MediaError`` subclass.
        """
        limits = limits or DEFAULT_LIMITS
        p = Path(path)
        limits.check_bytes(p.stat().st_size, KIND)
        return cls.from_bytes(p.read_bytes(), limits)

    # -- metadata (header only)

    @property
    def info(self) -> VideoInfo:
        """What the container header says: frame size, rate, duration, frame count, codec."""
        return self._src.info

    @property
    def limits(self) -> MediaLimits:
        return self._limits

    @property
    def keyframe_indices(self) -> list[int]:
        """Indices of keyframes (from a demux-only pass; ``[0]`` when unknown)."""
        try:
            tl = self._src.timeline()
        except MediaError:
            return [0]
        return list(tl.keyframes) if tl is not None and tl.pts is not None else [0]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready metadata: ``kind``, the :class:`VideoInfo` fields, size and hash."""
        return {
            "kind": KIND,
            **self.info.to_dict(),
            "size_bytes": self.size_bytes,
            "content_hash": self.content_hash,
        }

    def __repr__(self) -> str:
        m = self.info
        return (
            f"Video({m.codec} {m.width}x{m.height}, {m.frame_count} frames, {m.fps:.3g} fps, "
            f"{m.duration:.3g} s, hash={self.content_hash[:12]})"
        )

    # -- sampling

    def uniform_indices(self, max_frames: int | None = None, fps: float | None = None) -> list[int]:
        """The frame indices :meth:`sample` decodes for these arguments (no decoding).

        * only ``max_frames`` (or neither): ``min(max_frames, frame_count,
          limits.max_frames)`` indices spread evenly over the clip, first and last included;
        * ``fps``: one frame every ``1/fps`` s, i.e. ``round(duration * fps)`` frames (at
          least 1), capped by ``max_frames`` and ``limits.max_frames``, spread evenly in
          time over the whole clip (nearest frame to each instant; exact for
          variable-frame-rate clips too), first and last included.
        """
        info = self.info
        n_total = info.frame_count
        cap = self._limits.max_frames
        if max_frames is not None:
            cap = min(cap, check_int("max_frames", max_frames, min=1, kind=KIND))
        if fps is None:
            n = min(cap, n_total)
            return _spread(n_total, n)
        fps = check_number("fps", fps, min=0, min_open=True, kind=KIND)
        duration = info.duration if info.duration > 0 else (n_total / info.fps if info.fps > 0 else 0.0)
        n = max(1, min(cap, n_total, round(duration * fps)))
        pts = self._src.frame_times()
        if pts is None or n >= n_total:
            return _spread(n_total, n)
        # Nearest frame to each of n evenly spaced instants between the first and last frame.
        times = np.linspace(pts[0], pts[-1], n)
        arr = np.asarray(pts)
        k = np.clip(np.searchsorted(arr, times), 1, len(arr) - 1)
        nearest = np.where(times - arr[k - 1] <= arr[k] - times, k - 1, k)
        return sorted(set(int(i) for i in nearest))

    def sample(
        self,
        max_frames: int | None = None,
        fps: float | None = None,
        *,
        strategy: Strategy = "auto",
    ) -> SampledFrames:
        """Decode frames spread over the whole clip (see :meth:`uniform_indices`).

        ``strategy`` forces seeking or sequential decoding (for benchmarks and tests);
        ``"auto"`` uses the cost model in :mod:`media.timeline`.
        """
        try:
            indices = self.uniform_indices(max_frames, fps)
            return self._sample(indices, strategy)
        except BaseException as e:
            if isinstance(e, _INTERRUPTS):
                raise
            raise _as_media_error(e, "video frames could not be decoded") from None

    def sample_indices(self, indices: Sequence[int], *, strategy: Strategy = "auto") -> SampledFrames:
        """Decode exactly these frames (indices into the frames ``0..frame_count-1``).

        Frames come back in the order given; repeated indices are decoded once and
        repeated in the result. For reproducing a reference processor's frame choice.
        """
        try:
            last = self.info.frame_count - 1
            idx = [check_int("frame index", i, min=0, max=last, kind=KIND) for i in indices]
            if not idx:
                raise InvalidRequestError("no frame indices given", kind=KIND)
            if len(idx) > self._limits.max_frames:
                raise InvalidRequestError(
                    f"{len(idx)} frames requested, over the limit of {self._limits.max_frames} frames per call",
                    limit=self._limits.max_frames,
                    actual=len(idx),
                    kind=KIND,
                )
            return self._sample(idx, strategy)
        except BaseException as e:
            if isinstance(e, _INTERRUPTS):
                raise
            raise _as_media_error(e, "video frames could not be decoded") from None

    def decode_plan(self, indices: Sequence[int], strategy: Strategy = "auto") -> DecodePlan:
        """The cost estimates and seek decisions for decoding ``indices`` (no decoding)."""
        targets = sorted(set(int(i) for i in indices))
        return plan_decode(targets, self._src.timeline(), strategy)

    def _sample(self, indices: list[int], strategy: Strategy) -> SampledFrames:
        if strategy not in STRATEGIES:
            raise InvalidRequestError(
                f"strategy must be auto, seek or sequential, got {strategy!r}", kind=KIND
            )
        info = self.info
        need = len(indices) * info.width * info.height * 3
        if need > self._limits.max_sample_bytes:
            raise MediaTooLargeError(
                f"{len(indices)} frames of {info.width}x{info.height} need {need} bytes, over the "
                f"limit of {self._limits.max_sample_bytes} bytes per sample() call; ask for fewer frames",
                limit=self._limits.max_sample_bytes,
                actual=need,
                kind=KIND,
            )
        from media.frame_sources import FrameCollector

        targets = sorted(set(indices))
        out = FrameCollector(targets, info.height, info.width)
        plan = self._src.decode(targets, strategy, out)
        got = [t for t in targets if t in out.have]
        if not got:
            reasons = sorted(set(out.errors.values()))
            detail = f"; first problem: {reasons[0]}" if reasons else ""
            raise CorruptMediaError(
                f"none of the {len(targets)} requested frames could be decoded{detail}",
                kind=KIND,
                actual=0,
            )
        rows = [out.slot[t] for t in indices if t in out.have]
        if rows == list(range(len(targets))):
            frames = out.frames  # requested in order, all present: no copy
        else:
            frames = out.frames[rows]
        skipped = [
            SkippedFrame(t, out.errors.get(t, "frame not found: the stream ended before it (truncated?)"))
            for t in targets
            if t not in out.have
        ]
        kept = [t for t in indices if t in out.have]
        return SampledFrames(
            frames=frames,
            timestamps=[out.have[t] for t in kept],
            indices=kept,
            skipped=skipped,
            fps=info.fps,
            duration=info.duration,
            strategy=plan.strategy,
            frames_decoded=out.frames_decoded,
            seeks=out.seeks,
        )

    # -- audio

    def audio(self) -> Audio | None:
        """The first audio track as ``media.Audio`` (float32 (frames, channels), native
        sample rate), or None when the video has no audio track.

        Decoded by ``Audio.from_container_bytes`` under this video's limits (audio
        duration, channels, sample rate), so a long or malformed track raises the same
        typed errors as an audio file would.
        """
        if not self.info.has_audio:
            return None
        from media.audio import Audio

        return Audio.from_container_bytes(self._data, self._limits)


def _spread(total: int, n: int) -> list[int]:
    """``n`` distinct indices evenly spread over ``0..total-1``, first and last included."""
    if n <= 0 or total <= 0:
        return []
    if n >= total:
        return list(range(total))
    if n == 1:
        return [0]
    return sorted(set(int(round(x)) for x in np.linspace(0, total - 1, n)))
