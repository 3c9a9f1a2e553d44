"""Encode a mono float32 clip as WAV, FLAC, MP3, Opus or raw PCM bytes (soundfile / PyAV).

Formats (``SPEECH_FORMATS``):

- ``wav``: RIFF WAVE, 16-bit signed PCM (soundfile). Lossless up to 16-bit quantisation
  (|error| <= 1/32768 + rounding).
- ``flac``: FLAC, 16-bit (soundfile). Same samples as ``wav``.
- ``mp3``: MPEG-1/2 Layer III through PyAV's libmp3lame at the clip's rate (24 kHz is an MPEG-2 rate),
  mono, 64 kbit/s. Lossy; decoders add encoder delay/padding (up to ~1.2 k samples at each end).
- ``opus``: Opus in an Ogg container through PyAV's libopus at the clip's rate (libopus accepts
  8/12/16/24/48 kHz), mono, 32 kbit/s. Lossy; the Ogg header keeps the 24 kHz input rate, which
  ``media.Audio.from_bytes`` reports (other decoders may hand back 48 kHz).
- ``aac``: AAC-LC in ADTS frames through PyAV's native encoder, mono, 64 kbit/s. Lossy.
- ``pcm``: raw little-endian float32 samples, no header (the clip's rate and 1 channel are out of band).
- ``s16le``: raw little-endian signed 16-bit samples, no header.
"""

from __future__ import annotations

import io

import numpy as np

from speech.errors import UnsupportedAudioFormatError
from speech.stream_encoder import encode_whole, s16

SPEECH_FORMATS = ("wav", "flac", "mp3", "opus", "aac", "pcm", "s16le")
MIME_TYPES = {
    "wav": "audio/wav",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
    "aac": "audio/aac",
    "pcm": "audio/L32f",  # raw float32 little-endian
    "s16le": "audio/L16",
}
_EXTENSIONS = {
    "wav": "wav",
    "wave": "wav",
    "flac": "flac",
    "mp3": "mp3",
    "opus": "opus",
    "ogg": "opus",
    "aac": "aac",
    "pcm": "pcm",
}


def normalize_format(fmt: str) -> str:
    """``fmt`` lower-cased and checked; raises UnsupportedAudioFormatError otherwise."""
    if not isinstance(fmt, str) or fmt.lower().lstrip(".") not in SPEECH_FORMATS:
        raise UnsupportedAudioFormatError(
            f"unsupported audio format {fmt!r}; expected one of {', '.join(SPEECH_FORMATS)}",
            format=str(fmt),
            supported=list(SPEECH_FORMATS),
        )
    return fmt.lower().lstrip(".")


def format_from_extension(path: str) -> str:
    """The format a file name asks for (``.wav``, ``.flac``, ``.mp3``, ``.opus``/``.ogg``, ``.pcm``)."""
    ext = path.rsplit(".", 1)[-1].lower() if "." in path else ""
    if ext not in _EXTENSIONS:
        raise UnsupportedAudioFormatError(
            f"cannot tell the audio format from {path!r}; use one of .wav .flac .mp3 .opus .pcm or pass a format",
            format=ext,
            supported=list(SPEECH_FORMATS),
        )
    return _EXTENSIONS[ext]


def _soundfile(pcm: np.ndarray, rate: int, fmt: str) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, pcm, rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()


def encode_pcm(pcm: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """``pcm`` (1-D float32 in [-1, 1]) encoded as ``fmt`` (see the module docstring)."""
    fmt = normalize_format(fmt)
    pcm = np.ascontiguousarray(pcm, dtype=np.float32)
    if fmt == "pcm":
        return pcm.astype("<f4").tobytes()
    if fmt == "s16le":
        return s16(pcm).tobytes()
    if fmt == "wav":
        return _soundfile(pcm, sample_rate, "WAV")
    if fmt == "flac":
        return _soundfile(pcm, sample_rate, "FLAC")
    return encode_whole(pcm, sample_rate, fmt)
