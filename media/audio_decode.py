"""How audio bytes become samples: decoding routes, limits, truncation rules.

Decoding routes (chosen by ``media.sniff`` from the first bytes, never by file name):

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

Decoder exceptions become typed errors here; ``media.Audio`` is the last line of
defence for anything that slips through.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass
from typing import Any

import av
import numpy as np
import soundfile as sf

from media.audio_checks import check_stream
from media.decode_errors import DECODE_ERRORS, describe
from media.errors import (
    CorruptMediaError,
    EmptyMediaError,
    MediaError,
    MediaTooLargeError,
    MediaTooLongError,
    PieMediaError,
    UnsupportedFormatError,
)
from media.limits import MediaLimits
from media.sniff import sniff

__all__ = ["DecodedAudio", "check_stream", "decode_audio", "read_sndfile"]

KIND = "audio"

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
_DECODER_ERRORS = (sf.LibsndfileError, sf.SoundFileError, *DECODE_ERRORS, NotImplementedError)

_SNDFILE_FORMATS = frozenset({"wav", "rf64", "w64", "flac", "ogg", "aiff", "au", "caf"})
"""Formats (``media.sniff`` names) libsndfile decodes first; every other audio format
goes to PyAV."""


# --------------------------------------------------------------------------- limits


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
class DecodedAudio:
    """What a decoder produced: float32 (frames, channels) samples and where they came from."""

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


def read_sndfile(f: sf.SoundFile, limits: MediaLimits, n_bytes: int) -> DecodedAudio:
    """Read an open libsndfile file (``n_bytes`` long encoded) under ``limits``, never
    trusting its declared length for more than the memory it plausibly needs."""
    rate, channels, declared = int(f.samplerate), int(f.channels), int(f.frames)
    fmt, subtype = f.format, f.subtype
    check_stream(rate, channels, limits, fmt)
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
    return DecodedAudio(_join(chunks, channels), rate, fmt, subtype)


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
    fmt = sniff(data)
    if name.startswith("mov,mp4"):
        return fmt.label if fmt is not None and fmt.name in ("m4a", "mp4", "mov") else "MP4"
    if name.startswith("matroska"):
        return "WEBM" if fmt is not None and fmt.name == "webm" else "MATROSKA"
    return name.split(",")[0].upper()


def _decode_av(data: bytes, limits: MediaLimits, label: str | None) -> DecodedAudio:
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
            check_stream(rate, channels, limits, label)
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
                check_stream(rate, channels, limits, label)
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
    return DecodedAudio(samples, rate, label, codec, container_has_video=has_video)


def _describe(exc: BaseException) -> str:
    """The decoder's own words (:func:`media.decode_errors.describe`) trimmed to fit in a
    sentence, and saying so when the data ended early."""
    detail = describe(exc).strip().rstrip(".") or type(exc).__name__
    if isinstance(exc, EOFError):  # av.error.EOFError included
        detail = f"data ends early ({detail})"
    return detail


def _as_corrupt(label: str, exc: BaseException) -> CorruptMediaError:
    return CorruptMediaError(f"{label} audio could not be decoded: {_describe(exc)}", kind=KIND)


def _try_av(data: bytes, limits: MediaLimits, label: str | None) -> DecodedAudio:
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


def decode_audio(data: bytes, limits: MediaLimits, *, container: bool) -> DecodedAudio:
    """Decode ``data`` by the route its format calls for (``container``: the first audio
    stream of any container FFmpeg reads, no sniffing); refuses no samples and NaN."""
    if container:
        decoded = _try_av(data, limits, None)
    else:
        fmt = sniff(data)
        if fmt is None or "audio" not in fmt.holds:
            what = fmt.description if fmt else f"unrecognised data (first bytes {data[:8].hex()})"
            raise UnsupportedFormatError(f"not a supported audio format: {what}", kind=KIND)
        if fmt.name == "wav":
            _check_wav_header(data, limits)
        if fmt.name in _SNDFILE_FORMATS:
            decoded = _decode_with_fallback(data, limits, fmt.label)
        else:
            decoded = _try_av(data, limits, fmt.label)
    if len(decoded.samples) == 0:
        raise EmptyMediaError(f"{decoded.format} audio holds no samples", actual=0, kind=KIND)
    if not np.isfinite(decoded.samples).all():
        raise CorruptMediaError(f"{decoded.format} audio contains NaN or infinite samples", kind=KIND)
    return decoded


def _decode_with_fallback(data: bytes, limits: MediaLimits, label: str) -> DecodedAudio:
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
                decoded = read_sndfile(f, limits, len(data))
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
