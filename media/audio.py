"""Audio: a decoded, validated, content-hashed clip, independent of any model.

Decoding routes (chosen by sniffing the first bytes, never by file name):

* libsndfile (``soundfile``): WAV / RF64 / W64, FLAC, Ogg (Vorbis, Opus), AIFF, AU,
  CAF. If libsndfile cannot open the bytes (a codec it lacks, e.g. MP3-in-WAV or
  Speex-in-Ogg), cannot tell their length (a streamed FLAC with no sample count) or
  finds no samples, PyAV gets a second try.
* PyAV (FFmpeg): MP3, MP4 / M4A / MOV (AAC, ALAC ...), Matroska / WebM, ADTS AAC,
  ASF/WMA, AMR, AC-3, FLV, AVI, MPEG-TS/PS, WavPack, APE. MP3 goes here although
  libsndfile reads it: libsndfile 1.2 stops at its length *estimate* for a VBR MP3
  without a Xing header and silently drops the rest; FFmpeg decodes it all (and is
  gapless where a LAME/Xing header says so, like libsndfile). The first audio stream
  is decoded without resampling. Video containers with an audio track go through
  here too: ``Audio.from_bytes`` accepts them, and ``Audio.from_container_bytes``
  skips the sniffing for callers (``media.Video``) that already know the bytes are a
  container.

Limits (``MediaLimits``) are enforced in this order: byte size; then, from the header
and before any sample is decoded, sample rate, channel count and declared duration;
then, while decoding, the decoded duration (a header can lie, so decoding stops as
soon as the limit is passed and memory stays bounded by the limit).

Truncated and lying files, decided here:

* WAV: the ``data`` chunk size is exact, so a file whose ``data`` chunk claims more
  bytes than are present is truncated or lying and raises ``CorruptMediaError``
  (libsndfile and FFmpeg would silently clamp, so the header is read by hand). A
  claim longer than ``max_audio_seconds`` raises ``MediaTooLongError`` first. The
  streaming placeholder size ``0xFFFFFFFF`` (written by recorders that could not
  seek back) means "unknown": what is present is decoded and its real duration
  reported. A ``data`` chunk of size 0 is ``EmptyMediaError``.
* FLAC: STREAMINFO's sample count is exact; fewer decoded samples (or a lost sync)
  is ``CorruptMediaError``.
* Frame streams (MP3, ADTS AAC) and other FFmpeg-read formats: the whole frames
  present are decoded and the real duration is reported. MP3 is lenient on purpose:
  without a Xing header its length is only an estimate, so a shortfall does not
  prove truncation. A cut that breaks the container structure (an Ogg page, an MP4
  without its ``moov``) is ``CorruptMediaError``; so is a file that stops mid-frame
  where the decoder says so.

Only ``MediaError`` subclasses leave ``from_bytes``/``from_container_bytes``.
"""

from __future__ import annotations

import io
import math
import numbers
import os
import struct
from dataclasses import dataclass
from typing import Any

import av
import av.error
import numpy as np
import soundfile as sf
import soxr

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

__all__ = ["Audio", "RESAMPLE_QUALITY"]

KIND = "audio"

RESAMPLE_QUALITY = "HQ"
"""soxr quality used by :meth:`Audio.resampled`: ``"HQ"`` is what
``librosa.resample(res_type="soxr_hq")`` (librosa's default, and so the model
processors') uses; the output is bit-identical to librosa's."""

_BLOCK_FRAMES = 1 << 18
"""Frames read per block when the header's length is not trusted for one read."""

_TRUSTED_EXPANSION = 4
"""A header's frame count is read in one allocation only while frames x channels is at
most this many times the input's byte count (16 bytes of float32 per input byte:
any PCM, typical FLAC). Beyond that (a FLAC header can claim anything) decoding goes
block by block, so memory follows the samples really decoded, never the claim."""

_SF_UNKNOWN_FRAMES = 2**63 - 1
"""libsndfile's frame count for 'length unknown' (SF_COUNT_MAX)."""

_WAV_STREAMING_SIZE = 0xFFFFFFFF
"""RIFF chunk size written when the writer could not seek back to fill it in."""

