"""Audio: a decoded, validated, content-hashed clip, independent of any model.

How bytes are decoded (libsndfile or FFmpeg, limits checked from the header and while
decoding, truncated and lying files) is in :mod:`media.audio_decode`. Only
``PieMediaError`` subclasses leave the constructors.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

from media.audio_checks import check_stream
from media.errors import (
    CorruptMediaError,
    EmptyMediaError,
    InvalidRequestError,
    MediaTooLargeError,
    MediaTooLongError,
    PieMediaError,
    UnsupportedFormatError,
)
from media.hashing import content_hash
from media.limits import DEFAULT_LIMITS, MediaLimits
from media.validation import check_int

__all__ = ["Audio", "RESAMPLE_QUALITY"]

KIND = "audio"

RESAMPLE_QUALITY = "HQ"
"""soxr quality used by :meth:`Audio.resampled`: ``"HQ"`` is what
``librosa.resample(res_type="soxr_hq")`` (librosa's default, and so the model
processors') uses; the output is bit-identical to librosa's."""


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
    kind = KIND

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
            try:
                from media.audio_decode import decode_audio  # PyAV and libsndfile load on first use
            except ModuleNotFoundError as missing:
                raise UnsupportedFormatError(
                    f"audio decoding needs PyAV and soundfile ({missing})", kind=KIND
                ) from None
            decoded = decode_audio(raw, limits, container=container)
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
        sample_rate = check_int("sample_rate", sample_rate, min=1, kind=KIND)
        if samples.ndim not in (1, 2):
            raise InvalidRequestError(
                f"samples must have shape (frames,) or (frames, channels), not {samples.shape}", kind=KIND
            )
        arr = _pcm_to_float32(samples)
        if arr.ndim == 1:
            arr = arr[:, None]
        arr = np.array(arr, dtype=np.float32, order="C", copy=True)
        check_stream(sample_rate, arr.shape[1], limits, "array")
        if arr.shape[0] == 0:
            raise EmptyMediaError("audio array holds no samples", actual=0, kind=KIND)
        seconds = arr.shape[0] / sample_rate
        if seconds > limits.max_audio_seconds:
            raise MediaTooLongError(
                f"audio array is {seconds:.1f} s, over the limit of {limits.max_audio_seconds:g} s",
                limit=limits.max_audio_seconds,
                actual=round(seconds, 3),
                kind=KIND,
            )
        if not np.isfinite(arr).all():
            raise InvalidRequestError("audio array contains NaN or infinite samples", kind=KIND)
        h = content_hash(arr.tobytes(), "pcm-f32", sample_rate, arr.shape[1])
        return cls(arr, sample_rate, format="PCM", subtype="FLOAT", content_hash=h)

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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready metadata: ``kind``, format, subtype, rate, channels, duration, hash."""
        return {
            "kind": KIND,
            "format": self._format,
            "subtype": self._subtype,
            "sample_rate": self._rate,
            "channels": self.channels,
            "duration": round(self.duration, 6),
            "content_hash": self._hash,
        }

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
        rate = check_int("target sample rate", rate, min=1, max=DEFAULT_LIMITS.max_sample_rate, kind=KIND)
        if rate == self._rate:
            return self
        return self._memo(("resample", rate), lambda: self._resample(rate))

    def _resample(self, rate: int) -> Audio:
        import soxr

        out = soxr.resample(self._samples, self._rate, rate, quality=RESAMPLE_QUALITY)
        # librosa's fix_length: exactly ceil(n * ratio) frames, zero-padded or trimmed.
        n = int(np.ceil(self.frames * (float(rate) / self._rate)))
        if out.shape[0] > n:
            out = out[:n]
        elif out.shape[0] < n:
            out = np.pad(out, ((0, n - out.shape[0]), (0, 0)))
        out = np.ascontiguousarray(out, dtype=np.float32)
        return self._child(out, rate, "resample", rate, "soxr", RESAMPLE_QUALITY)

    def segment(self, start: int, end: int) -> Audio:
        """Frames ``start`` up to ``end`` (clamped to the clip) as a clip of their own, its
        hash derived from this one's and the range."""
        start = max(0, min(int(start), self.frames))
        end = max(start, min(int(end), self.frames))
        if end == start:
            raise EmptyMediaError(f"audio segment {start}:{end} holds no samples", actual=0, kind=KIND)
        if (start, end) == (0, self.frames):
            return self
        # Rows of a C-ordered array: a view, no copy.
        return self._child(np.ascontiguousarray(self._samples[start:end]), self._rate, "segment", start, end)

    def mono_at(self, rate: int) -> np.ndarray:
        """1-D float32 mono samples at ``rate`` (mixed down first, then resampled, as
        ``librosa.load(sr=rate, mono=True)`` does). Read-only: copy before writing."""
        return self.to_mono().resampled(rate).samples[:, 0]

    def to_wav_bytes(self, subtype: str = "PCM_16") -> bytes:
        """Encode as WAV: ``PCM_16``, ``PCM_24``, ``PCM_32`` (clipped to [-1, 1]) or ``FLOAT``."""
        if subtype not in ("PCM_16", "PCM_24", "PCM_32", "FLOAT"):
            raise InvalidRequestError(f"unsupported WAV subtype {subtype!r}", kind=KIND)
        data = self._samples if subtype == "FLOAT" else np.clip(self._samples, -1.0, 1.0)
        import soundfile as sf

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
