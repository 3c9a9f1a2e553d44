"""Which sink writes a job's output: above the sink classes, so none imports it back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from api.batch.jsonl_sink import JsonlSink
from api.batch.parquet_sink import ParquetSink
from api.batch.sinks import Sink
from api.batch.webdataset_sink import WebDatasetSink


def open_sink(out: Path, fmt: str, fingerprint: str, settings: dict[str, Any]) -> Sink:
    """The sink of output format ``fmt`` (``sinks.format_for``) at ``out``."""
    if fmt == "jsonl":
        return JsonlSink(out, fingerprint, settings)
    if fmt == "parquet":
        return ParquetSink(out, fingerprint, settings)
    if fmt == "webdataset":
        return WebDatasetSink(out, fingerprint, settings)
    raise ValueError(f"unknown output format {fmt!r}")