_AV_TRIM_SLACK = 4096
"""At most this many decoded frames past the stream's declared duration are codec
padding (AAC's last frame) and are trimmed; more is kept."""

# Exceptions the decoders raise on bad input. MediaError is a ValueError, so every
# handler re-raises MediaError first.
_DECODER_ERRORS: tuple[type[BaseException], ...] = (
    sf.LibsndfileError,
    sf.SoundFileError,
    av.error.FFmpegError,
    RuntimeError,
    OSError,
    ValueError,
    EOFError,
    TypeError,
    IndexError,
    KeyError,
    AttributeError,
    OverflowError,
    ZeroDivisionError,
    struct.error,
    NotImplementedError,
)

_SNDFILE = "sndfile"
_AV = "av"


# --------------------------------------------------------------------------- sniffing


def _sniff(data: bytes) -> tuple[str, str | None]:
    """(format label, decoder route) from the magic bytes; route None: not audio."""
    h = data[:64]
    tag, form = h[:4], h[8:12]
    if form == b"WAVE" and tag == b"RIFF":
        return "WAV", _SNDFILE
    if form == b"WAVE" and tag in (b"RF64", b"BW64"):
        return "RF64", _SNDFILE
    if h[:16] == b"riff\x2e\x91\xcf\x11\xa5\xd6\x28\xdb\x04\xc1\x00\x00":
        return "W64", _SNDFILE
    if tag == b"fLaC":
        return "FLAC", _SNDFILE
    if tag == b"OggS":
        return "OGG", _SNDFILE
    if tag == b"FORM" and form in (b"AIFF", b"AIFC"):
        return "AIFF", _SNDFILE
    if tag == b".snd":
        return "AU", _SNDFILE
    if tag == b"caff":
        return "CAF", _SNDFILE
    if h[:3] == b"ID3":
        return "MP3", _AV
    if len(h) >= 2 and h[0] == 0xFF and (h[1] & 0xE0) == 0xE0:
        # 11-bit frame sync; layer bits 00 are "reserved" for MPEG audio and mark ADTS AAC.
        if (h[1] >> 1) & 0x3 == 0:
            return "AAC", _AV
        return "MP3", _AV
    if h[4:8] == b"ftyp":
        brand = h[8:12]
        if brand in (b"M4A ", b"M4B ", b"M4P "):
            return "M4A", _AV
        return ("MOV" if brand == b"qt  " else "MP4"), _AV
    if h[4:8] in (b"moov", b"mdat", b"free", b"wide", b"skip"):
        return "MOV", _AV
    if tag == b"\x1a\x45\xdf\xa3":
        return ("WEBM" if b"webm" in h else "MATROSKA"), _AV
    if h[:16] == b"\x30\x26\xb2\x75\x8e\x66\xcf\x11\xa6\xd9\x00\xaa\x00\x62\xce\x6c":
        return "ASF", _AV
    if h[:5] == b"#!AMR":
        return "AMR", _AV
    if h[:3] == b"FLV":
        return "FLV", _AV
    if tag == b"RIFF" and form == b"AVI ":
        return "AVI", _AV
    if tag == b"wvpk":
        return "WAVPACK", _AV
    if tag == b"MAC ":
        return "APE", _AV
    if h[:2] == b"\x0b\x77":
        return "AC3", _AV
    if tag == b"\x00\x00\x01\xba":
        return "MPEG-PS", _AV
    if len(data) > 188 and data[0] == 0x47 and data[188] == 0x47:
        return "MPEG-TS", _AV
    return _not_audio(data), None


