"""Chunk-by-chunk encoding: pieces join into one valid file equal to the whole-clip encoding."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest

from speech import STREAM_FORMATS, StreamEncoder, UnsupportedAudioFormatError, encode_pcm

RATE = 24000


def _tone(seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    return (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32)


def _pieces(fmt: str, pcm: np.ndarray, chunk: int = 1920) -> list[bytes]:
    enc = StreamEncoder(fmt, RATE)
    return [enc.push(pcm[i : i + chunk]) for i in range(0, len(pcm), chunk)] + [enc.close()]


@pytest.mark.parametrize("fmt", STREAM_FORMATS)
def test_pieces_join_into_the_whole_encoding(fmt: str) -> None:
    """Chunking never changes the encoding (Ogg's random stream serial aside: compare samples)."""
    pcm = _tone()
    joined = b"".join(_pieces(fmt, pcm))
    whole = StreamEncoder(fmt, RATE)
    once = whole.push(pcm) + whole.close()
    if fmt == "opus":
        assert _decoded(joined).tolist() == _decoded(once).tolist()
    else:
        assert joined == once


def _decoded(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as c:
        return np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])


@pytest.mark.parametrize("fmt", ["mp3", "aac", "flac", "opus", "wav"])
def test_streams_decode_at_the_clip_rate(fmt: str) -> None:
    pcm = _tone()
    with av.open(io.BytesIO(b"".join(_pieces(fmt, pcm)))) as c:
        rate = c.streams.audio[0].rate
        n = sum(f.samples for f in c.decode(audio=0))
    assert rate in (RATE, 48000)
    assert abs(n / rate - 1.0) < 0.1  # encoder delay/padding only


def test_wav_header_says_unknown_sizes_and_pcm_is_s16le() -> None:
    pieces = _pieces("wav", _tone(0.1))
    head = pieces[0][:44]
    assert head[:4] == b"RIFF" and struct.unpack("<I", head[4:8])[0] == 0xFFFFFFFF
    assert struct.unpack("<I", head[40:44])[0] == 0xFFFFFFFF
    raw = b"".join(_pieces("pcm", _tone(0.1)))
    assert len(raw) == 2 * int(RATE * 0.1)
    assert np.frombuffer(raw, "<i2").max() == round(0.3 * 32767)


def test_mp3_pieces_are_whole_frames() -> None:
    for piece in _pieces("mp3", _tone())[:-1]:
        if piece and not piece.startswith(b"ID3"):
            assert piece[0] == 0xFF and piece[1] & 0xE0 == 0xE0  # starts on a frame sync


def test_aac_whole_clip_and_unknown_format() -> None:
    data = encode_pcm(_tone(), RATE, "aac")
    assert data[:2] == b"\xff\xf1" or data[0] == 0xFF  # ADTS sync
    with pytest.raises(UnsupportedAudioFormatError):
        StreamEncoder("ogg", RATE)
