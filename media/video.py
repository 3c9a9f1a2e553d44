"""Video: container metadata, limit checks and frame sampling from raw bytes.

``Video.from_bytes`` reads only the container header (PyAV over ``io.BytesIO``) and
checks every limit on it before a single frame is decoded. Frames are decoded only by
``sample()`` / ``sample_indices()``, which hold exactly the requested frames.

Containers: whatever FFmpeg demuxes among the video container formats allowed in
``_AV_FORMATS`` (MP4/MOV, Matroska/WebM, AVI, animated GIF, MPEG-TS/PS, FLV, Ogg, ...).
FFmpeg here cannot decode animated WebP, so animated WebP goes through Pillow.
Still images (PNG, JPEG, a one-frame GIF, a still WebP) are refused: use ``media.Image``.

Frame identity. A demux-only pass over the video packets (no decoding, a few ms even
for a 60 s 720p clip) gives every frame's presentation timestamp and which frames are
keyframes. Frame ``i`` is the frame with the i-th smallest pts; a decoded frame is
identified by its pts, not by counting frames, so a corrupt or dropped frame never
shifts the identity of the frames after it, and seeking and sequential decoding return
the same frames for the same indices. Streams whose packets lack unique pts fall back
to counting decoded frames (and never seek).

Seek or decode forward. Decoding forward from the current position to the next wanted
frame costs ``target - position`` frame decodes; seeking costs ``target - keyframe + 1``
decodes plus a fixed overhead (demuxer seek, decoder flush, refilling the decoder's
thread/reorder pipeline) of about ``SEEK_OVERHEAD_FRAMES`` frame decodes, measured with
``bench/media_decode.py``. ``strategy="auto"`` takes, for every wanted frame, the cheaper
of the two: it seeks only when the gap it skips is larger than the overhead. So long
clips with frequent keyframes and sparse samples seek; dense samples or rare keyframes
(a long GOP) decode forward. ``"seek"`` seeks whenever the wanted frame's keyframe lies
ahead; ``"sequential"`` never seeks.

Limits (``MediaLimits``), all checked on the header before decoding: ``max_bytes``,
``max_frame_pixels`` (also passed to the decoder as ``max_pixels``, so a stream that
changes resolution mid-way cannot make it allocate a bigger frame), ``max_video_seconds``
(the larger of the stream's and the container's declared duration), and
``max_container_frames`` (declared count, or the demux-only packet count, which stops
counting at the limit). Animated GIF "bombs" (thousands of tiny frames) are bounded by
these: FFmpeg gives every GIF frame at least 20 ms, so an hour holds at most 180 000
frames; a 5000-frame 16x16 GIF samples in ~0.1-0.3 s and holds only the sampled
frames. Deployments that want to refuse such files outright lower
``max_container_frames``. ``sample()`` returns at most ``limits.max_frames`` frames.

Errors: only ``MediaError`` subclasses leave ``from_bytes``, ``sample`` and
``sample_indices``; a requested frame that cannot be decoded is skipped and reported in
``SampledFrames.skipped``, and ``CorruptMediaError`` is raised only when none can be.
"""

from __future__ import annotations

import bisect
import io
import math
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import av
import av.error
import numpy as np
from av.stream import Discard

from media.errors import (
    CorruptMediaError,
    EmptyMediaError,
    InvalidRequestError,
    MediaError,
    MediaTooLargeError,
    MediaTooLongError,
    PieMediaError,
    UnsupportedFormatError,
)
from media.hashing import content_hash
from media.limits import DEFAULT_LIMITS, MediaLimits

if TYPE_CHECKING:
    from media.audio import Audio

KIND = "video"

Strategy = Literal["auto", "seek", "sequential"]

SEEK_OVERHEAD_FRAMES = 8
"""Cost of one seek, in frame decodes, beyond the frames it decodes.

A seek flushes the demuxer and decoder; the decoder then re-fills its reorder buffer
(B-frames) before the wanted frame comes out, and the frames decoded past the wanted
one (sometimes the next GOP's keyframe) are wasted when the next wanted frame needs
another seek. Calibrated on the 2-core development machine with the 720p H.264 bench
clip (keyframe every 15 frames, B-frames): seeking to each of its 120 keyframes and
decoding k = 0, 4, 8, 13 frames after it, against decoding all 1800 frames, fits a
seek overhead of ~25 ms CPU = 8 frame decodes. The model needs only the order of
magnitude: it decides between skipping hundreds of frames or a handful.
"""

THREAD_TYPE: str | None = "AUTO" if (os.cpu_count() or 1) >= 4 else None
"""FFmpeg decoder threading. Measured on the 2-core development machine (shared with
other work): frame threading made 720p H.264 decoding slower (430 ms vs 300 ms for 600
frames) and raised the cost of a seek (pipeline refill), so it is used only on
machines with 4 or more cores, and only for frames of at least ``THREADING_MIN_PIXELS``."""

