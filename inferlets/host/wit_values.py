"""Python values <-> wasmtime-py component values for this world's types.

wasmtime-py lowers a ``result`` untagged (by the Python type of the value) when its ok
and err cases have different Python classes, and needs ``Variant(tag, payload)`` when they
share one (a record ok type and the ``error`` record). Records are built with the WIT
field names (dashes included) as attributes."""

from __future__ import annotations

from typing import Any

from wasmtime import component as wc


def record(**fields: Any) -> wc.Record:
    """A record; ``token_count=`` becomes the WIT field ``token-count``."""
    r = wc.Record()
    for k, v in fields.items():
        setattr(r, k.replace("_", "-"), v)
    return r


def field(r: Any, name: str) -> Any:
    """A field of a lifted record by its WIT name (``"top-k"``)."""
    return getattr(r, name)


def error(code: str, message: str, kind: str = "host") -> wc.Record:
    """The WIT ``error`` record; ``kind`` is an ``error-kind`` case name."""
    return record(code=code, message=message[:4000], kind=kind)


def error_kind(e: Exception) -> str:
    """The ``error-kind`` case of a typed error (by class; ``code`` stays exact)."""
    from engine.errors import EngineError
    from inferlets.host import errors as ie
    from media.errors import InvalidRequestError, MediaError
    from speech.errors import SpeechError

    for cls, kind in (
        (ie.InferletCancelledError, "cancelled"),
        (ie.InferletTimeoutError, "timeout"),
        (ie.InferletHandleError, "bad-handle"),
        (ie.InferletLimitError, "limit"),
        (ie.UnknownModelError, "not-found"),
        (MediaError, "media"),
        (SpeechError, "speech"),
    ):
        if isinstance(e, cls):
            return kind
    code = getattr(e, "code", "")
    if code.endswith("not_found"):
        return "not-found"
    if isinstance(e, InvalidRequestError):
        return "invalid-request"
    if isinstance(e, EngineError):
        return "engine"
    return "host"


def ok(value: Any, tagged: bool) -> Any:
    return wc.Variant("ok", value) if tagged else value


def err(rec: wc.Record, tagged: bool) -> Any:
    return wc.Variant("err", rec) if tagged else rec


def part(p: Any) -> tuple[str, Any]:
    """A lifted ``part``: ("text", str) or ("media", handle)."""
    if isinstance(p, wc.Variant):
        return p.tag, p.payload
    return ("text", p) if isinstance(p, str) else ("media", int(p))
