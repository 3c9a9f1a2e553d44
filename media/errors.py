"""Typed media errors.

Every failure to turn user bytes into a media object ends in a ``MediaError``
subclass with a stable ``code`` (for APIs and logs), a message that says what was
wrong, and, where a limit was crossed, the ``limit`` and the ``actual`` value.
"""

from __future__ import annotations

from typing import Any


class MediaError(ValueError):
    """Base class: the bytes could not become a usable media object."""

    code: str = "media_error"

    def __init__(self, message: str, *, limit: Any = None, actual: Any = None, kind: str | None = None):
        super().__init__(message)
        self.message = message
        self.limit = limit
        self.actual = actual
        self.kind = kind

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description (used by the CLI and the HTTP API)."""
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.kind is not None:
            out["kind"] = self.kind
        if self.limit is not None:
            out["limit"] = self.limit
        if self.actual is not None:
            out["actual"] = self.actual
        return out


class UnsupportedFormatError(MediaError):
    """The bytes are not a format this media kind can read (text, SVG, wrong kind)."""

    code = "unsupported_format"


class CorruptMediaError(MediaError):
    """The format was recognised but the data is truncated or malformed."""

    code = "corrupt"


class MediaTooLargeError(MediaError):
    """Byte size, pixel count, frame size or channel count over a limit."""

    code = "too_large"


class MediaTooLongError(MediaError):
    """Audio or video duration (or frame count) over a limit."""

    code = "too_long"


class EmptyMediaError(MediaError):
    """No bytes, no samples, no frames."""

    code = "empty"


class InvalidRequestError(MediaError):
    """The caller's parameters (not the bytes) are invalid, e.g. a negative fps."""

    code = "invalid_request"