THREADING_MIN_PIXELS = 640 * 360
"""Smaller frames decode faster than threads hand off work."""

# FFmpeg demuxers accepted for video. Restricting the probe closes the door on demuxers
# that open other resources (HLS, DASH, concat, image sequences) and on exotic parsers.
_AV_FORMATS = (
    "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,gif,apng,mpegts,mpeg,flv,ogg,asf,ivf,nut,m4v,h264,hevc"
)

# Errors that decoders and parsers raise on hostile input; converted to MediaError.
_DECODE_ERRORS: tuple[type[BaseException], ...] = (
    av.error.FFmpegError,
    OSError,
    ValueError,
    IndexError,
    KeyError,
    EOFError,
    OverflowError,
    ZeroDivisionError,
    struct.error,
    SyntaxError,  # Pillow raises it for malformed headers
    RuntimeError,
    TypeError,
    AttributeError,
)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class SkippedFrame:
    """A requested frame that could not be returned."""

    index: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "reason": self.reason}


@dataclass
class SampledFrames:
    """Frames decoded from a video, in the order they were requested.

    ``frames[k]`` is the frame with index ``indices[k]`` shown at ``timestamps[k]``
    seconds from the start of the video stream (the frame's pts x time_base minus the
    stream's start time; ``index / fps`` where a frame has no pts). Requested frames
    that could not be decoded are absent from these three and listed in ``skipped``.
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


@dataclass(frozen=True)
class DecodePlan:
    """What decoding a set of frames will cost under each strategy (in frame decodes)."""

    targets: tuple[int, ...]
    sequential_frames: int
    """Frames decoded from the start through the last target."""
    seek_frames: int
    """Frames decoded when seeking to each target's keyframe whenever it lies ahead."""
    seek_count: int
    auto_frames: int
    """Frames decoded by the auto plan (which also pays ``auto_seeks`` seek overheads)."""
    auto_seeks: int
    seek_overhead_frames: float
    can_seek: bool
    seek_before: tuple[bool, ...]
    """For the chosen strategy: whether to seek before reaching ``targets[k]``."""
    strategy: str
    """The strategy these ``seek_before`` flags implement."""


# --------------------------------------------------------------------------- sniffing


def _sniff(data: bytes) -> str | None:
    """Name the format from magic bytes, or None when unknown.

    Used for the error messages and to route animated WebP to Pillow; FFmpeg still
    does the real probing of everything it reads.
    """
    head = data[:64]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        # An APNG has an acTL chunk before the first IDAT.
        idat = data.find(b"IDAT", 8, 1 << 20)
        actl = data.find(b"acTL", 8, idat if idat > 0 else 1 << 20)
        return "apng" if actl > 0 else "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:4] == b"RIFF" and len(head) >= 12:
        return {b"WEBP": "webp", b"AVI ": "avi", b"WAVE": "wav"}.get(head[8:12], "riff")
    if len(head) >= 12 and head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in (b"avif", b"heic", b"heix", b"mif1", b"msf1"):
            return "heif"
        return "isobmff"
    if len(head) >= 8 and head[4:8] in (b"moov", b"mdat", b"free", b"wide", b"skip"):
        return "isobmff"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska"
    if head.startswith(b"OggS"):
        return "ogg"
    if head.startswith(b"FLV"):
        return "flv"
    if head.startswith(b"\x30\x26\xb2\x75\x8e\x66\xcf\x11"):
        return "asf"
    if head.startswith(b"DKIF"):
        return "ivf"
    if len(data) > 376 and data[0] == 0x47 and data[188] == 0x47 and data[376] == 0x47:
        return "mpegts"
    if head.startswith(b"\x00\x00\x01\xba"):
        return "mpeg"
    if head.startswith(b"fLaC"):
        return "flac"
    if head.startswith(b"ID3") or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "mp3"
    if head.startswith((b"II*\x00", b"MM\x00*")):
        return "tiff"
    if head.startswith(b"BM") and len(data) > 26:
        return "bmp"
    stripped = head.lstrip()
    if stripped.startswith((b"<?xml", b"<svg", b"<!DOCTYPE svg")) or b"<svg" in data[:4096]:
        return "svg"
    sample = data[:4096]
    if sample and sum(32 <= b < 127 or b in (9, 10, 13) for b in sample) / len(sample) > 0.95:
        return "text"
    return None


_STILL = {"png", "jpeg", "tiff", "bmp", "heif"}
_AUDIO = {"wav", "flac", "mp3"}
_VIDEO_CONTAINERS = {
    "apng",
    "gif",
    "avi",
    "isobmff",
    "matroska",
    "ogg",
    "flv",
    "asf",
    "ivf",
    "mpegts",
    "mpeg",
}


