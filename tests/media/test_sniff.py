"""media.sniff: the one magic-byte table behind Image, Audio, Video and open_media."""

from __future__ import annotations

from pathlib import Path

import pytest

from media.sniff import FORMATS, Format, sniff

PAD = bytes(range(1, 200)) * 4  # binary filler (not text, no accidental magic)


@pytest.mark.parametrize(
    ("head", "name"),
    [
        (b"\x89PNG\r\n\x1a\n", "png"),
        (b"\xff\xd8\xff\xe0", "jpeg"),
        (b"GIF87a", "gif"),
        (b"GIF89a", "gif"),
        (b"RIFF\0\0\0\0WEBPVP8 ", "webp"),
        (b"RIFF\0\0\0\0AVI LIST", "avi"),
        (b"RIFF\0\0\0\0WAVEfmt ", "wav"),
        (b"RIFF\0\0\0\0XXXX", "riff"),
        (b"RF64\0\0\0\0WAVE", "rf64"),
        (b"BW64\0\0\0\0WAVE", "rf64"),
        (b"riff\x2e\x91\xcf\x11\xa5\xd6\x28\xdb\x04\xc1\x00\x00", "w64"),
        (b"\0\0\0\x1cftypavif", "heif"),
        (b"\0\0\0\x1cftypheic", "heif"),
        (b"\0\0\0\x1cftypM4A ", "m4a"),
        (b"\0\0\0\x1cftypqt  ", "mov"),
        (b"\0\0\0\x1cftypisom", "mp4"),
        (b"\0\0\0\x08moov", "mov"),
        (b"\x1a\x45\xdf\xa3\x01\0\0\0\0\0\0\x1f\x42\x82\x88matroska", "matroska"),
        (b"\x1a\x45\xdf\xa3\x01\0\0\0\0\0\0\x1f\x42\x82\x84webm", "webm"),
        (b"OggS\0\x02", "ogg"),
        (b"FLV\x01\x05", "flv"),
        (b"\x30\x26\xb2\x75\x8e\x66\xcf\x11\xa6\xd9\x00\xaa\x00\x62\xce\x6c", "asf"),
        (b"DKIF\0\0", "ivf"),
        (b"\x00\x00\x01\xba\x44", "mpeg"),
        (b"fLaC\0\0\0\x22", "flac"),
        (b"FORM\0\0\0\0AIFF", "aiff"),
        (b"FORM\0\0\0\0AIFC", "aiff"),
        (b".snd\0\0\0\x18", "au"),
        (b"caff\0\x01", "caf"),
        (b"#!AMR\n", "amr"),
        (b"wvpk\0\0", "wavpack"),
        (b"MAC \x96\x0f", "ape"),
        (b"ID3\x04\0", "mp3"),
        (b"\xff\xfb\x90\x64", "mp3"),
        (b"\xff\xf3\x90\x64", "mp3"),
        (b"\xff\xf1\x50\x80", "aac"),  # ADTS: MPEG audio sync with layer bits 00
        (b"\x0b\x77\x00\x00", "ac3"),
        (b"II*\x00", "tiff"),
        (b"MM\x00*", "tiff"),
        (b"%PDF-1.7", "pdf"),
        (b"PK\x03\x04", "zip"),
        (b"MThd\0\0\0\x06", "midi"),
    ],
)
def test_magic(head: bytes, name: str) -> None:
    fmt = sniff(head + PAD)
    assert fmt is not None and fmt.name == name
    assert fmt is FORMATS[name]


def test_apng_needs_an_actl_chunk_before_idat() -> None:
    still = b"\x89PNG\r\n\x1a\n" + b"\0\0\0\x0dIHDR" + PAD + b"IDAT" + PAD
    animated = b"\x89PNG\r\n\x1a\n" + b"\0\0\0\x0dIHDR" + b"\0\0\0\x08acTL" + PAD + b"IDAT" + PAD
    assert sniff(still).name == "png"  # type: ignore[union-attr]
    assert sniff(animated).name == "apng"  # type: ignore[union-attr]


def test_mpegts_needs_sync_bytes_every_188() -> None:
    data = bytearray(PAD[:600])
    data[0] = data[188] = data[376] = 0x47
    assert sniff(bytes(data)).name == "mpegts"  # type: ignore[union-attr]
    data[376] = 0
    assert sniff(bytes(data)) is None
    assert sniff(bytes(data[:300])).name == "mpegts"  # type: ignore[union-attr]


def test_bmp_needs_a_header() -> None:
    assert sniff(b"BM" + PAD).name == "bmp"  # type: ignore[union-attr]
    assert sniff(b"BM\x01\x02") is None


@pytest.mark.parametrize(
    ("data", "name"),
    [
        (b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"/>', "svg"),
        (b"  <SVG width='1'></SVG>", "svg"),
        (b"<!doctype html><html><body>hi</body></html>", "markup"),
        (b"just some text\nover two lines\n", "text"),
        ("UTF-8 text: caf\u00e9 \u2014 \u65e5\u672c\n".encode(), "text"),
        (b"x" * 300 + "\u00e9".encode()[:1], "text"),  # a character cut by the window
    ],
)
def test_documents(data: bytes, name: str) -> None:
    assert sniff(data).name == name  # type: ignore[union-attr]


@pytest.mark.parametrize("data", [b"", b"\x00\x01\x02\x03", PAD, b"\x00" * 100 + b"text"])
def test_unknown(data: bytes) -> None:
    assert sniff(data) is None


def test_table_is_consistent() -> None:
    for name, fmt in FORMATS.items():
        assert isinstance(fmt, Format) and fmt.name == name
        assert fmt.holds <= {"image", "audio", "video"}
        assert fmt.label and fmt.description
    stills = {n for n, f in FORMATS.items() if f.holds == {"image"}}
    assert stills == {"png", "jpeg", "tiff", "bmp", "heif"}
    assert {n for n, f in FORMATS.items() if f.kind == "audio" and "video" in f.holds} == {"ogg", "m4a"}
    assert FORMATS["png"].description == "PNG image"
    assert FORMATS["mpegts"].label == "MPEG-TS"


def test_every_sample_is_named_as_its_kind(samples: Path) -> None:
    """The generated samples: images sniff as images, audio as audio, video as formats
    that hold video. (Pillow identifies images itself; the table need not know ICO,
    PPM or TGA, which no other decoder could take for theirs.)"""
    for kind in ("images", "audio", "video"):
        for p in sorted((samples / kind).iterdir()):
            if not p.is_file() or p.name.startswith("."):
                continue
            fmt = sniff(p.read_bytes())
            if kind == "images" and p.suffix in (".ico", ".ppm", ".tga"):
                assert fmt is None, p.name
                continue
            assert fmt is not None, p.name
            if kind == "images":
                assert "image" in fmt.holds, (p.name, fmt)
            elif kind == "audio":
                assert "audio" in fmt.holds, (p.name, fmt)
            else:
                assert "video" in fmt.holds, (p.name, fmt)
