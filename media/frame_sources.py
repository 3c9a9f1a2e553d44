"""Where a ``Video``'s frames come from: FFmpeg through PyAV, or Pillow for animated WebP.

:func:`open_source` picks the source for a file's bytes (and refuses still images, audio
files and documents from their magic bytes). Both sources read the header at
construction and check every limit it can answer before a frame is decoded; ``decode``
then fills a :class:`FrameCollector` with exactly the requested frames.

:class:`AVFrameSource` demuxes with FFmpeg restricted to the video container formats
in :data:`AV_FORMATS` (MP4/MOV, Matroska/WebM, AVI, animated GIF/APNG, MPEG-TS/PS,
FLV, Ogg, ...). It decodes forward or seeks as a :class:`~media.timeline.DecodePlan`
says, and identifies each decoded frame by its pts on the
:class:`~media.timeline.Timeline`. FFmpeg here cannot decode animated WebP, so
:class:`WebPFrameSource` reads it with Pillow, one frame after the other.

Limits (``MediaLimits``) checked here on the header before decoding
(``Video.from_bytes`` has checked ``max_bytes``): ``max_frame_pixels`` (also passed to
the decoder as ``max_pixels``, so a stream that changes resolution mid-way cannot make
it allocate a bigger frame), ``max_video_seconds`` (the larger of the stream's and the
container's declared duration), and ``max_container_frames`` (declared count, or the
demux-only packet count, which stops counting at the limit). Animated GIF "bombs"
(thousands of tiny frames) are bounded by these: FFmpeg gives every GIF frame at least
20 ms, so an hour holds at most 180 000 frames; a 5000-frame 16x16 GIF samples in
~0.1-0.3 s and holds only the sampled frames. Deployments that want to refuse such
files outright lower ``max_container_frames``.

A requested frame that cannot be decoded is recorded in ``FrameCollector.errors``
(with the reason) and the decode goes on with the next one.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

import av
import numpy as np
from av.stream import Discard

from media.decode_errors import DECODE_ERRORS, describe
from media.errors import (
    CorruptMediaError,
    EmptyMediaError,
    MediaTooLargeError,
    MediaTooLongError,
    PieMediaError,
    UnsupportedFormatError,
)
from media.integrity import PNG_SIGNATURE, verify_png
from media.limits import MediaLimits
from media.sniff import Format, sniff
from media.timeline import SEEK_OVERHEAD_FRAMES, DecodePlan, Strategy, Timeline, plan_decode
from media.video_info import VideoInfo

__all__ = [
    "AV_FORMATS",
    "THREADING_MIN_PIXELS",
    "THREAD_TYPE",
    "AVFrameSource",
    "FrameCollector",
    "FrameSource",
    "WebPFrameSource",
    "open_source",
    "webp_animation",
]

KIND = "video"

THREAD_TYPE: str | None = "AUTO" if (os.cpu_count() or 1) >= 4 else None
"""FFmpeg decoder threading. Measured on the 2-core development machine (shared with
other work): frame threading made 720p H.264 decoding slower (430 ms vs 300 ms for 600
frames) and raised the cost of a seek (pipeline refill), so it is used only on
machines with 4 or more cores, and only for frames of at least ``THREADING_MIN_PIXELS``."""

THREADING_MIN_PIXELS = 640 * 360
"""Smaller frames decode faster than threads hand off work."""

AV_FORMATS = (
    "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,gif,apng,mpegts,mpeg,flv,ogg,asf,ivf,nut,m4v,h264,hevc"
)
"""FFmpeg demuxers accepted for video. Restricting the probe closes the door on demuxers
that open other resources (HLS, DASH, concat, image sequences) and on exotic parsers."""

_DECODE_ERRORS = (*DECODE_ERRORS, SyntaxError)  # Pillow raises SyntaxError for malformed headers


class FrameCollector:
    """Collects decoded target frames into one preallocated array."""

    def __init__(self, targets: Sequence[int], height: int, width: int):
        self.slot = {t: k for k, t in enumerate(targets)}
        """Row of ``frames`` that holds each target."""
        self.frames = np.empty((len(targets), height, width, 3), dtype=np.uint8)
        self.have: dict[int, float] = {}
        """Target index -> timestamp (s) of every frame delivered."""
        self.errors: dict[int, str] = {}
        """Target index -> why it could not be delivered (so far)."""
        self.frames_decoded = 0
        self.seeks = 0

    def wants(self, index: int) -> bool:
        return index in self.slot and index not in self.have


class AVFrameSource:
    """Video decoded by FFmpeg through PyAV."""

    def __init__(self, data: bytes, limits: MediaLimits, sniffed: Format | None):
        self.data = data
        self.limits = limits
        self._timeline: Timeline | None = None
        # Bytes that look like a video container and do not open are broken; anything
        # else that FFmpeg cannot open is simply not a video.
        looks_like_video = sniffed is not None and "video" in sniffed.holds
        try:
            container = self._open()
        except PieMediaError:
            raise
        except _DECODE_ERRORS as e:
            if looks_like_video:
                raise CorruptMediaError(
                    f"{sniffed.name} video could not be opened, the file is truncated or malformed "  # type: ignore[union-attr]
                    f"(e.g. an MP4 without its moov index): {describe(e)}",
                    kind=KIND,
                ) from None
            raise UnsupportedFormatError(
                "not a video container this library reads (MP4/MOV, Matroska/WebM, AVI, GIF, "
                f"animated WebP, MPEG-TS/PS, FLV, Ogg, ASF, ...); FFmpeg says: {describe(e)}",
                kind=KIND,
                actual=sniffed.name if sniffed else None,
            ) from None
        try:
            self.info = self._read_info(container, sniffed)
        finally:
            container.close()

    # -- opening

    def _open(self) -> av.container.InputContainer:
        return av.open(
            io.BytesIO(self.data),
            "r",
            container_options={"format_whitelist": AV_FORMATS, "protocol_whitelist": "none"},
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

    def _read_info(self, container: av.container.InputContainer, sniffed: Format | None) -> VideoInfo:
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
        if frame_count < 2 and ((sniffed is not None and sniffed.name == "gif") or fmt == "apng"):
            raise UnsupportedFormatError(
                f"a single-frame {fmt.upper()} is a still image, not a video; use media.Image", kind=KIND
            )
        duration = durations[0] if durations else (frame_count / fps if fps > 0 else 0.0)
        if fps <= 0 and duration > 0:
            fps = frame_count / duration
        has_audio = bool(container.streams.audio)
        return VideoInfo(fmt, cc.name, width, height, fps, duration, frame_count, source, has_audio)

    def _check_frames(self, n: int, verb: str) -> None:
        if n > self.limits.max_container_frames:
            raise MediaTooLongError(
                f"video {verb} {n} frames, over the limit of {self.limits.max_container_frames} frames",
                limit=self.limits.max_container_frames,
                actual=n,
                kind=KIND,
            )

    # -- demux-only pass

    def timeline(self) -> Timeline:
        """The frame timeline from a demux-only pass (made on first use, then kept)."""
        if self._timeline is None:
            self._timeline = self._scan()
        return self._timeline

    def frame_times(self) -> list[float] | None:
        """Every frame's pts (stream time base), or None when they are not all known."""
        tl = self.timeline()
        if tl.pts is None or len(tl.pts) != self.info.frame_count:
            return None
        return [float(p) for p in tl.pts]

    def _scan(self) -> Timeline:
        pts: list[int | None] = []
        key_pts: list[int] = []
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
                    pts.append(packet.pts)
                    if len(pts) > self.limits.max_container_frames:
                        self._check_frames(len(pts), "holds at least")
                    if packet.pts is not None and packet.is_keyframe:
                        key_pts.append(packet.pts)
            except PieMediaError:
                raise
            except _DECODE_ERRORS as e:
                error = f"demuxing stopped after {len(pts)} packets: {describe(e)}"
        finally:
            container.close()
        return Timeline.from_packets(pts, key_pts, error)

    # -- decoding

    def decode(self, targets: list[int], strategy: Strategy, out: FrameCollector) -> DecodePlan:
        """Decode ``targets`` (sorted, distinct) into ``out`` following the plan for
        ``strategy``; returns that plan."""
        tl = self.timeline()
        plan = plan_decode(targets, tl, strategy, SEEK_OVERHEAD_FRAMES)
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
            if THREAD_TYPE and self.info.width * self.info.height >= THREADING_MIN_PIXELS:
                cc.thread_type = THREAD_TYPE
            tb = stream.time_base or Fraction(1, 1)
            start = stream.start_time if stream.start_time is not None else (tl.pts[0] if tl.pts else 0)
            self._run(container, stream, plan, tl, tb, start, out)
        finally:
            container.close()
        return plan

    def _run(
        self,
        container: av.container.InputContainer,
        stream: av.VideoStream,
        plan: DecodePlan,
        tl: Timeline,
        tb: Fraction,
        start: int,
        out: FrameCollector,
    ) -> None:
        h, w = self.info.height, self.info.width
        fps = self.info.fps
        limit_px = self.limits.max_frame_pixels
        state: dict[str, Any] = {"last": -1, "first": None}  # last frame index produced; first after a seek
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
                out.errors[idx] = f"frame conversion failed: {describe(e)}"
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
                    demux_error = f"demuxer error: {describe(e)}"
                    packets = None
                    return
                try:
                    frames = packet.decode()
                except _DECODE_ERRORS as e:
                    bad = tl.index_of_pts(packet.pts) if packet.pts is not None else None
                    if bad is not None and out.wants(bad):
                        out.errors[bad] = f"decoder error: {describe(e)}"
                    continue
                for frame in frames:
                    out.frames_decoded += 1
                    idx = tl.frame_index(frame.pts, state["last"])
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