def _webp_animation(data: bytes) -> tuple[int, int, list[int]] | None:
    """Canvas size and per-frame durations (ms) of an animated WebP, None if still.

    Written by hand because Pillow exposes a frame's duration only after decoding the
    frame; walking the RIFF chunks (VP8X header, one ANMF chunk per frame) costs
    nothing. Raises ValueError on a malformed chunk list.
    """
    if len(data) < 30 or data[12:16] != b"VP8X":
        return None
    flags = data[20]
    if not flags & 0x02:  # animation flag
        return None
    width = 1 + int.from_bytes(data[24:27], "little")
    height = 1 + int.from_bytes(data[27:30], "little")
    durations: list[int] = []
    pos = 12
    end = min(len(data), 8 + int.from_bytes(data[4:8], "little"))
    while pos + 8 <= end:
        tag = data[pos : pos + 4]
        size = int.from_bytes(data[pos + 4 : pos + 8], "little")
        if pos + 8 + size > len(data):
            raise ValueError(f"WebP chunk {tag!r} runs past the end of the data")
        if tag == b"ANMF":
            if size < 16:
                raise ValueError("WebP ANMF chunk too short")
            durations.append(int.from_bytes(data[pos + 20 : pos + 23], "little"))
        pos += 8 + size + (size & 1)
    # Like browsers (and FFmpeg for GIF), a frame delay of 10 ms or less means 100 ms.
    return width, height, [d if d > 10 else 100 for d in durations]


# --------------------------------------------------------------------------- errors


def _describe(exc: BaseException) -> str:
    """The library's own words: FFmpeg's error string without errno noise."""
    if isinstance(exc, av.error.FFmpegError):
        return exc.strerror or type(exc).__name__
    return str(exc) or type(exc).__name__


def _convert(exc: BaseException, what: str, default: type[MediaError] = CorruptMediaError) -> PieMediaError:
    if isinstance(exc, PieMediaError):
        return exc
    if isinstance(exc, MemoryError):
        return MediaTooLargeError(f"{what}: ran out of memory while decoding", kind=KIND)
    return default(f"{what}: {type(exc).__name__}: {_describe(exc)}", kind=KIND)


# --------------------------------------------------------------------------- timeline


@dataclass(frozen=True)
class _Timeline:
    """Per-frame facts from a demux-only pass (packets, no decoding)."""

    pts: list[int] | None
    """Sorted presentation timestamps, one per frame; None when packets lack unique pts."""
    keyframes: list[int]
    """Presentation indices of keyframes, sorted (only meaningful when ``pts`` is set)."""
    packets: int
    error: str | None = None
    """Why the pass stopped early (demuxer error), if it did."""

    def keyframe_at_or_before(self, index: int) -> int:
        k = bisect.bisect_right(self.keyframes, index) - 1
        return self.keyframes[k] if k >= 0 else 0


def _plan(
    targets: Sequence[int], timeline: _Timeline | None, strategy: Strategy, overhead: float
) -> DecodePlan:
    """Estimate frames decoded under each strategy and pick where to seek."""
    targets = tuple(targets)
    can_seek = bool(timeline is not None and timeline.pts is not None and len(timeline.keyframes) > 1)
    seq = (targets[-1] + 1) if targets else 0

    def simulate(threshold: float) -> tuple[int, int, tuple[bool, ...]]:
        pos, cost, seeks, flags = -1, 0, 0, []
        for t in targets:
            if t <= pos:  # already decoded (only for duplicate/unsorted input)
                flags.append(False)
                continue
            kf = timeline.keyframe_at_or_before(t) if can_seek else 0  # type: ignore[union-attr]
            skipped = kf - (pos + 1)
            if can_seek and skipped > threshold:
                cost += t - kf + 1
                seeks += 1
                flags.append(True)
            else:
                cost += t - pos
                flags.append(False)
            pos = t
        return cost, seeks, tuple(flags)

    seek_cost, seek_n, seek_flags = simulate(0)
    auto_cost, auto_n, auto_flags = simulate(overhead)
    if strategy == "sequential" or not can_seek:
        flags, chosen = tuple(False for _ in targets), "sequential"
    elif strategy == "seek":
        flags, chosen = seek_flags, "seek"
    else:
        flags = auto_flags
        chosen = "sequential" if auto_n == 0 else ("seek" if all(auto_flags[1:]) else "mixed")
    return DecodePlan(
        targets=targets,
        sequential_frames=seq,
        seek_frames=seek_cost,
        seek_count=seek_n,
        auto_frames=auto_cost,
        auto_seeks=auto_n,
        seek_overhead_frames=overhead,
        can_seek=can_seek,
        seek_before=flags,
        strategy=chosen,
    )


