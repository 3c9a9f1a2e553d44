"""Bodies of ``POST /v1/completions``: OpenAI's legacy text completion (a raw prompt, no
chat template), with vLLM's extensions as on chat completions."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from api.http.schemas.chat import GenerationRequest, Usage

MAX_PROMPTS = 64
"""Prompts one request may carry (each its own context; choice ``i`` of prompt ``p`` is
index ``p * n + i``, as OpenAI numbers them)."""
DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for this endpoint (vLLM's too)."""
MAX_LOGPROBS = 20

Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(GenerationRequest):
    prompt: Prompt = Field(description="text, token ids, or a list of either (up to 64 prompts)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_shape(cls, v: Any) -> Any:
        """One of the four shapes, said plainly (pydantic's union error names each member)."""
        if isinstance(v, str) or not isinstance(v, list):
            return v
        if all(isinstance(p, int) and not isinstance(p, bool) for p in v):
            return v
        if all(isinstance(p, str) for p in v) or all(isinstance(p, list) for p in v):
            return v
        raise ValueError(
            "prompt is text, a list of token ids, or a list of prompts that are all texts or all "
            "token-id lists (not mixed)"
        )

    max_tokens: int | None = Field(
        default=None,
        ge=0,
        description=f"default {DEFAULT_MAX_TOKENS}; 0 (with echo) scores the prompt alone",
    )
    best_of: int | None = Field(default=None, ge=1, le=16, description="only n (or none) is served")
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="the chosen token's and this many alternatives'"
    )
    echo: bool = Field(
        default=False, description="the prompt, then the completion (with logprobs: the prompt's too)"
    )
    suffix: str | None = Field(default=None, description="not supported (400)")


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: per token its text, log-probability (None for a prompt's
    first token), the top alternatives by text, and where its text starts in the choice's."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class TextCompletion(BaseModel):
    """A whole completion, and each chunk of a streamed one (OpenAI uses one shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
