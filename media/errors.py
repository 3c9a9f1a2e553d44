"""The project's one error base, and the typed media errors.

Every error any room (media, encoders, engine, speech) raises on purpose is a
``PieMediaError``: it has a stable ``code`` (for APIs and logs), a ``message`` that says
what was wrong and what to do, and ``details`` (``limit``, ``actual``, ``kind``, ...).
The HTTP layer maps these to statuses in one table. The base lives here because
``media`` is the bottom room that every other room already imports.
"""

from __future__ import annotations

from typing import Any


class PieMediaError(Exception):
    """Base class of every error raised on purpose anywhere in pie-media."""

    code: str = "pie_media_error"

    def __init__(self, message: str, **details: Any):
        super().__init__(message)
        self.message = message
        self.details = {k: v for k, v in details.items() if v is not None}

    def __getattr__(self, name: str) -> Any:
        # ``err.limit`` / ``err.actual`` / ``err.kind`` read the details (None when absent).
        if name in ("limit", "actual", "kind") or (
            not name.startswith("_") and name in self.__dict__.get("details", {})
        ):
            return self.__dict__.get("details", {}).get(name)
        raise AttributeError(name)

    def __str__(self) -> str:  # also for KeyError subclasses, which would repr() the message
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description (used by the CLI and the HTTP API)."""
        return {"code": self.code, "message": self.message, **self.details}


class InvalidRequestError(PieMediaError, ValueError):
    """The caller's parameters (not the bytes) are invalid, e.g. a negative fps or a
    ``max_tokens`` of zero. One class for every room."""

    code = "invalid_request"


class MediaError(PieMediaError, ValueError):
    """The bytes could not become a usable media object."""

    code = "media_error"

    def __init__(self, message: str, *, limit: Any = None, actual: Any = None, kind: str | None = None):
        super().__init__(message, kind=kind, limit=limit, actual=actual)


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