def _not_audio(data: bytes) -> str:
    """A name for bytes that are not audio, for the error message."""
    h = data[:16]
    if h.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG image"
    if h.startswith(b"\xff\xd8\xff"):
        return "JPEG image"
    if h[:4] in (b"GIF8",):
        return "GIF image"
    if h[:4] == b"RIFF" and h[8:12] == b"WEBP":
        return "WebP image"
    if h[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF image"
    if h[:2] == b"BM":
        return "BMP image"
    if h[:4] == b"%PDF":
        return "PDF document"
    if h[:4] == b"PK\x03\x04":
        return "ZIP archive"
    if h[:4] == b"MThd":
        return "MIDI score"
    head = data[:512].lstrip()
    if head[:1] == b"<":
        return (
            "SVG/XML/HTML document"
            if b"<svg" in data[:4096].lower() or head[:5] == b"<?xml"
            else "HTML/XML text"
        )
    try:
        text = data[:512].decode("utf-8")
    except UnicodeDecodeError as e:
        text = data[: e.start].decode("utf-8") if e.start >= 256 else None
    if text is not None and all(c.isprintable() or c in "\t\r\n\f" for c in text):
        return "text"
    return f"unrecognised data (first bytes {data[:8].hex()})"


# --------------------------------------------------------------------------- limits


def _check_stream(rate: int, channels: int, limits: MediaLimits, label: str) -> None:
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


def _check_declared_seconds(seconds: float, limits: MediaLimits, label: str) -> None:
    if seconds > limits.max_audio_seconds:
        raise MediaTooLongError(
            f"{label} header declares {seconds:.1f} s of audio, over the limit of "
            f"{limits.max_audio_seconds:g} s (nothing was decoded)",
            limit=limits.max_audio_seconds,
            actual=round(seconds, 3),
            kind=KIND,
        )


def _too_long_while_decoding(label: str, rate: int, limits: MediaLimits) -> MediaTooLongError:
    return MediaTooLongError(
        f"{label} audio decodes to more than the limit of {limits.max_audio_seconds:g} s "
        f"at {rate} Hz (decoding stopped there)",
        limit=limits.max_audio_seconds,
        actual=f">{limits.max_audio_seconds:g}",
        kind=KIND,
    )


def _max_frames(limits: MediaLimits, rate: int) -> int:
    return int(math.floor(limits.max_audio_seconds * rate))


# --------------------------------------------------------------------------- WAV header


def _check_wav_header(data: bytes, limits: MediaLimits) -> None:
    """Compare a RIFF/WAVE ``data`` chunk's declared size with the bytes present.

    Written by hand because neither libsndfile nor FFmpeg reports the declared size:
    both clamp it to the file length, which hides truncation and lying headers.
    Malformed headers that this walk cannot follow are left to libsndfile to judge.
    """
    pos, fmt = 12, None
    n = len(data)
    while pos + 8 <= n:
        chunk_id = data[pos : pos + 4]
        size = int.from_bytes(data[pos + 4 : pos + 8], "little")
        body = pos + 8
        if chunk_id == b"fmt " and size >= 16 and body + 16 <= n:
            fmt = struct.unpack_from("<HHIIH", data, body)
        elif chunk_id == b"data":
            if fmt is None:
                return
            tag, channels, rate, byte_rate, block_align = fmt
            if size == _WAV_STREAMING_SIZE:
                return
            if size == 0:
                raise EmptyMediaError("WAV data chunk is empty (0 bytes of samples)", actual=0, kind=KIND)
            # Uncompressed PCM/float: bytes per second follow from rate and block size;
            # otherwise trust the header's byte rate.
            per_second = rate * block_align if tag in (1, 3, 0xFFFE) else byte_rate
            if per_second > 0:
                _check_declared_seconds(size / per_second, limits, "WAV")
            present = n - body
            if size - present >= max(block_align, 1):
                raise CorruptMediaError(
                    f"WAV data chunk declares {size} bytes but only {present} are present "
                    "(truncated file or lying header)",
                    limit=size,
                    actual=present,
                    kind=KIND,
                )
            return
        pos = body + size + (size & 1)


# --------------------------------------------------------------------------- decoders


class _SeekSafeBytesIO(io.BytesIO):
    """BytesIO for libsndfile's virtual I/O: a hostile header can make libsndfile seek
    before the start; BytesIO raises there and cffi prints the exception from inside
    its callback. Stay put instead; libsndfile then fails on the data it reads."""

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        try:
            return super().seek(offset, whence)
        except (ValueError, OverflowError):
            return self.tell()


class _NeedsFFmpeg(Exception):
    """libsndfile opened the bytes but cannot decode them safely; try PyAV."""


@dataclass
class _Decoded:
    samples: np.ndarray
    rate: int
    format: str
    subtype: str | None
    container_has_video: bool = False


def _join(chunks: list[np.ndarray], channels: int) -> np.ndarray:
    if not chunks:
        return np.zeros((0, channels), dtype=np.float32)
    if len(chunks) == 1:
        out = chunks[0]
        # sf.read trims a short read with a view; do not keep the larger buffer alive.
        return out.copy() if out.base is not None else out
    return np.concatenate(chunks, axis=0)


def _read_sndfile(f: sf.SoundFile, limits: MediaLimits, n_bytes: int) -> _Decoded:
    rate, channels, declared = int(f.samplerate), int(f.channels), int(f.frames)
    fmt, subtype = f.format, f.subtype
    _check_stream(rate, channels, limits, fmt)
    if not 0 <= declared < _SF_UNKNOWN_FRAMES:
        # Length unknown (e.g. FLAC with total_samples 0): libsndfile's reader then
        # fails on its own seek after the last block; FFmpeg streams it.
        raise _NeedsFFmpeg
    _check_declared_seconds(declared / rate, limits, fmt)
    cap = _max_frames(limits, rate)
    chunks: list[np.ndarray] = []
    total = 0
    # One read of the declared length in the common case, then blocks until EOF in
    # case the header under-declared.
    plausible = 0 < declared * channels <= _TRUSTED_EXPANSION * n_bytes
    want = declared if plausible else _BLOCK_FRAMES
    while True:
        block = f.read(frames=min(want, cap + 1 - total), dtype="float32", always_2d=True)
        if len(block) == 0:
            break
        chunks.append(block)
        total += len(block)
        if total > cap:
            raise _too_long_while_decoding(fmt, rate, limits)
        want = _BLOCK_FRAMES
    if fmt == "FLAC" and 0 < total < declared:
        raise CorruptMediaError(
            f"FLAC declares {declared} frames but only {total} decode (truncated)",
            limit=declared,
            actual=total,
            kind=KIND,
        )
    return _Decoded(_join(chunks, channels), rate, fmt, subtype)


_AV_SCALE = {"u8": 1.0 / 128.0, "s16": 1.0 / 32768.0, "s32": 1.0 / 2**31, "s64": 1.0 / 2**63}


def _frame_to_array(frame: Any, channels: int) -> np.ndarray:
    """One decoded frame as float32 (frames, channels), no resampling."""
    fmt = frame.format
    arr = frame.to_ndarray()
    arr = arr.T if fmt.is_planar else arr.reshape(-1, channels)
    base = fmt.name.rstrip("p")
    if base in ("flt", "dbl"):
        return np.ascontiguousarray(arr, dtype=np.float32)
    if base not in _AV_SCALE:
        raise CorruptMediaError(f"unsupported decoded sample format {fmt.name!r}", kind=KIND)
    out = arr.astype(np.float32) if base != "s64" else arr.astype(np.float64)
    if base == "u8":
        out -= 128.0
    out *= _AV_SCALE[base]
    return np.ascontiguousarray(out, dtype=np.float32)


_CODEC_LABELS = {
    "mp3": "MPEG_LAYER_III",
    "mp3float": "MPEG_LAYER_III",
    "mp2": "MPEG_LAYER_II",
    "mp2float": "MPEG_LAYER_II",
    "libopus": "OPUS",
    "libvorbis": "VORBIS",
}


def _codec_label(name: str | None) -> str:
    """FFmpeg decoder name as a subtype, spelled like soundfile's where they overlap."""
    name = name or "unknown"
    return _CODEC_LABELS.get(name, name.upper())


def _av_label(container: Any, data: bytes) -> str:
    name = container.format.name
    if name.startswith("mov,mp4"):
        label, _ = _sniff(data)
        return label if label in ("M4A", "MP4", "MOV") else "MP4"
    if name.startswith("matroska"):
        return "WEBM" if b"webm" in data[:64] else "MATROSKA"
    return name.split(",")[0].upper()


def _decode_av(data: bytes, limits: MediaLimits, label: str | None) -> _Decoded:
    with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
        label = label or _av_label(container, data)
        if not container.streams.audio:
            kinds = sorted({s.type for s in container.streams}) or ["no streams"]
            raise UnsupportedFormatError(
                f"{label} container has no audio stream ({', '.join(kinds)})", kind=KIND
            )
        stream = container.streams.audio[0]
        has_video = bool(container.streams.video)
        cc = stream.codec_context
        codec = _codec_label(cc.name)
        rate = int(cc.sample_rate or 0)
        channels = int(cc.channels or 0)
        if rate and channels:  # else known only from the first decoded frame
            _check_stream(rate, channels, limits, label)
        declared_frames = None
        if stream.duration and stream.time_base:
            seconds = float(stream.duration * stream.time_base)
            if rate:
                declared_frames = round(seconds * rate)
        elif container.duration:
            seconds = container.duration / av.time_base
        else:
            seconds = 0.0
        _check_declared_seconds(seconds, limits, label)

        chunks: list[np.ndarray] = []
        total = 0
        cap = _max_frames(limits, rate) if rate else 0
        for frame in container.decode(stream):
            f_rate = int(frame.sample_rate)
            f_channels = int(frame.layout.nb_channels)
            if not rate or not channels:
                rate, channels = rate or f_rate, channels or f_channels
                _check_stream(rate, channels, limits, label)
                cap = _max_frames(limits, rate)
            if f_rate != rate or f_channels != channels:
                raise CorruptMediaError(
                    f"{label} audio changes from {rate} Hz x{channels} to {f_rate} Hz x{f_channels} "
                    "mid-stream",
                    kind=KIND,
                )
            if frame.samples == 0:
                continue
            chunks.append(_frame_to_array(frame, channels))
            total += frame.samples
            if total > cap:
                raise _too_long_while_decoding(label, rate, limits)
    samples = _join(chunks, max(channels, 1))
    if declared_frames and declared_frames < len(samples) <= declared_frames + _AV_TRIM_SLACK:
        samples = samples[:declared_frames].copy()
    return _Decoded(samples, rate, label, codec, container_has_video=has_video)


def _describe(exc: BaseException) -> str:
    """The decoder's own words, without the file-object reprs both libraries prepend."""
    if isinstance(exc, sf.LibsndfileError):
        detail = exc.error_string
    elif isinstance(exc, av.error.FFmpegError):
        detail = exc.strerror or str(exc)
    else:
        detail = str(exc)
    detail = detail.strip().rstrip(".") or type(exc).__name__
    if isinstance(exc, EOFError):  # av.error.EOFError included
        detail = f"data ends early ({detail})"
    return detail


def _as_corrupt(label: str, exc: BaseException) -> CorruptMediaError:
    return CorruptMediaError(f"{label} audio could not be decoded: {_describe(exc)}", kind=KIND)


def _try_av(data: bytes, limits: MediaLimits, label: str | None) -> _Decoded:
    try:
        return _decode_av(data, limits, label)
    except PieMediaError:
        raise
    except MemoryError as e:
        raise MediaTooLargeError(
            f"{label or 'audio'} needs more memory than available to decode", kind=KIND
        ) from e
    except _DECODER_ERRORS as e:
        raise _as_corrupt(label or "container", e) from e


def _decode(data: bytes, limits: MediaLimits, *, container: bool) -> _Decoded:
    if container:
        decoded = _try_av(data, limits, None)
    else:
        label, route = _sniff(data)
        if route is None:
            raise UnsupportedFormatError(f"not a supported audio format: {label}", kind=KIND)
        if label == "WAV":
            _check_wav_header(data, limits)
        if route == _AV:
            decoded = _try_av(data, limits, label)
        else:
            decoded = _decode_with_fallback(data, limits, label)
    if len(decoded.samples) == 0:
        raise EmptyMediaError(f"{decoded.format} audio holds no samples", actual=0, kind=KIND)
    if not np.isfinite(decoded.samples).all():
        raise CorruptMediaError(f"{decoded.format} audio contains NaN or infinite samples", kind=KIND)
    return decoded


def _decode_with_fallback(data: bytes, limits: MediaLimits, label: str) -> _Decoded:
    """libsndfile first; PyAV when libsndfile cannot open the bytes or finds no samples."""
    try:
        f = sf.SoundFile(_SeekSafeBytesIO(data))
    except MemoryError as e:
        raise MediaTooLargeError(f"{label} needs more memory than available to decode", kind=KIND) from e
    except _DECODER_ERRORS as e:
        first = e
    else:
        try:
            with f:
                decoded = _read_sndfile(f, limits, len(data))
        except _NeedsFFmpeg:
            return _try_av(data, limits, label)
        except PieMediaError:
            raise
        except MemoryError as e:
            raise MediaTooLargeError(f"{label} needs more memory than available to decode", kind=KIND) from e
        except _DECODER_ERRORS as e:
            raise _as_corrupt(label, e) from e
        if len(decoded.samples) > 0:
            return decoded
        # e.g. an Ogg stream cut mid-page: libsndfile reports 0 frames, FFmpeg says why.
        return _try_av(data, limits, label)
    try:
        return _decode_av(data, limits, label)
    except MediaError as e:
        if isinstance(e, MediaTooLargeError | MediaTooLongError):
            raise
        raise CorruptMediaError(
            f"{label} audio could not be decoded: {_describe(first)} (FFmpeg: {e.message})", kind=KIND
        ) from e
    except MemoryError as e:
        raise MediaTooLargeError(f"{label} needs more memory than available to decode", kind=KIND) from e
    except _DECODER_ERRORS as e:
        raise CorruptMediaError(
            f"{label} audio could not be decoded: {_describe(first)} (FFmpeg: {_describe(e)})", kind=KIND
        ) from e


def _as_bytes(data: object) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, bytearray | memoryview):
        return bytes(data)
    raise InvalidRequestError(f"audio must be given as bytes, not {type(data).__name__}", kind=KIND)


