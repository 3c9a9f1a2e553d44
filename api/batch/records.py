"""One batch-caption record: a caption or a typed error for one sample (and one prompt,
one video segment), with the settings it was made under.

The CLI's JSONL line, a Parquet row, a WebDataset ``.json`` member and an HTTP caption
job's result are all this dict."""

from __future__ import annotations

from typing import Any


def make_record(
    name: str,
    settings: dict[str, Any],
    *,
    content_hash: str | None = None,
    caption: str | None = None,
    error: dict[str, Any] | None = None,
    elapsed_s: float | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A record: ``{"file", ["key", "shard", ...extra], "content_hash"?, "caption" |
    "error", ...settings, "elapsed_s"?}``."""
    rec: dict[str, Any] = {"file": name}
    if extra:
        rec.update(extra)
    if content_hash:
        rec["content_hash"] = content_hash
    if error is not None:
        rec["error"] = error
    else:
        rec["caption"] = caption
    rec.update(settings)
    if error is None and elapsed_s is not None:
        rec["elapsed_s"] = round(elapsed_s, 4)
    return rec


def error_dict(e: BaseException) -> dict[str, Any]:
    """A typed error as a record's ``error`` (an unexpected one by its class name)."""
    to_dict = getattr(e, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return {"code": getattr(e, "code", None) or type(e).__name__, "message": str(e)}
