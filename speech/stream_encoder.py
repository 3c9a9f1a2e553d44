"""Encode a clip chunk by chunk, as it is generated, for streaming responses.

``StreamEncoder(fmt, rate)``: ``push(pcm)`` returns the encoded bytes that chunk completes
(possibly empty while a codec frame fills), ``close()`` the rest. Every piece can be sent
as it comes and the pieces joined form one valid file:

- ``wav``: a RIFF header with unknown sizes (0xFFFFFFFF, as streaming WAV writers do),
  then 16-bit samples;
- ``pcm``: raw 16-bit little-endian samples (OpenAI's ``pcm``: 24 kHz mono, no header);
- ``mp3``, ``aac`` (ADTS), ``opus`` (Ogg), ``flac``: PyAV's encoders writing to a
  non-seekable sink that is drained after each chunk, so only whole frames/pages leave.
"""

from __future__ import annotations

import io
import struct

import numpy as np

from speech.errors import UnsupportedAudioFormatError

STREAM_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
UNKNOWN_SIZE = 0xFFFFFFFF
# format -> (container, PyAV codec, bit rate) for the formats PyAV encodes.
STREAM_CODECS = {
    "mp3": ("mp3", "libmp3lame", 64_000),
    "opus": ("ogg", "libopus", 32_000),
    "aac": ("adts", "aac", 64_000),
    "flac": ("flac", "flac", 0),
}


def s16(pcm: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] -> little-endian int16 (clipped, rounded)."""
    return np.round(np.clip(pcm, -1.0, 1.0) * 32767.0).astype("<i2")


def wav_stream_header(rate: int) -> bytes:
    """RIFF/WAVE header for mono 16-bit PCM of unknown length."""
    byte_rate = rate * 2
    return (
        b"RIFF"
        + struct.pack("<I", UNKNOWN_SIZE)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, byte_rate, 2, 16)
        + b"data"
        + struct.pack("<I", UNKNOWN_SIZE)
    )


class _Sink:
    """A write-only file object (no ``seek``: muxers then never rewrite headers)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def drain(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


class StreamEncoder:
    """``seekable=True`` encodes into memory and hands everything out at ``close()``: the
    muxer can then go back and complete its headers (MP3's Xing/LAME frame with the
    encoder delay and padding, FLAC's sample count), which a stream cannot."""

    def __init__(self, fmt: str, rate: int, *, seekable: bool = False):
        if fmt not in STREAM_FORMATS:
            raise UnsupportedAudioFormatError(
                f"unsupported response_format {fmt!r}; use one of {', '.join(STREAM_FORMATS)}",
                supported=list(STREAM_FORMATS),
            )
        self.fmt = fmt
        self.rate = rate
        self._header_sent = False
        self._closed = False
        self._pts = 0
        self._pending = np.zeros(0, dtype="<i2")
        if fmt in STREAM_CODECS:
            import av

            container, codec, bitrate = STREAM_CODECS[fmt]
            self._sink = io.BytesIO() if seekable else _Sink()
            self._out = av.open(self._sink, mode="w", format=container)
            self._stream = self._out.add_stream(codec, rate=rate)
            if bitrate:
                self._stream.bit_rate = bitrate
            self._stream.layout = "mono"
            cc = self._stream.codec_context
            names = [f.name for f in cc.codec.audio_formats]
            self._sample_fmt = "s16" if "s16" in names else ("s16p" if "s16p" in names else "fltp")
            self._frame_size = cc.frame_size or 1152

    def __repr__(self) -> str:
        return f"StreamEncoder({self.fmt!r}, {self.rate} Hz, closed={self._closed})"

    def push(self, pcm: np.ndarray) -> bytes:
        """Encode one chunk of mono float32 PCM; the bytes ready to send."""
        samples = s16(np.asarray(pcm, dtype=np.float32).reshape(-1))
        if self.fmt == "pcm":
            return samples.tobytes()
        if self.fmt == "wav":
            head = b"" if self._header_sent else wav_stream_header(self.rate)
            self._header_sent = True
            return head + samples.tobytes()
        self._pending = np.concatenate([self._pending, samples])
        n = len(self._pending) // self._frame_size * self._frame_size
        self._encode(self._pending[:n])
        self._pending = self._pending[n:]
        return self._drain()

    def close(self) -> bytes:
        """The encoder's tail (padding frame, trailer); idempotent."""
        if self._closed:
            return b""
        self._closed = True
        if self.fmt == "wav":
            return b"" if self._header_sent else wav_stream_header(self.rate)
        if self.fmt == "pcm":
            return b""
        self._encode(self._pending)
        for packet in self._stream.encode(None):
            self._out.mux(packet)
        self._out.close()
        if isinstance(self._sink, io.BytesIO):
            return self._sink.getvalue()
        return self._sink.drain()

    def _drain(self) -> bytes:
        return b"" if isinstance(self._sink, io.BytesIO) else self._sink.drain()

    def _encode(self, samples: np.ndarray) -> None:
        import av

        for start in range(0, len(samples), self._frame_size):
            chunk = samples[start : start + self._frame_size]
            if self._sample_fmt == "fltp":
                frame = av.AudioFrame.from_ndarray(
                    (chunk.astype(np.float32) / 32768.0)[None, :], format="fltp", layout="mono"
                )
            else:
                frame = av.AudioFrame.from_ndarray(chunk[None, :], format=self._sample_fmt, layout="mono")
            frame.sample_rate = self.rate
            frame.pts = self._pts
            self._pts += len(chunk)
            for packet in self._stream.encode(frame):
                self._out.mux(packet)


def encode_whole(pcm: np.ndarray, rate: int, fmt: str) -> bytes:
    """A whole clip, with the headers only a seekable file can have."""
    enc = StreamEncoder(fmt, rate, seekable=True)
    return enc.push(pcm) + enc.close()
