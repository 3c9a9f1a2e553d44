"""What format are these bytes? One magic-byte table for every media kind.

``Image``, ``Audio``, ``Video`` and ``detect.open_media`` all ask :func:`sniff` and decide
from the answer's ``kind`` and ``holds``. Sniffing only routes and names things (which
decoder to try first, what to call refused bytes in an error message); the decoders
(Pillow, libsndfile, FFmpeg) still do the real parsing of everything they read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["image", "audio", "video", "container", "document"]

__all__ = ["FORMATS", "Format", "Kind", "sniff"]


@dataclass(frozen=True)
class Format:
    """A format that :func:`sniff` recognises."""

    name: str
    """Short lowercase id (``"png"``, ``"wav"``, ``"mp4"``, ``"mpegts"``, ...)."""
    label: str
    """How messages (and ``Audio.format`` for FFmpeg-decoded audio) spell it: ``"MP3"``,
    ``"MPEG-TS"``, ``"WEBM"``, ..."""
    kind: Kind
    """What a file of this format normally is. Ogg and M4A are ``"audio"`` though they
    can carry video; ``"container"`` is a RIFF file of a form the table does not know."""
    holds: frozenset[str]
    """The media it can carry: ``{"image"}`` for still formats, ``{"image", "video"}``
    for formats that may be animated, ``{"audio", "video"}`` for containers,
    ``frozenset()`` for documents and unknown RIFF forms."""
    description: str
    """A phrase for error messages: ``"PNG image"``, ``"PDF document"``, ..."""


_IMAGE = frozenset({"image"})
_ANIMATION = frozenset({"image", "video"})
_AUDIO = frozenset({"audio"})
_AV = frozenset({"audio", "video"})
_NOTHING: frozenset[str] = frozenset()


def _f(name: str, label: str, kind: Kind, holds: frozenset[str], description: str = "") -> Format:
    return Format(name, label, kind, holds, description or f"{label} {kind}")


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        _f("png", "PNG", "image", _IMAGE),
        _f("apng", "APNG", "image", _ANIMATION),
        _f("jpeg", "JPEG", "image", _IMAGE),
        _f("gif", "GIF", "image", _ANIMATION),
        _f("webp", "WEBP", "image", _ANIMATION, "WebP image"),
        _f("tiff", "TIFF", "image", _IMAGE),
        _f("bmp", "BMP", "image", _IMAGE),
        _f("heif", "HEIF", "image", _IMAGE),
        _f("wav", "WAV", "audio", _AUDIO),
        _f("rf64", "RF64", "audio", _AUDIO),
        _f("w64", "W64", "audio", _AUDIO),
        _f("flac", "FLAC", "audio", _AUDIO),
        _f("ogg", "OGG", "audio", _AV),
        _f("aiff", "AIFF", "audio", _AUDIO),
        _f("au", "AU", "audio", _AUDIO),
        _f("caf", "CAF", "audio", _AUDIO),
        _f("mp3", "MP3", "audio", _AUDIO),
        _f("aac", "AAC", "audio", _AUDIO),
        _f("amr", "AMR", "audio", _AUDIO),
        _f("wavpack", "WAVPACK", "audio", _AUDIO),
        _f("ape", "APE", "audio", _AUDIO),
        _f("ac3", "AC3", "audio", _AUDIO),
        _f("m4a", "M4A", "audio", _AV),
        _f("mp4", "MP4", "video", _AV),
        _f("mov", "MOV", "video", _AV),
        _f("matroska", "MATROSKA", "video", _AV, "Matroska video"),
        _f("webm", "WEBM", "video", _AV, "WebM video"),
        _f("avi", "AVI", "video", _AV),
        _f("asf", "ASF", "video", _AV),
        _f("flv", "FLV", "video", _AV),
        _f("ivf", "IVF", "video", frozenset({"video"})),
        _f("mpeg", "MPEG-PS", "video", _AV),
        _f("mpegts", "MPEG-TS", "video", _AV),
        _f("riff", "RIFF", "container", _NOTHING, "RIFF data"),
        _f("pdf", "PDF", "document", _NOTHING),
        _f("zip", "ZIP", "document", _NOTHING, "ZIP archive"),
        _f("midi", "MIDI", "document", _NOTHING, "MIDI score"),
        _f("svg", "SVG", "document", _NOTHING, "SVG/XML/HTML document"),
        _f("markup", "HTML/XML", "document", _NOTHING, "HTML/XML text"),
        _f("text", "TEXT", "document", _NOTHING, "text"),
    )
}
"""Every format :func:`sniff` can name, by ``name``."""

_ISOBMFF_BOXES = (b"moov", b"mdat", b"free", b"wide", b"skip")
_ASF_GUID = b"\x30\x26\xb2\x75\x8e\x66\xcf\x11\xa6\xd9\x00\xaa\x00\x62\xce\x6c"
_W64_GUID = b"riff\x2e\x91\xcf\x11\xa5\xd6\x28\xdb\x04\xc1\x00\x00"

_MAGIC: tuple[tuple[str, tuple[tuple[int, bytes], ...]], ...] = (
    # (format name, ((offset, bytes), ...)): every pair must match; first row wins.
    ("png", ((0, b"\x89PNG\r\n\x1a\n"),)),
    ("jpeg", ((0, b"\xff\xd8\xff"),)),
    ("gif", ((0, b"GIF87a"),)),
    ("gif", ((0, b"GIF89a"),)),
    ("webp", ((0, b"RIFF"), (8, b"WEBP"))),
    ("avi", ((0, b"RIFF"), (8, b"AVI "))),
    ("wav", ((0, b"RIFF"), (8, b"WAVE"))),
    ("rf64", ((0, b"RF64"), (8, b"WAVE"))),
    ("rf64", ((0, b"BW64"), (8, b"WAVE"))),
    ("riff", ((0, b"RIFF"),)),
    ("w64", ((0, _W64_GUID),)),
    *(("heif", ((4, b"ftyp"), (8, brand))) for brand in (b"avif", b"heic", b"heix", b"mif1", b"msf1")),
    *(("m4a", ((4, b"ftyp"), (8, brand))) for brand in (b"M4A ", b"M4B ", b"M4P ")),
    ("mov", ((4, b"ftyp"), (8, b"qt  "))),
    ("mp4", ((4, b"ftyp"),)),
    *(("mov", ((4, box),)) for box in _ISOBMFF_BOXES),
    ("matroska", ((0, b"\x1a\x45\xdf\xa3"),)),  # or webm: see _refine
    ("ogg", ((0, b"OggS"),)),
    ("flv", ((0, b"FLV"),)),
    ("asf", ((0, _ASF_GUID),)),
    ("ivf", ((0, b"DKIF"),)),
    ("mpeg", ((0, b"\x00\x00\x01\xba"),)),
    ("flac", ((0, b"fLaC"),)),
    ("aiff", ((0, b"FORM"), (8, b"AIFF"))),
    ("aiff", ((0, b"FORM"), (8, b"AIFC"))),
    ("au", ((0, b".snd"),)),
    ("caf", ((0, b"caff"),)),
    ("amr", ((0, b"#!AMR"),)),
    ("wavpack", ((0, b"wvpk"),)),
    ("ape", ((0, b"MAC "),)),
    ("mp3", ((0, b"ID3"),)),
    ("ac3", ((0, b"\x0b\x77"),)),
    ("tiff", ((0, b"II*\x00"),)),
    ("tiff", ((0, b"MM\x00*"),)),
    ("pdf", ((0, b"%PDF"),)),
    ("zip", ((0, b"PK\x03\x04"),)),
    ("midi", ((0, b"MThd"),)),
)
"""Fixed magic bytes. Checks that a prefix cannot express (APNG, WebM, MPEG audio
frame sync, MPEG-TS sync bytes, BMP, markup, text) are in :func:`sniff`."""


def sniff(data: bytes) -> Format | None:
    """The format of ``data`` from its first bytes, or None when nothing matches."""
    for name, checks in _MAGIC:
        if all(data[off : off + len(magic)] == magic for off, magic in checks):
            return FORMATS[_refine(name, data)]
    head = data[:64]
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        # 11-bit MPEG audio frame sync; layer bits 00 are "reserved" there and mark ADTS AAC.
        return FORMATS["aac" if (head[1] >> 1) & 0x3 == 0 else "mp3"]
    if _mpegts(data):
        return FORMATS["mpegts"]
    if head.startswith(b"BM") and len(data) > 26:
        return FORMATS["bmp"]
    start = data[:512].lstrip()
    if start.startswith(b"<?xml") or b"<svg" in data[:4096].lower():
        return FORMATS["svg"]
    if start.startswith(b"<"):
        return FORMATS["markup"]
    if _is_text(data[:512]):
        return FORMATS["text"]
    return None


def _refine(name: str, data: bytes) -> str:
    if name == "png":
        # An APNG has an acTL chunk before the first IDAT.
        idat = data.find(b"IDAT", 8, 1 << 20)
        actl = data.find(b"acTL", 8, idat if idat > 0 else 1 << 20)
        return "apng" if actl > 0 else "png"
    if name == "matroska" and b"webm" in data[:64]:
        return "webm"
    return name


def _mpegts(data: bytes) -> bool:
    """A 0x47 sync byte at the start of the first packets (188 bytes each)."""
    if len(data) <= 188 or data[0] != 0x47 or data[188] != 0x47:
        return False
    return len(data) <= 376 or data[376] == 0x47


def _is_text(sample: bytes) -> bool:
    """Printable UTF-8 in the first 512 bytes; bytes that stop being UTF-8 after 256
    printable ones (a character cut by the 512-byte window, a stray byte) still count."""
    if not sample:
        return False
    try:
        text = sample.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < 256:
            return False
        text = sample[: e.start].decode("utf-8")
    return all(c.isprintable() or c in "\t\r\n\f" for c in text)
