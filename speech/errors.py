"""Typed speech errors, each with a stable ``code``. All are ``SpeechError``s (a
``PieMediaError``); the ones about the caller's request are ``InvalidRequestError``s too."""

from __future__ import annotations

from media.errors import InvalidRequestError, PieMediaError


class SpeechError(PieMediaError):
    """Base class of everything the speech room raises on purpose."""

    code: str = "speech_error"


class NoSpeechHeadError(SpeechError, InvalidRequestError):
    """The checkpoint cannot produce speech (it is not a CSM checkpoint)."""

    code = "no_speech_head"


class EmptyTextError(SpeechError, InvalidRequestError):
    """There is no text to speak."""

    code = "empty_text"


class TextTooLongError(SpeechError, InvalidRequestError):
    """The text to speak is over the token limit (``details['limit']``)."""

    code = "text_too_long"


class UnsupportedVoiceError(SpeechError, InvalidRequestError):
    """The voice selector (speaker) is not an allowed speaker id or a known preset."""

    code = "unsupported_voice"


class UnsupportedAudioFormatError(SpeechError, InvalidRequestError):
    """An output audio format the speech room cannot encode."""

    code = "unsupported_audio_format"


class InvalidDurationError(SpeechError, InvalidRequestError):
    """``max_duration`` is not a positive number of seconds."""

    code = "invalid_max_duration"


class SpeechBusyError(SpeechError):
    """The speech model is running all it can (streams or KV pages); retry after
    ``details['retry_after']`` seconds (HTTP 429)."""

    code = "queue_full"
