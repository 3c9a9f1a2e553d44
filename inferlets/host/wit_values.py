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


def error(code: str, message: str) -> wc.Record:
    return record(code=code, message=message[:4000])


def ok(value: Any, tagged: bool) -> Any:
    return wc.Variant("ok", value) if tagged else value


def err(rec: wc.Record, tagged: bool) -> Any:
    return wc.Variant("err", rec) if tagged else rec


def part(p: Any) -> tuple[str, Any]:
    """A lifted ``part``: ("text", str) or ("media", handle)."""
    if isinstance(p, wc.Variant):
        return p.tag, p.payload
    return ("text", p) if isinstance(p, str) else ("media", int(p))
