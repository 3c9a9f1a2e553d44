"""WebDataset and Parquet shards on Ray Data: Ray's own readers, one shard per read task,
the records of the single-process job (``api.batch.job``) written through its sinks.

    caption_shards_with_ray(shards, "captions.jsonl", model="tiny", spec=CaptionSpec())

- WebDataset tars go through ``ray.data.read_webdataset`` (raw bytes, no decoding) and
  Parquet files with a ``key`` column through ``ray.data.read_parquet``, each with as
  many read tasks as shards, so a task reads one shard; the sample -> prepared inputs
  step (``api.batch.preparation.Preparer``, as in the single-process job) is fused into
  that task. Engine actors (``replicas``) caption the prepared samples with the job's
  own record maker (``api.batch.item_records``).
- A shard Ray's reader would fail on or read differently is read by this package's own
  reader in one Ray task instead, so bad input is a typed record as in the single-process
  job: a tar the driver's header scan finds damaged or irregular (cut off, a member over
  the media limit, keys not contiguous, a member name without an extension, two media
  members in one sample), a Parquet file without a ``key`` column (its keys are row
  numbers, which Ray's reader does not give), with a URL column, or unreadable.
- The driver writes every record through the sink (JSONL, Parquet, WebDataset tars with
  their ledger), skipping a record the output already holds (same shard, key, content
  hash, prompt, segment): a task Ray runs again after its worker died, or a rerun after a
  killed job, writes nothing twice. A shard is noted finished in the ledger once every
  one of its samples is in; a rerun skips finished shards without reading them.
"""

from __future__ import annotations

import json
import os
import pickle
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.batch.ledger import DoneIndex, record_id
from api.batch.samples import MEDIA_EXTS, Sample
from api.batch.sources import Shard
from api.batch.spec import CaptionSpec
from api.batch.webdataset_source import split_member_name
from media import DEFAULT_LIMITS

DEFAULT_BATCH = 8


@dataclass
class ShardRunSummary:
    total: int = 0
    skipped: int = 0
    captioned: int = 0
    errors: int = 0
    records: int = 0
    shards: int = 0
    shards_skipped: int = 0
    shards_by_own_reader: int = 0
    elapsed_s: float = 0.0
    replicas: int = 0

    def __str__(self) -> str:
        return (
            f"{self.captioned} captioned, {self.skipped} already done, {self.errors} errors of {self.total} "
            f"samples ({self.shards} shards, {self.shards_skipped} finished earlier) in {self.elapsed_s:.1f}s "
            f"on {self.replicas} engine replica(s)"
        )


# -- the driver's look at a shard before Ray reads it ---------------------------------------
@dataclass
class ShardPlan:
    shard: Shard
    samples: int | None
    """Samples in the shard (None: only its own reader knows; it says so at the end)."""
    by_ray: bool
    rows: dict[str, int] | None = None
    """Parquet read by Ray: key -> row number (the record's ``file`` is ``path#row``)."""


