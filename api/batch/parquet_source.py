"""Parquet files as a caption source: one row per sample, read in small record batches
(``pyarrow.parquet.ParquetFile.iter_batches``), never the whole file.

The media column (``column``; by default ``image``, ``jpg``, ``bytes``, ``url`` or the
first binary column) holds either the media bytes (binary, or a struct with ``bytes``
as Hugging Face ``datasets`` writes images) or a URL (string), fetched through the
SSRF-safe fetcher. The key is the ``key`` column when there is one, else the row index.
The row's other scalar columns are the sample's metadata (``--prompt-field`` reads them)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from api.batch.samples import Sample

BATCH_ROWS = 32
_DEFAULT_COLUMNS = ("image", "jpg", "png", "bytes", "media", "video", "audio", "url")


def _pick_column(schema: Any, asked: str | None) -> str:
    import pyarrow as pa

    names = schema.names
    if asked is not None:
        if asked not in names:
            raise ValueError(f"no column {asked!r}; the file has {', '.join(names)}")
        return asked
    for name in _DEFAULT_COLUMNS:
        if name in names:
            return name
    for f in schema:
        if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type):
            return f.name
    raise ValueError(f"no media column found (give --column); the file has {', '.join(names)}")


def parquet_samples(shard: Any) -> Iterator[Sample]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from api.batch.url_source import fetch_many

    try:
        pf = pq.ParquetFile(shard.path)
        schema = pf.schema_arrow
        column = _pick_column(schema, shard.column)
    except (OSError, ValueError, pa.ArrowException) as e:
        yield Sample(
            key="",
            shard=shard.id,
            name=shard.path,
            error={"code": "unreadable_shard", "message": f"{shard.path}: {e}"},
        )
        return
    is_url = pa.types.is_string(schema.field(column).type) or pa.types.is_large_string(
        schema.field(column).type
    )
    keep = [
        f.name
        for f in schema
        if f.name != column
        and (
            pa.types.is_string(f.type)
            or pa.types.is_integer(f.type)
            or pa.types.is_floating(f.type)
            or pa.types.is_boolean(f.type)
        )
    ]
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=[column, *keep]):
            media = batch.column(0).to_pylist()
            meta_cols = {name: batch.column(i + 1).to_pylist() for i, name in enumerate(keep)}
            samples = []
            for i, value in enumerate(media):
                metadata = {name: vals[i] for name, vals in meta_cols.items()}
                key = str(metadata["key"]) if metadata.get("key") is not None else f"{row:09d}"
                s = Sample(key=key, shard=shard.id, name=f"{shard.path}#{row}", metadata=metadata)
                if isinstance(value, dict):  # {"bytes": ..., "path": ...} (Hugging Face Image)
                    value = value.get("bytes")
                if value is None:
                    s.error = {
                        "code": "missing_media",
                        "message": f"row {row} of {shard.path}: {column} is null",
                    }
                elif is_url:
                    s.url = value
                    s.name = value
                else:
                    s.data = bytes(value)
                samples.append(s)
                row += 1
            if is_url:
                fetch_many(samples, shard.url_options)
            yield from samples
    except (OSError, pa.ArrowException) as e:
        yield Sample(
            key=f"{row:09d}",
            shard=shard.id,
            name=f"{shard.path}#{row}",
            error={"code": "truncated_shard", "message": f"{shard.path}: unreadable from row {row}: {e}"},
        )
