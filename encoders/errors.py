"""Typed errors for model/media mismatches (the media itself was fine)."""

from __future__ import annotations

from media.errors import InvalidRequestError, PieMediaError


class EncoderError(PieMediaError):
    """Base class of what the encoders room raises on purpose."""

    code = "encoder_error"


class UnsupportedModelError(EncoderError, ValueError):
    """The checkpoint's architecture has no media encoder here (e.g. text-only Qwen3)."""

    code = "unsupported_model"


class UnsupportedMediaKindError(EncoderError, InvalidRequestError):
    """The model cannot take this kind of media (e.g. audio on Qwen3-VL)."""

    code = "unsupported_media"
