"""Bodies of ``/v1/audio/transcriptions`` and ``/v1/audio/translations`` (OpenAI's shapes):
the form the request carries, and the JSON answers."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from engine import InvalidRequestError

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
STREAMABLE = ("json", "text")
MAX_PROMPT_CHARS = 4096
DEFAULT_MAX_TOKENS = 448
"""Tokens per piece of audio (at most 30 s of speech) unless the request says otherwise:
Whisper's own bound on a 30 s window's text."""
_LANGUAGE = re.compile(r"^[a-z]{2,3}$")


@dataclass(frozen=True)
class TranscriptionForm:
    """The form fields of a transcription request, checked."""

    model: str | None
    language: str | None
    prompt: str | None
    response_format: str
    temperature: float
    stream: bool
    seed: int | None
    max_tokens: int | None

    @classmethod
    def of(cls, fields: dict[str, str]) -> TranscriptionForm:
        fmt = fields.get("response_format") or "json"
        if fmt not in FORMATS:
            raise InvalidRequestError(
                f"response_format must be one of {', '.join(FORMATS)}", param="response_format"
            )
        language = fields.get("language") or None
        if language is not None and not _LANGUAGE.match(language):
            raise InvalidRequestError(
                f"language must be an ISO-639-1 code such as 'en', got {language[:16]!r}", param="language"
            )
        prompt = fields.get("prompt") or None
        if prompt is not None and len(prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(
                f"prompt is {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}",
                param="prompt",
                limit=MAX_PROMPT_CHARS,
            )
        stream = _bool(fields, "stream")
        if stream and fmt not in STREAMABLE:
            raise InvalidRequestError(
                f"stream takes response_format {' or '.join(STREAMABLE)}, not {fmt}", param="stream"
            )
        return cls(
            model=fields.get("model") or None,
            language=language,
            prompt=prompt,
            response_format=fmt,
            temperature=_number(fields, "temperature", 0.0, 0.0, 2.0),
            stream=stream,
            seed=_int(fields, "seed"),
            max_tokens=_int(fields, "max_tokens"),
        )


def _bool(fields: dict[str, str], name: str) -> bool:
    raw = (fields.get(name) or "false").strip().lower()
    if raw not in ("true", "false", "1", "0"):
        raise InvalidRequestError(f"{name} must be true or false, got {raw[:16]!r}", param=name)
    return raw in ("true", "1")


def _number(fields: dict[str, str], name: str, default: float, low: float, high: float) -> float:
    raw = fields.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InvalidRequestError(f"{name} must be a number, got {raw[:16]!r}", param=name) from None
    if not low <= value <= high:
        raise InvalidRequestError(f"{name} must be in [{low:g}, {high:g}], got {value:g}", param=name)
    return value


def _int(fields: dict[str, str], name: str) -> int | None:
    raw = fields.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidRequestError(f"{name} must be an integer, got {raw[:16]!r}", param=name) from None


class TranscriptionUsage(BaseModel):
    type: Literal["tokens"] = "tokens"
    input_tokens: int
    output_tokens: int
    total_tokens: int


class TranscriptionJson(BaseModel):
    text: str
    usage: TranscriptionUsage


class TranscriptionSegment(BaseModel):
    id: int
    seek: int
    """Where the piece starts, in 10 ms frames (as Whisper counts)."""
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float | None


class TranscriptionVerbose(BaseModel):
    task: Literal["transcribe", "translate"]
    language: str
    duration: float
    text: str
    segments: list[TranscriptionSegment]
    usage: TranscriptionUsage