def scan_tar(path: str) -> int | None:
    """Samples in a tar that Ray's reader reads as the single-process reader does, or
    None when it is damaged or irregular (headers only: member data is seeked over)."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            keys: list[str] = []
            seen: set[str] = set()
            media_in_key = 0
            for info in tar:
                if not info.isfile():
                    continue
                key, ext = split_member_name(info.name)
                if not ext or info.size > DEFAULT_LIMITS.max_bytes:
                    return None
                if not keys or keys[-1] != key:
                    if key in seen:
                        return None  # not contiguous
                    keys.append(key)
                    seen.add(key)
                    media_in_key = 0
                if ext.rsplit(".", 1)[-1].lower() in MEDIA_EXTS:
                    media_in_key += 1
                    if media_in_key > 1:
                        return None
            end = tar.offset
        if os.path.getsize(path) < end:
            return None  # the last member's data is cut off
        return len(keys)
    except (tarfile.TarError, OSError, EOFError):
        return None


def plan_shard(shard: Shard) -> ShardPlan:
    if shard.kind == "webdataset":
        n = scan_tar(shard.path) if shard.path.endswith(".tar") else None
        return ShardPlan(shard, n, n is not None)
    if shard.kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        from api.batch.parquet_source import _pick_column

        try:
            pf = pq.ParquetFile(shard.path)
            schema = pf.schema_arrow
            column = _pick_column(schema, shard.column)
            binary = not pa.types.is_string(schema.field(column).type) and not pa.types.is_large_string(
                schema.field(column).type
            )
            if binary and "key" in schema.names and column != "key":
                keys = [str(k) for k in pf.read(columns=["key"]).column(0).to_pylist()]
                rows = {k: i for i, k in enumerate(keys)}
                if len(rows) == len(keys) and "None" not in rows:
                    return ShardPlan(shard, len(keys), True, rows)
        except (OSError, ValueError, pa.ArrowException):
            pass
    return ShardPlan(shard, None, False)


# -- in Ray's read tasks: rows -> prepared work items ----------------------------------------
_PREPARERS: dict[tuple[str, str], Any] = {}


def _preparer(model_dir: str, spec: CaptionSpec) -> Any:
    from api.batch.preparation import Preparer

    key = (model_dir, repr(spec))  # a spec holds dicts: not hashable
    if key not in _PREPARERS:
        _PREPARERS[key] = Preparer.for_model_dir(model_dir, spec)
    return _PREPARERS[key]


def _lookup(index: DoneIndex, spec: CaptionSpec) -> Any:
    from api.batch.pipeline import _done_lookup

    return lambda shard: _done_lookup(index, shard, spec)


def _item_row(prep: Any, sample: Sample, index: DoneIndex, spec: CaptionSpec) -> dict[str, Any]:
    item = prep(sample, _lookup(index, spec)(sample.shard))
    return {"shard": sample.shard, "key": sample.key, "item": pickle.dumps(item, protocol=5), "end": -1}


def _local(url: str) -> str:
    for scheme in ("local://", "file://"):
        if url.startswith(scheme):
            url = url[len(scheme) :]
    return os.path.abspath(url)


def prepare_wds_row(
    row: dict[str, Any], *, model_dir: str, spec: CaptionSpec, shards: dict[str, Shard], index: DoneIndex
) -> dict[str, Any]:
    """A ``read_webdataset`` row (``__key__``, ``__url__``, a column per member extension,
    None where this sample has no such member) as the single-process reader's sample."""
    from api.batch.webdataset_source import sample_from_members

    shard = shards[_local(str(row["__url__"]))]
    members = {
        ext: bytes(v)
        for ext, v in row.items()
        if not ext.startswith("__") and isinstance(v, (bytes, bytearray, memoryview))
    }
    sample = sample_from_members(shard, str(row["__key__"]), members, [])
    return _item_row(_preparer(model_dir, spec), sample, index, spec)


def prepare_parquet_row(
    row: dict[str, Any],
    *,
    model_dir: str,
    spec: CaptionSpec,
    shards: dict[str, Shard],
    index: DoneIndex,
    columns: dict[str, str],
) -> dict[str, Any]:
    """A ``read_parquet`` row (``path`` added by Ray) as the single-process reader's sample
    (its ``file`` is fixed by the driver, which knows the row numbers)."""
    shard = shards[_local(str(row["path"]))]
    column = columns[shard.id]
    value = row.get(column)
    if isinstance(value, dict):
        value = value.get("bytes")
    metadata = {k: v for k, v in row.items() if k not in (column, "path") and _scalar(v)}
    key = str(row["key"])
    sample = Sample(key=key, shard=shard.id, name=shard.path, metadata=metadata)
    if value is None:
        sample.error = {"code": "missing_media", "message": f"a row of {shard.path}: {column} is null"}
    else:
        sample.data = bytes(value)
    return _item_row(_preparer(model_dir, spec), sample, index, spec)


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def read_own(
    row: dict[str, Any], *, model_dir: str, spec: CaptionSpec, index: DoneIndex
) -> list[dict[str, Any]]:
    """A whole shard read by this package's reader (one task), then its end marker."""
    shard: Shard = pickle.loads(row["shard"])
    prep = _preparer(model_dir, spec)
    out = [_item_row(prep, s, index, spec) for s in shard.samples()]
    keys = {r["key"] for r in out}
    out.append({"shard": shard.id, "key": "", "item": b"", "end": len(keys)})
    return out