def webp_animation(data: bytes) -> tuple[int, int, list[int]] | None:
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


class WebPFrameSource:
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
        """Start time (s) of every frame."""
        for d in durations[:-1]:
            self.starts.append(self.starts[-1] + d / 1000.0)
        fps = n / duration if duration > 0 else 0.0
        self.info = VideoInfo("webp", "webp", width, height, fps, duration, n, "container", False)
        with self._open() as im:
            if getattr(im, "n_frames", 1) != n:
                raise CorruptMediaError(
                    f"animated WebP frame table disagrees with its decoder ({n} vs {im.n_frames} frames)",
                    kind=KIND,
                )

    def _open(self) -> Any:
        from PIL import Image as PILImage

        return PILImage.open(io.BytesIO(self.data), formats=["WEBP"])

    def timeline(self) -> None:
        """No timeline: Pillow cannot seek to a keyframe, so frames are always decoded in order."""
        return None

    def frame_times(self) -> list[float]:
        return self.starts

    def decode(self, targets: list[int], strategy: Strategy, out: FrameCollector) -> DecodePlan:
        """Decode ``targets`` (sorted, distinct) into ``out``, in order (``strategy`` is moot)."""
        plan = plan_decode(targets, None, "sequential", SEEK_OVERHEAD_FRAMES)
        w, h = self.info.width, self.info.height
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
                    out.errors[t] = f"decoder error: {describe(e)}"
                    continue
                out.frames_decoded += t - pos
                pos = t
                out.have[t] = self.starts[t]
        return plan


