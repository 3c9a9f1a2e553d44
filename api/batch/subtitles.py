"""WebVTT and SRT files from a video's segment captions."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

FORMATS = ("vtt", "srt")


def _stamp(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def _text(caption: str) -> str:
    # a blank line would end the cue, and "-->" would read as a timing line
    return "\n".join(line for line in caption.replace("-->", "->").splitlines() if line.strip()) or "…"


def webvtt(cues: Sequence[tuple[float, float, str]]) -> str:
    out = ["WEBVTT", ""]
    for i, (start, end, text) in enumerate(cues, 1):
        out += [str(i), f"{_stamp(start, '.')} --> {_stamp(end, '.')}", _text(text), ""]
    return "\n".join(out)


def srt(cues: Sequence[tuple[float, float, str]]) -> str:
    out = []
    for i, (start, end, text) in enumerate(cues, 1):
        out += [str(i), f"{_stamp(start, ',')} --> {_stamp(end, ',')}", _text(text), ""]
    return "\n".join(out)


def write_subtitles(folder: Path, key: str, cues: Sequence[tuple[float, float, str]], fmt: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("_") or "sample"
    path = folder / f"{name}.{fmt}"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(webvtt(cues) if fmt == "vtt" else srt(cues), encoding="utf-8")
    tmp.replace(path)
    return path