# --------------------------------------------------------------------------- sources


@dataclass
class _Meta:
    format: str
    codec: str
    width: int
    height: int
    fps: float
    duration: float
    frame_count: int
    frame_count_source: str
    has_audio: bool


class _Decoded:
    """Collects decoded target frames into one preallocated array."""

    def __init__(self, targets: Sequence[int], height: int, width: int):
        self.slot = {t: k for k, t in enumerate(targets)}
        self.frames = np.empty((len(targets), height, width, 3), dtype=np.uint8)
        self.have: dict[int, float] = {}
        self.errors: dict[int, str] = {}
        self.frames_decoded = 0
        self.seeks = 0

    def wants(self, index: int) -> bool:
        return index in self.slot and index not in self.have


class _AVSource:
    """Video decoded by FFmpeg through PyAV."""

    def __init__(self, data: bytes, limits: MediaLimits, sniffed: str | None):
        self.data = data
        self.limits = limits
        self._timeline: _Timeline | None = None
        default = CorruptMediaError if sniffed in _VIDEO_CONTAINERS else UnsupportedFormatError
        try:
            container = self._open()
        except PieMediaError:
            raise
        except _DECODE_ERRORS as e:
            name = sniffed or "the data"
            if default is CorruptMediaError:
                raise CorruptMediaError(
                    f"{name} video could not be opened, the file is truncated or malformed "
                    f"(e.g. an MP4 without its moov index): {_describe(e)}",
                    kind=KIND,
                ) from None
            raise UnsupportedFormatError(
                "not a video container this library reads (MP4/MOV, Matroska/WebM, AVI, GIF, "
                f"animated WebP, MPEG-TS/PS, FLV, Ogg, ASF, ...); FFmpeg says: {_describe(e)}",
                kind=KIND,
                actual=sniffed,
            ) from None
        try:
            self.meta = self._read_meta(container, sniffed)
        finally:
            container.close()

    # -- opening

    def _open(self) -> av.container.InputContainer:
        return av.open(
            io.BytesIO(self.data),
            "r",
            container_options={"format_whitelist": _AV_FORMATS, "protocol_whitelist": "none"},
        )

    def _video_stream(self, container: av.container.InputContainer) -> av.VideoStream:
        streams = container.streams.video
        if not streams:
            kinds = sorted({s.type for s in container.streams}) or ["none"]
            raise UnsupportedFormatError(
                f"{container.format.name} file has no video stream (streams: {', '.join(kinds)})",
                kind=KIND,
            )
        return streams[0]

    def _read_meta(self, container: av.container.InputContainer, sniffed: str | None) -> _Meta:
        fmt = container.format.name
        if fmt.endswith("_pipe") or fmt == "image2":
            raise UnsupportedFormatError(
                f"{fmt} is a still image format, not a video; use media.Image", kind=KIND
            )
        stream = self._video_stream(container)
        cc = stream.codec_context
        if cc is None:
            raise UnsupportedFormatError("the video stream's codec has no decoder here", kind=KIND)
        width, height = int(cc.width or 0), int(cc.height or 0)
        if width <= 0 or height <= 0:
            raise CorruptMediaError(f"video stream ({cc.name}) declares no frame size", kind=KIND)
        pixels = width * height
        if pixels > self.limits.max_frame_pixels:
            raise MediaTooLargeError(
                f"video frames are {width}x{height} = {pixels} pixels, over the limit of "
                f"{self.limits.max_frame_pixels} pixels per frame",
                limit=self.limits.max_frame_pixels,
                actual=pixels,
                kind=KIND,
            )
        durations = []
        if stream.duration is not None and stream.time_base is not None and stream.duration > 0:
            durations.append(float(stream.duration * stream.time_base))
        if container.duration is not None and container.duration > 0:
            durations.append(container.duration / av.time_base)
        longest = max(durations, default=0.0)
        if not math.isfinite(longest) or longest > self.limits.max_video_seconds:
            raise MediaTooLongError(
                f"video declares a duration of {longest:.1f} s, over the limit of "
                f"{self.limits.max_video_seconds:.1f} s",
                limit=self.limits.max_video_seconds,
                actual=longest,
                kind=KIND,
            )
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        declared = int(stream.frames or 0)
        self._check_frames(declared, "declares")
        if declared > 0:
            frame_count, source = declared, "container"
        else:
            # No count in the header (Matroska/WebM, some AVI/TS): count packets.
            tl = self.timeline()
            if tl.packets > 0 and tl.error is None:
                frame_count, source = tl.packets, "demux"
            elif longest > 0 and fps > 0:
                frame_count, source = max(tl.packets, round(longest * fps)), "estimate"
                self._check_frames(frame_count, "would hold about")
            else:
                frame_count, source = tl.packets, "demux"
        if frame_count <= 0:
            raise EmptyMediaError("video stream has no frames", kind=KIND)
        if frame_count < 2 and (sniffed == "gif" or fmt == "apng"):
            raise UnsupportedFormatError(
                f"a single-frame {fmt.upper()} is a still image, not a video; use media.Image", kind=KIND
            )
        duration = durations[0] if durations else (frame_count / fps if fps > 0 else 0.0)
        if fps <= 0 and duration > 0:
            fps = frame_count / duration
        has_audio = bool(container.streams.audio)
        return _Meta(fmt, cc.name, width, height, fps, duration, frame_count, source, has_audio)

    def _check_frames(self, n: int, verb: str) -> None:
        if n > self.limits.max_container_frames:
            raise MediaTooLongError(
                f"video {verb} {n} frames, over the limit of {self.limits.max_container_frames} frames",
                limit=self.limits.max_container_frames,
                actual=n,
                kind=KIND,
            )

    # -- demux-only pass

    def timeline(self) -> _Timeline:
        if self._timeline is None:
            self._timeline = self._scan()
        return self._timeline

    def _scan(self) -> _Timeline:
        pts: list[int] = []
        key_pts: list[int] = []
        missing_pts = False
        n = 0
        error = None
        container = self._open()
        try:
            stream = self._video_stream(container)
            for other in container.streams:
                if other.index != stream.index:
                    other.discard = Discard.all
            try:
                for packet in container.demux(stream):
                    if packet.size == 0 or packet.is_discard:
                        continue
                    n += 1
                    if n > self.limits.max_container_frames:
                        self._check_frames(n, "holds at least")
                    if packet.pts is None:
                        missing_pts = True
                    else:
                        pts.append(packet.pts)
                        if packet.is_keyframe:
                            key_pts.append(packet.pts)
            except PieMediaError:
                raise
            except _DECODE_ERRORS as e:
                error = f"demuxing stopped after {n} packets: {_describe(e)}"
        finally:
            container.close()
        if missing_pts or len(set(pts)) != len(pts):
            return _Timeline(None, [], n, error)
        pts.sort()
        where = {p: i for i, p in enumerate(pts)}
        keyframes = sorted(where[p] for p in key_pts)
        if not keyframes or keyframes[0] != 0:
            keyframes.insert(0, 0)
        return _Timeline(pts, keyframes, n, error)

    # -- decoding

    def decode(self, targets: list[int], strategy: Strategy, out: _Decoded) -> DecodePlan:
        tl = self.timeline()
        plan = _plan(targets, tl, strategy, SEEK_OVERHEAD_FRAMES)
        container = self._open()
        try:
            stream = self._video_stream(container)
            for other in container.streams:
                if other.index != stream.index:
                    other.discard = Discard.all
            cc = stream.codec_context
            # The decoder itself refuses frames over the pixel limit (e.g. a mid-stream
            # resolution change), so it never allocates them.
            cc.options = {"max_pixels": str(self.limits.max_frame_pixels)}
            if THREAD_TYPE and self.meta.width * self.meta.height >= THREADING_MIN_PIXELS:
                cc.thread_type = THREAD_TYPE
            tb = stream.time_base or Fraction(1, 1)
            start = stream.start_time if stream.start_time is not None else (tl.pts[0] if tl.pts else 0)
            self._run(container, stream, plan, tl, tb, start, out)
        finally:
            container.close()
        return plan

    def _index_of(self, frame: av.VideoFrame, tl: _Timeline, last: int) -> int:
        if tl.pts is not None and frame.pts is not None:
            k = bisect.bisect_left(tl.pts, frame.pts)
            if k < len(tl.pts) and tl.pts[k] == frame.pts:
                return k
            # A pts the demuxer never announced: take the nearest frame.
            if k > 0 and (k == len(tl.pts) or frame.pts - tl.pts[k - 1] < tl.pts[k] - frame.pts):
                return k - 1
            return min(k, len(tl.pts) - 1)
        return last + 1

    def _run(
        self,
        container: av.container.InputContainer,
        stream: av.VideoStream,
        plan: DecodePlan,
        tl: _Timeline,
        tb: Fraction,
        start: int,
        out: _Decoded,
    ) -> None:
        h, w = self.meta.height, self.meta.width
        fps = self.meta.fps
        limit_px = self.limits.max_frame_pixels
        state = {"last": -1, "first": None}  # last frame index produced; first after a seek
        packets: Iterator[av.Packet] | None = None
        demux_error: str | None = None

        def keep(frame: av.VideoFrame, idx: int) -> None:
            fpx = frame.width * frame.height
            if fpx > limit_px:
                out.errors[idx] = f"frame is {frame.width}x{frame.height}, over the pixel limit {limit_px}"
                return
            try:
                if frame.width != w or frame.height != h:
                    frame = frame.reformat(width=w, height=h)
                out.frames[out.slot[idx]] = frame.to_ndarray(format="rgb24")
            except _DECODE_ERRORS as e:
                out.errors[idx] = f"frame conversion failed: {_describe(e)}"
                return
            if frame.pts is not None:
                ts = float((frame.pts - start) * tb)
            else:
                ts = idx / fps if fps > 0 else 0.0
            out.have[idx] = ts
            out.errors.pop(idx, None)

        def advance(t: int) -> None:
            """Decode forward until frame ``t`` (or a later one) comes out, or the stream ends."""
            nonlocal packets, demux_error
            while state["last"] < t and packets is not None:
                try:
                    packet = next(packets)
                except StopIteration:
                    packets = None
                    return
                except _DECODE_ERRORS as e:
                    demux_error = f"demuxer error: {_describe(e)}"
                    packets = None
                    return
                try:
                    frames = packet.decode()
                except _DECODE_ERRORS as e:
                    bad = self._index_of_pts(packet.pts, tl) if packet.pts is not None else None
                    if bad is not None and out.wants(bad):
                        out.errors[bad] = f"decoder error: {_describe(e)}"
                    continue
                for frame in frames:
                    out.frames_decoded += 1
                    idx = self._index_of(frame, tl, state["last"])
                    if state["first"] is None:
                        state["first"] = idx
                    state["last"] = max(state["last"], idx) if tl.pts is not None else idx
                    if out.wants(idx):
                        keep(frame, idx)

        for t, seek in zip(plan.targets, plan.seek_before, strict=True):
            if not out.wants(t) or (t <= state["last"] and not seek):
                continue
            if not seek:
                if packets is None and state["last"] < 0:
                    packets = container.demux(stream)
                advance(t)
                continue
            # Seek to the keyframe before t. If the demuxer lands after t (some index by
            # dts, or a keyframe is not where its packet flag said), step further back.
            kf = tl.keyframe_at_or_before(t)
            tried: list[int] = []
            for k in (kf, tl.keyframe_at_or_before(kf - 1) if kf > 0 else 0, 0):
                if k in tried:
                    continue
                tried.append(k)
                try:
                    container.seek(tl.pts[k], stream=stream, backward=True)  # type: ignore[index]
                except _DECODE_ERRORS:
                    continue
                out.seeks += 1
                packets = container.demux(stream)
                state["last"], state["first"] = -1, None
                demux_error = None
                advance(t)
                first = state["first"]
                if first is not None and first > t and out.wants(t):
                    continue
                break
            if out.wants(t) and state["first"] is not None and state["first"] > t:
                out.errors.setdefault(t, "seeking landed after this frame")
        if demux_error:
            for t in plan.targets:
                if out.wants(t):
                    out.errors.setdefault(t, demux_error)

    @staticmethod
    def _index_of_pts(pts: int, tl: _Timeline) -> int | None:
        if tl.pts is None:
            return None
        k = bisect.bisect_left(tl.pts, pts)
        return k if k < len(tl.pts) and tl.pts[k] == pts else None