# -- on the engine actors ---------------------------------------------------------------------
class CaptionItems:
    """One engine per actor; a batch's samples are captioned together (their decode steps
    share forward passes), each into the single-process job's records."""

    def __init__(self, model_ref: str, spec: CaptionSpec):
        import torch

        from api.model_ref import load_model
        from engine import freeze_startup_heap

        torch.set_num_threads(1)
        self.model = load_model(model_ref)
        freeze_startup_heap()
        from api.batch.job import _limit_kv_cache, _stop_encoder_cache

        _stop_encoder_cache(self.model)  # as the single-process job: distinct samples
        _limit_kv_cache(self.model)
        self.spec = spec
        self.settings = spec.settings(self.model.name)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import asyncio

        from api.batch.captioner import caption_prompts
        from api.batch.item_records import item_records
        from engine import run_sync

        async def outcomes(item: Any, _i: int, prepared: Any) -> tuple[list[Any], bool]:
            return await caption_prompts(self.model, prepared, item.prompts, self.spec), False

        async def one(raw: bytes, end: int) -> str:
            if end >= 0:
                return json.dumps({"end": int(end)})
            item = pickle.loads(raw)
            if item.skip:
                return json.dumps({"skipped": True, "errors": item.skip_errors})
            made = await item_records(item, self.spec, self.settings, outcomes)
            return json.dumps({"records": made.records}, ensure_ascii=False)

        async def all_rows() -> list[str]:
            return list(
                await asyncio.gather(*(one(r, e) for r, e in zip(batch["item"], batch["end"], strict=True)))
            )

        return {"shard": batch["shard"], "key": batch["key"], "result": run_sync(all_rows())}


# -- the driver -------------------------------------------------------------------------------
def caption_shards_with_ray(
    start_ray: Callable[[], Any],
    shards: list[Shard],
    out: Path,
    *,
    model: str,
    spec: CaptionSpec,
    replicas: int,
    out_format: str | None = None,
    batch_size: int = DEFAULT_BATCH,
) -> ShardRunSummary:
    """Caption ``shards`` (WebDataset / Parquet) into ``out``; ``start_ray()`` gives the
    ``ray`` module, started (called only when a shard is left to do)."""
    from api.batch.sink_open import open_sink
    from api.batch.sinks import format_for
    from api.model_ref import resolve_model_dir

    model_dir = str(resolve_model_dir(model))
    name = Path(model_dir).name  # Model.name
    sink = open_sink(out, format_for(out, out_format), spec.fingerprint(name), spec.settings(name))
    summary = ShardRunSummary(shards=len(shards), replicas=replicas)
    t0 = time.perf_counter()
    try:
        todo, finished = sink.ledger.unfinished(shards)
        summary.shards_skipped = finished.shards
        summary.skipped = summary.total = finished.samples
        plans = {s.id: plan_shard(s) for s in todo}
        summary.shards_by_own_reader = sum(not p.by_ray for p in plans.values())
        if todo:
            ds = _dataset(start_ray(), plans, model_dir, spec, sink.index)
            ds = ds.map_batches(
                CaptionItems,
                fn_constructor_args=(model, spec),
                batch_size=batch_size,
                concurrency=replicas,
                num_gpus=_gpus(),
                batch_format="numpy",
            )
            _write(ds, plans, sink, summary)
    finally:
        sink.close()
    summary.elapsed_s = time.perf_counter() - t0
    return summary


