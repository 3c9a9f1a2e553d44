"""Decoder exceptions turned into typed media errors, for the audio and video decoders.

FFmpeg (PyAV), libsndfile and Pillow raise a zoo of exception types on hostile input;
only ``PieMediaError`` subclasses may leave ``media``. :data:`DECODE_ERRORS` is what the
decoders catch, :func:`describe` keeps the library's own words for the message, and
:func:`as_media_error` is the last line of defence around a whole operation.
"""

from __future__ import annotations

import struct

import av.error
import soundfile as sf

from media.errors import CorruptMediaError, MediaError, MediaTooLargeError, PieMediaError

__all__ = ["DECODE_ERRORS", "as_media_error", "describe"]

DECODE_ERRORS: tuple[type[BaseException], ...] = (
    av.error.FFmpegError,
    OSError,
    ValueError,
    IndexError,
    KeyError,
    EOFError,
    OverflowError,
    ZeroDivisionError,
    struct.error,
    RuntimeError,
    TypeError,
    AttributeError,
)
"""Exceptions FFmpeg, libsndfile and the Python parsers around them raise on malformed
input. ``MediaError`` is a ``ValueError`` too, so every handler lets ``PieMediaError``
through first."""


def describe(exc: BaseException) -> str:
    """The library's own words: FFmpeg's and libsndfile's error strings without the errno
    and file-object noise their exceptions add; the exception's type name when empty."""
    if isinstance(exc, sf.LibsndfileError):
        words = exc.error_string
    elif isinstance(exc, av.error.FFmpegError):
        words = exc.strerror
    else:
        words = str(exc)
    return words or type(exc).__name__


def as_media_error(
    exc: BaseException, what: str, kind: str, default: type[MediaError] = CorruptMediaError
) -> PieMediaError:
    """``exc`` as a typed error: a ``PieMediaError`` unchanged, running out of memory as
    ``MediaTooLargeError``, anything else as ``default`` saying ``what`` failed."""
    if isinstance(exc, PieMediaError):
        return exc
    if isinstance(exc, MemoryError):
        return MediaTooLargeError(f"{what}: ran out of memory while decoding", kind=kind)
    return default(f"{what}: {type(exc).__name__}: {describe(exc)}", kind=kind)