FrameSource = AVFrameSource | WebPFrameSource


def open_source(data: bytes, limits: MediaLimits) -> FrameSource:
    """The frame source for ``data``: Pillow for animated WebP, FFmpeg for the rest, after
    refusing what the magic bytes say is a still image, audio or a document."""
    fmt = sniff(data)
    if fmt is not None and fmt.holds == {"image"}:
        raise UnsupportedFormatError(
            f"{fmt.name.upper()} is a still image format, not a video; use media.Image",
            kind=KIND,
            actual=fmt.name,
        )
    if fmt is not None and fmt.holds == {"audio"}:
        raise UnsupportedFormatError(
            f"{fmt.label} audio file has no video stream; use media.Audio", kind=KIND, actual=fmt.name
        )
    if fmt is not None and fmt.kind == "document":
        what = "SVG (vector image)" if fmt.name == "svg" else fmt.description
        raise UnsupportedFormatError(f"{what} is not a video format", kind=KIND, actual=fmt.name)
    if fmt is not None and fmt.name == "webp":
        try:
            anim = webp_animation(data)
        except ValueError as e:
            raise CorruptMediaError(f"animated WebP is malformed: {e}", kind=KIND) from None
        if anim is None:
            raise UnsupportedFormatError(
                "WEBP without animation is a still image, not a video; use media.Image",
                kind=KIND,
                actual="webp",
            )
        return WebPFrameSource(data, limits, anim)
    if data.startswith(PNG_SIGNATURE):  # APNG: FFmpeg, like Pillow, skips the frame-data CRCs
        verify_png(data, kind=KIND)
    return AVFrameSource(data, limits, fmt)