# --------------------------------------------------------------------------- Audio


class Audio:
    """An immutable decoded clip: float32 samples (frames, channels), its rate, its origin.

    Build one with :meth:`from_bytes`, :meth:`from_container_bytes`, :meth:`from_path`
    or :meth:`from_array`. Derived clips (:meth:`to_mono`, :meth:`resampled`) carry a
    content hash derived from the parent's hash and the operation, so caches keyed by
    ``content_hash`` stay correct, and are memoised on the parent.
    """

    __slots__ = ("_samples", "_rate", "_format", "_subtype", "_hash", "_derived")

    def __init__(
        self, samples: np.ndarray, sample_rate: int, *, format: str, subtype: str | None, content_hash: str
    ):
        # Internal: use the from_* constructors, which validate.
        samples.setflags(write=False)
        self._samples = samples
        self._rate = int(sample_rate)
        self._format = format
        self._subtype = subtype
        self._hash = content_hash
        self._derived: dict[tuple[object, ...], Audio] = {}

    # ----------------------------------------------------------------- constructors

    @classmethod
    def from_bytes(cls, data: bytes, limits: MediaLimits | None = None) -> Audio:
        """Decode an audio file (or the first audio stream of a video container).

        Raises only ``MediaError`` subclasses: ``EmptyMediaError`` (no bytes, no
        samples), ``UnsupportedFormatError`` (not audio: text, images, unknown bytes,
        a container without audio), ``CorruptMediaError`` (truncated, malformed),
        ``MediaTooLargeError`` (bytes, channels, sample rate), ``MediaTooLongError``.
        """
        return cls._from_bytes(data, limits, container=False)

    @classmethod
    def from_container_bytes(cls, data: bytes, limits: MediaLimits | None = None) -> Audio:
        """Decode the first audio stream of any container FFmpeg reads (MP4, MKV, WebM,
        AVI, ...), without sniffing. For ``media.Video`` and other callers that already
        know the bytes are a container. ``UnsupportedFormatError`` if it has no audio.
        When the container also holds video, the hash is salted with ``"audio-track"``
        so the clip never shares an identity with the video of the same bytes."""
        return cls._from_bytes(data, limits, container=True)

    @classmethod
    def _from_bytes(cls, data: object, limits: MediaLimits | None, *, container: bool) -> Audio:
        limits = limits or DEFAULT_LIMITS
        try:
            raw = _as_bytes(data)
            limits.check_bytes(len(raw), KIND)
            if not raw:
                raise EmptyMediaError("audio input is empty (0 bytes)", actual=0, kind=KIND)
            decoded = _decode(raw, limits, container=container)
        except PieMediaError:
            raise
        except MemoryError as e:
            raise MediaTooLargeError("audio needs more memory than available to decode", kind=KIND) from e
        except Exception as e:  # last line of defence: no decoder exception escapes untyped
            raise CorruptMediaError(f"audio could not be decoded: {type(e).__name__}: {e}", kind=KIND) from e
        salt = ("audio-track",) if decoded.container_has_video else ()
        return cls(
            decoded.samples,
            decoded.rate,
            format=decoded.format,
            subtype=decoded.subtype,
            content_hash=content_hash(raw, *salt),
        )

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], limits: MediaLimits | None = None) -> Audio:
        """Read and decode a file. The byte limit is checked on the file size before
        reading. ``OSError`` (missing file, permissions) propagates unchanged."""
        limits = limits or DEFAULT_LIMITS
        limits.check_bytes(os.stat(path).st_size, KIND)
        with open(path, "rb") as fh:
            data = fh.read(limits.max_bytes + 1)
        return cls.from_bytes(data, limits)

    @classmethod
    def from_array(cls, samples: np.ndarray, sample_rate: int, limits: MediaLimits | None = None) -> Audio:
        """Wrap PCM samples, shape (frames,) or (frames, channels).

        Float arrays are taken as they are (cast to float32); integer PCM is scaled the
        way decoders do: int16 / 32768, int32 / 2**31, int8 / 128, uint8 (x - 128) / 128.
        The hash covers the float32 samples, the rate and the channel count.
        """
        limits = limits or DEFAULT_LIMITS
        if not isinstance(samples, np.ndarray):
            raise InvalidRequestError(
                f"samples must be a numpy array, not {type(samples).__name__}", kind=KIND
            )
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Integral) or sample_rate <= 0:
            raise InvalidRequestError(f"sample_rate must be a positive int, not {sample_rate!r}", kind=KIND)
        if samples.ndim not in (1, 2):
            raise InvalidRequestError(
                f"samples must have shape (frames,) or (frames, channels), not {samples.shape}", kind=KIND
            )
        arr = _pcm_to_float32(samples)
        if arr.ndim == 1:
            arr = arr[:, None]
        arr = np.array(arr, dtype=np.float32, order="C", copy=True)
        _check_stream(int(sample_rate), arr.shape[1], limits, "array")
        if arr.shape[0] == 0:
            raise EmptyMediaError("audio array holds no samples", actual=0, kind=KIND)
        seconds = arr.shape[0] / int(sample_rate)
        if seconds > limits.max_audio_seconds:
            raise MediaTooLongError(
                f"audio array is {seconds:.1f} s, over the limit of {limits.max_audio_seconds:g} s",
                limit=limits.max_audio_seconds,
                actual=round(seconds, 3),
                kind=KIND,
            )
        if not np.isfinite(arr).all():
            raise InvalidRequestError("audio array contains NaN or infinite samples", kind=KIND)
        h = content_hash(arr.tobytes(), "pcm-f32", int(sample_rate), arr.shape[1])
        return cls(arr, int(sample_rate), format="PCM", subtype="FLOAT", content_hash=h)

    # ----------------------------------------------------------------- properties

    @property
    def samples(self) -> np.ndarray:
        """float32 (frames, channels), read-only, values as decoded (normally in [-1, 1])."""
        return self._samples

    @property
    def sample_rate(self) -> int:
        return self._rate

    @property
    def channels(self) -> int:
        return self._samples.shape[1]

    @property
    def frames(self) -> int:
        return self._samples.shape[0]

    @property
    def duration(self) -> float:
        """Seconds."""
        return self.frames / self._rate

    @property
    def format(self) -> str:
        """Container/format of the source: WAV, FLAC, OGG, MP3, AIFF, M4A, MP4, WEBM, ... or PCM."""
        return self._format

    @property
    def subtype(self) -> str | None:
        """Encoding within the format: PCM_16, FLOAT, VORBIS, OPUS, MPEG_LAYER_III, AAC, ..."""
        return self._subtype

    @property
    def content_hash(self) -> str:
        return self._hash

    def __repr__(self) -> str:
        sub = f"/{self._subtype}" if self._subtype else ""
        return (
            f"Audio({self._format}{sub}, {self._rate} Hz, {self.channels} ch, "
            f"{self.duration:.3f} s, hash={self._hash[:12]})"
        )

    # ----------------------------------------------------------------- transforms

    def _memo(self, key: tuple[object, ...], make: Any) -> Audio:
        out = self._derived.get(key)
        if out is None:
            out = make()
            self._derived[key] = out
        return out

    def _child(self, samples: np.ndarray, rate: int, *op: object) -> Audio:
        return Audio(
            samples,
            rate,
            format=self._format,
            subtype=self._subtype,
            content_hash=content_hash(self._hash.encode(), *op),
        )

    def to_mono(self) -> Audio:
        """Mean of the channels (as ``librosa.to_mono``); ``self`` when already mono."""
        if self.channels == 1:
            return self
        return self._memo(
            ("mono",),
            lambda: self._child(
                np.ascontiguousarray(self._samples.mean(axis=1, keepdims=True)), self._rate, "mono"
            ),
        )

    def resampled(self, rate: int) -> Audio:
        """Resampled with soxr at quality :data:`RESAMPLE_QUALITY`, channels kept.

        Bit-identical to ``librosa.resample(y, orig_sr=..., target_sr=rate,
        res_type="soxr_hq")`` per channel, including its output length, computed as
        librosa does: ``ceil(frames * (rate / sample_rate))`` in floating point (one
        frame more than the exact ceiling for some rate pairs, e.g. 88200 frames at
        44.1 kHz -> 24 kHz gives 48001). ``self`` when the rate already matches.
        """
        if isinstance(rate, bool) or not isinstance(rate, numbers.Integral):
            raise InvalidRequestError(f"sample rate must be an int, not {rate!r}", kind=KIND)
        rate = int(rate)
        if not 0 < rate <= DEFAULT_LIMITS.max_sample_rate:
            raise InvalidRequestError(
                f"target sample rate {rate} Hz is outside 1..{DEFAULT_LIMITS.max_sample_rate} Hz",
                limit=DEFAULT_LIMITS.max_sample_rate,
                actual=rate,
                kind=KIND,
            )
        if rate == self._rate:
            return self
        return self._memo(("resample", rate), lambda: self._resample(rate))

    def _resample(self, rate: int) -> Audio:
        out = soxr.resample(self._samples, self._rate, rate, quality=RESAMPLE_QUALITY)
        # librosa's fix_length: exactly ceil(n * ratio) frames, zero-padded or trimmed.
        n = int(np.ceil(self.frames * (float(rate) / self._rate)))
        if out.shape[0] > n:
            out = out[:n]
        elif out.shape[0] < n:
            out = np.pad(out, ((0, n - out.shape[0]), (0, 0)))
        out = np.ascontiguousarray(out, dtype=np.float32)
        return self._child(out, rate, "resample", rate, "soxr", RESAMPLE_QUALITY)

    def mono_at(self, rate: int) -> np.ndarray:
        """1-D float32 mono samples at ``rate`` (mixed down first, then resampled, as
        ``librosa.load(sr=rate, mono=True)`` does). Read-only: copy before writing."""
        return self.to_mono().resampled(rate).samples[:, 0]

    def to_wav_bytes(self, subtype: str = "PCM_16") -> bytes:
        """Encode as WAV: ``PCM_16``, ``PCM_24``, ``PCM_32`` (clipped to [-1, 1]) or ``FLOAT``."""
        if subtype not in ("PCM_16", "PCM_24", "PCM_32", "FLOAT"):
            raise InvalidRequestError(f"unsupported WAV subtype {subtype!r}", kind=KIND)
        data = self._samples if subtype == "FLOAT" else np.clip(self._samples, -1.0, 1.0)
        buf = io.BytesIO()
        sf.write(buf, data, self._rate, format="WAV", subtype=subtype)
        return buf.getvalue()


def _pcm_to_float32(samples: np.ndarray) -> np.ndarray:
    kind = samples.dtype.kind
    if kind == "f":
        return samples.astype(np.float32, copy=False)
    if kind == "i" and samples.dtype.itemsize in (1, 2, 4):
        scale = 2.0 ** (8 * samples.dtype.itemsize - 1)
        return (samples.astype(np.float64) / scale).astype(np.float32)
    if samples.dtype == np.uint8:
        return ((samples.astype(np.float32) - 128.0) / 128.0).astype(np.float32)
    raise InvalidRequestError(f"unsupported sample dtype {samples.dtype}", kind=KIND)