class _WebPSource:
    """Animated WebP through Pillow (FFmpeg here has no animated-WebP decoder)."""

    def __init__(self, data: bytes, limits: MediaLimits, anim: tuple[int, int, list[int]]):
        self.data = data
        self.limits = limits
        width, height, durations = anim
        pixels = width * height
        if pixels > limits.max_frame_pixels:
            raise MediaTooLargeError(
                f"animated WebP canvas is {width}x{height} = {pixels} pixels, over the limit of "
                f"{limits.max_frame_pixels} pixels per frame",
                limit=limits.max_frame_pixels,
                actual=pixels,
                kind=KIND,
            )
        n = len(durations)
        if n > limits.max_container_frames:
            raise MediaTooLongError(
                f"animated WebP has {n} frames, over the limit of {limits.max_container_frames} frames",
                limit=limits.max_container_frames,
                actual=n,
                kind=KIND,
            )
        if n == 0:
            raise EmptyMediaError("animated WebP has no frames", kind=KIND)
        if n == 1:
            raise UnsupportedFormatError(
                "a single-frame WebP is a still image, not a video; use media.Image", kind=KIND
            )
        duration = sum(durations) / 1000.0
        if duration > limits.max_video_seconds:
            raise MediaTooLongError(
                f"animated WebP lasts {duration:.1f} s, over the limit of {limits.max_video_seconds:.1f} s",
                limit=limits.max_video_seconds,
                actual=duration,
                kind=KIND,
            )
        self.starts = [0.0]
        for d in durations[:-1]:
            self.starts.append(self.starts[-1] + d / 1000.0)
        fps = n / duration if duration > 0 else 0.0
        self.meta = _Meta("webp", "webp", width, height, fps, duration, n, "container", False)
        with self._open() as im:
            if getattr(im, "n_frames", 1) != n:
                raise CorruptMediaError(
                    f"animated WebP frame table disagrees with its decoder ({n} vs {im.n_frames} frames)",
                    kind=KIND,
                )

    def _open(self):
        from PIL import Image as PILImage

        return PILImage.open(io.BytesIO(self.data), formats=["WEBP"])

    def decode(self, targets: list[int], strategy: Strategy, out: _Decoded) -> DecodePlan:
        plan = _plan(targets, None, "sequential", SEEK_OVERHEAD_FRAMES)
        w, h = self.meta.width, self.meta.height
        with self._open() as im:
            pos = -1
            for t in plan.targets:
                if not out.wants(t):
                    continue
                try:
                    im.seek(t)
                    im.load()
                    frame = im.convert("RGB")
                    if frame.size != (w, h):
                        frame = frame.resize((w, h))
                    out.frames[out.slot[t]] = np.asarray(frame)
                except _DECODE_ERRORS as e:
                    out.errors[t] = f"decoder error: {_describe(e)}"
                    continue
                out.frames_decoded += t - pos
                pos = t
                out.have[t] = self.starts[t]
        return plan


