"""Bodies of the speech endpoints (OpenAI's ``audio.speech`` shape plus extensions)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_INPUT_CHARS = 4096


class ContextTurn(BaseModel):
    """An earlier turn that conditions the voice: its text, its audio, its speaker."""

    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, max_length=MAX_INPUT_CHARS)
    audio: str | None = Field(
        default=None, description="base64 audio bytes, or a data:/pie-media:// URL of an uploaded clip"
    )
    voice: str | int | None = Field(
        default=None, description="speaker of this turn (default: the request's voice)"
    )


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    input: str = Field(min_length=1, max_length=MAX_INPUT_CHARS)
    voice: str | int = "alloy"
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = Field(
        default=None, description="accepted for compatibility; CSM has no instructions"
    )
    # extensions
    context: list[ContextTurn] | None = Field(default=None, max_length=16)
    max_duration: float | None = Field(default=None, gt=0, le=300, description="seconds of audio at most")
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_k: int | None = Field(default=None, ge=1)
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)


class Voice(BaseModel):
    id: str
    object: Literal["voice"] = "voice"
    speaker: int


class VoiceList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Voice]