def _gpus() -> int:
    import torch

    return 1 if torch.cuda.is_available() else 0


def _dataset(
    ray: Any, plans: dict[str, ShardPlan], model_dir: str, spec: CaptionSpec, index: DoneIndex
) -> Any:
    from api.batch.parquet_source import _pick_column

    common = {"model_dir": model_dir, "spec": spec}
    parts = []
    wds = [p.shard for p in plans.values() if p.by_ray and p.shard.kind == "webdataset"]
    pqs = [p.shard for p in plans.values() if p.by_ray and p.shard.kind == "parquet"]
    own = [p.shard for p in plans.values() if not p.by_ray]

    def part_index(group: list[Shard]) -> DoneIndex:
        return DoneIndex({k: v for s in group for k, v in index.for_shard(s.id).entries.items()})

    if wds:
        by_path = {_local(s.path): s for s in wds}
        parts.append(
            ray.data.read_webdataset([s.path for s in wds], decoder=None, override_num_blocks=len(wds)).map(
                prepare_wds_row, fn_kwargs={**common, "shards": by_path, "index": part_index(wds)}
            )
        )
    if pqs:
        import pyarrow.parquet as pq

        by_path = {_local(s.path): s for s in pqs}
        columns = {s.id: _pick_column(pq.ParquetFile(s.path).schema_arrow, s.column) for s in pqs}
        parts.append(
            ray.data.read_parquet(
                [s.path for s in pqs], include_paths=True, override_num_blocks=len(pqs)
            ).map(
                prepare_parquet_row,
                fn_kwargs={**common, "shards": by_path, "index": part_index(pqs), "columns": columns},
            )
        )
    if own:
        parts.append(
            ray.data.from_items(
                [{"shard": pickle.dumps(s)} for s in own], override_num_blocks=len(own)
            ).flat_map(read_own, fn_kwargs={**common, "index": part_index(own)})
        )
    return parts[0] if len(parts) == 1 else parts[0].union(*parts[1:])


def _write(ds: Any, plans: dict[str, ShardPlan], sink: Any, summary: ShardRunSummary) -> None:
    seen: dict[str, set[str]] = {sid: set() for sid in plans}
    errors: dict[str, int] = dict.fromkeys(plans, 0)
    expected = {sid: p.samples for sid, p in plans.items()}

    def maybe_finish(sid: str) -> None:
        n = expected[sid]
        if n is not None and len(seen[sid]) == n and sid not in sink.ledger.done:
            sink.finish_shard(plans[sid].shard, n, errors[sid])

    for row in ds.iter_rows():
        sid, key = str(row["shard"]), str(row["key"])
        got = json.loads(row["result"])
        if "end" in got:
            expected[sid] = got["end"]
            maybe_finish(sid)
            continue
        if key in seen[sid]:
            continue  # the same sample again: a task Ray ran a second time
        seen[sid].add(key)
        summary.total += 1
        if got.get("skipped"):
            summary.skipped += 1
            errors[sid] += got["errors"] > 0
        else:
            recs = got["records"]
            rows = plans[sid].rows
            failed = False
            for rec in recs:
                if rows is not None:
                    rec["file"] = f"{plans[sid].shard.path}#{rows[key]}"
                failed = failed or "error" in rec
                have = sink.index.lookup(sid, key, rec.get("content_hash"))
                if have is not None and record_id(rec) in have[0]:
                    continue  # written before: an earlier run, or a task run again
                sink.write(plans[sid].shard, rec)
                sink.index.add(rec)
                summary.records += 1
            if failed:
                summary.errors += 1
                errors[sid] += 1
            else:
                summary.captioned += 1
        maybe_finish(sid)