# --------------------------------------------------------------------------- Video


class Video:
    """A validated video: metadata from the container header, frames on demand.

    Build with :meth:`from_bytes` or :meth:`from_path`. Nothing is decoded until
    :meth:`sample` or :meth:`sample_indices`; every limit in ``MediaLimits`` that the
    header can answer (bytes, frame pixels, duration, frame count) is checked first.
    """

    def __init__(self, source: _AVSource | _WebPSource, data_hash: str, size_bytes: int, limits: MediaLimits):
        self._src = source
        self._data = source.data
        self._limits = limits
        self.content_hash = data_hash
        """SHA-256/128 of the raw bytes (``media.hashing.content_hash``)."""
        self.size_bytes = size_bytes

    # -- construction

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, limits: MediaLimits | None = None) -> Video:
        """Open a video from its encoded bytes; raises only ``MediaError`` subclasses."""
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
            sniffed = _sniff(data)
            if sniffed in _STILL:
                raise UnsupportedFormatError(
                    f"{sniffed.upper()} is a still image format, not a video; use media.Image",
                    kind=KIND,
                    actual=sniffed,
                )
            if sniffed in _AUDIO:
                raise UnsupportedFormatError(
                    f"{sniffed.upper()} audio file has no video stream; use media.Audio",
                    kind=KIND,
                    actual=sniffed,
                )
            if sniffed in ("svg", "text"):
                what = "SVG (vector image)" if sniffed == "svg" else "text"
                raise UnsupportedFormatError(f"{what} is not a video format", kind=KIND, actual=sniffed)
            source: _AVSource | _WebPSource
            if sniffed == "webp":
                try:
                    anim = _webp_animation(data)
                except ValueError as e:
                    raise CorruptMediaError(f"animated WebP is malformed: {e}", kind=KIND) from None
                if anim is None:
                    raise UnsupportedFormatError(
                        "WEBP without animation is a still image, not a video; use media.Image",
                        kind=KIND,
                        actual="webp",
                    )
                source = _WebPSource(data, limits, anim)
            else:
                source = _AVSource(data, limits, sniffed)
            return cls(source, content_hash(data), len(data), limits)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            raise _convert(e, "video could not be opened") from None

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
    def limits(self) -> MediaLimits:
        return self._limits

    @property
    def width(self) -> int:
        return self._src.meta.width

    @property
    def height(self) -> int:
        return self._src.meta.height

    @property
    def fps(self) -> float:
        """Average frame rate (the container's average rate; frames / duration as a fallback)."""
        return self._src.meta.fps

    @property
    def duration(self) -> float:
        """Duration in seconds: the video stream's, else the container's, else frames / fps."""
        return self._src.meta.duration

    @property
    def frame_count(self) -> int:
        """Number of frames.

        Where it comes from is in :attr:`frame_count_source`:

        * ``"container"``: the count the container declares (MP4/MOV sample tables, AVI,
          GIF, WebP), read from the header, exact for intact files;
        * ``"demux"``: the container does not say (Matroska/WebM, MPEG-TS), so the video
          packets were counted in a demux-only pass (no decoding), exact;
        * ``"estimate"``: demuxing failed part-way, so ``round(duration * fps)``.

        A truncated file may declare more frames than it holds; sampling reports the
        missing ones in ``SampledFrames.skipped``.
        """
        return self._src.meta.frame_count

    @property
    def frame_count_source(self) -> str:
        return self._src.meta.frame_count_source

    @property
    def format(self) -> str:
        """Container format as FFmpeg names it (e.g. ``mov,mp4,m4a,3gp,3g2,mj2``), or ``webp``."""
        return self._src.meta.format

    @property
    def codec(self) -> str:
        return self._src.meta.codec

    @property
    def has_audio(self) -> bool:
        return self._src.meta.has_audio

    @property
    def keyframe_indices(self) -> list[int]:
        """Indices of keyframes (from a demux-only pass; ``[0]`` when unknown)."""
        try:
            tl = self._timeline()
        except MediaError:
            return [0]
        return list(tl.keyframes) if tl is not None and tl.pts is not None else [0]

    def info(self) -> dict[str, Any]:
        """JSON-ready metadata."""
        m = self._src.meta
        return {
            "kind": KIND,
            "format": m.format,
            "codec": m.codec,
            "width": m.width,
            "height": m.height,
            "fps": m.fps,
            "duration": m.duration,
            "frame_count": m.frame_count,
            "frame_count_source": m.frame_count_source,
            "has_audio": m.has_audio,
            "size_bytes": self.size_bytes,
            "content_hash": self.content_hash,
        }

    def __repr__(self) -> str:
        m = self._src.meta
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
        n_total = self.frame_count
        cap = self._limits.max_frames
        if max_frames is not None:
            if (
                isinstance(max_frames, bool)
                or not isinstance(max_frames, (int, np.integer))
                or max_frames < 1
            ):
                raise InvalidRequestError(
                    f"max_frames must be a positive integer, got {max_frames!r}", kind=KIND
                )
            cap = min(cap, int(max_frames))
        if fps is None:
            n = min(cap, n_total)
            return _spread(n_total, n)
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
            raise InvalidRequestError(f"fps must be a positive finite number, got {fps!r}", kind=KIND)
        duration = self.duration if self.duration > 0 else (n_total / self.fps if self.fps > 0 else 0.0)
        n = max(1, min(cap, n_total, round(duration * fps)))
        pts = self._frame_times()
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
        ``"auto"`` uses the cost model described in the module docstring.
        """
        try:
            indices = self.uniform_indices(max_frames, fps)
            return self._sample(indices, strategy)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            raise _convert(e, "video frames could not be decoded") from None

    def sample_indices(self, indices: Sequence[int], *, strategy: Strategy = "auto") -> SampledFrames:
        """Decode exactly these frames (indices into the frames ``0..frame_count-1``).

        Frames come back in the order given; repeated indices are decoded once and
        repeated in the result. For reproducing a reference processor's frame choice.
        """
        try:
            idx = []
            for i in indices:
                if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                    raise InvalidRequestError(f"frame indices must be integers, got {i!r}", kind=KIND)
                if not 0 <= int(i) < self.frame_count:
                    raise InvalidRequestError(
                        f"frame index {int(i)} is outside 0..{self.frame_count - 1}",
                        limit=self.frame_count - 1,
                        actual=int(i),
                        kind=KIND,
                    )
                idx.append(int(i))
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
            if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            raise _convert(e, "video frames could not be decoded") from None

    def decode_plan(self, indices: Sequence[int], strategy: Strategy = "auto") -> DecodePlan:
        """The cost estimates and seek decisions for decoding ``indices`` (no decoding)."""
        targets = sorted(set(int(i) for i in indices))
        return _plan(targets, self._timeline(), strategy, SEEK_OVERHEAD_FRAMES)

    def _timeline(self) -> _Timeline | None:
        return self._src.timeline() if isinstance(self._src, _AVSource) else None

    def _frame_times(self) -> list[float] | None:
        if isinstance(self._src, _WebPSource):
            return self._src.starts
        tl = self._src.timeline()
        if tl.pts is None or len(tl.pts) != self.frame_count:
            return None
        return [float(p) for p in tl.pts]

    def _sample(self, indices: list[int], strategy: Strategy) -> SampledFrames:
        if strategy not in ("auto", "seek", "sequential"):
            raise InvalidRequestError(
                f"strategy must be auto, seek or sequential, got {strategy!r}", kind=KIND
            )
        need = len(indices) * self.width * self.height * 3
        if need > self._limits.max_sample_bytes:
            raise MediaTooLargeError(
                f"{len(indices)} frames of {self.width}x{self.height} need {need} bytes, over the "
                f"limit of {self._limits.max_sample_bytes} bytes per sample() call; ask for fewer frames",
                limit=self._limits.max_sample_bytes,
                actual=need,
                kind=KIND,
            )
        targets = sorted(set(indices))
        m = self._src.meta
        out = _Decoded(targets, m.height, m.width)
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
            fps=m.fps,
            duration=m.duration,
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
        if not self.has_audio:
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
