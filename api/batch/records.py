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


ROW_FIELDS = (
    ("file", "string"),
    ("key", "string"),
    ("shard", "string"),
    ("content_hash", "string"),
    ("caption", "string"),
    ("error", "string"),
    ("prompt", "string"),
    ("model", "string"),
    ("max_tokens", "int64"),
    ("segment", "int64"),
    ("start", "float64"),
    ("end", "float64"),
    ("elapsed_s", "float64"),
    ("structured", "string"),
    ("settings", "string"),
)
"""A record as a Parquet row: fixed columns, the error, a structured caption and the
job's other settings as JSON text (Arrow would turn differently shaped dicts into
structs of nulls)."""


def to_row(rec: dict[str, Any]) -> dict[str, Any]:
    import json

    known = {name for name, _ in ROW_FIELDS}
    row = {name: rec.get(name) for name, _ in ROW_FIELDS}
    row["error"] = json.dumps(rec["error"], ensure_ascii=False) if "error" in rec else None
    row["structured"] = json.dumps(rec["structured"], ensure_ascii=False) if "structured" in rec else None
    rest = {k: v for k, v in rec.items() if k not in known}
    row["settings"] = json.dumps(rest, ensure_ascii=False, sort_keys=True) if rest else None
    return row


def from_row(row: dict[str, Any]) -> dict[str, Any]:
    """The record a Parquet row holds (``to_row`` undone)."""
    import json

    rec: dict[str, Any] = {}
    for name, _ in ROW_FIELDS:
        value = row.get(name)
        if value is None:
            continue
        if name in ("error", "structured", "settings"):
            value = json.loads(value)
        if name == "settings":
            rec.update(value)
        else:
            rec[name] = value
    if "error" not in rec and "caption" not in rec:
        rec["caption"] = None
    return rec


def arrow_schema() -> Any:
    import pyarrow as pa

    return pa.schema([(name, getattr(pa, t)()) for name, t in ROW_FIELDS])
