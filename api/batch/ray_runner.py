"""Batch captioning on Ray Data, for when one machine is not enough.

    caption_with_ray(["photos/"], "captions.jsonl", model="tiny", replicas=2)
    pie-media caption --ray [ADDRESS] photos/ --out captions.jsonl

The pipeline: file names (local paths, expanded like the single-process job, or any URI
``ray.data.read_binary_files`` reads) -> decode + prepare on CPU workers (a class-based
UDF holding the model's preparer, no weights) -> caption on actors that each hold one
engine (``replicas`` of them, one GPU each when there are GPUs; each actor runs its batch
concurrently so the rows share forward passes) -> records. ``.jsonl`` outputs are
appended by the driver, one fsync'ed record per file as in ``api.batch.job``, so a rerun skips
what is done (Ray Data's own checkpointing was not reliable here: resume is ours);
``.parquet`` outputs are written by Ray (``write_parquet``, a folder).

Records equal the single-process job's (``api.batch.job``): a caption or a typed error per
file, never a failed run. Ray is an optional extra (``pip install .[ray]``), imported
only here.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.batch.file_source import expand_paths
from api.batch.journal import JournalWriter, read_records
from api.batch.records import error_dict, make_record
from api.batch.sources import open_shards

DEFAULT_BATCH = 8


@dataclass
class RaySummary:
    total: int = 0
    skipped: int = 0
    captioned: int = 0
    errors: int = 0
    elapsed_s: float = 0.0
    replicas: int = 0

    def __str__(self) -> str:
        return (
            f"{self.captioned} captioned, {self.skipped} already done, {self.errors} errors of {self.total} "
            f"files in {self.elapsed_s:.1f}s on {self.replicas} engine replica(s)"
        )


class Prepare:
    """CPU stage: bytes -> decoded image -> the model's prepared inputs (or an error)."""

    def __init__(self, model_dir: str):
        from encoders import encoder_for

        self.encoder = encoder_for(model_dir, load_weights=False)

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        from media import PieMediaError, content_hash, open_media

        # The error travels as JSON text ("" = none): Arrow would turn dicts into structs of nulls.
        data, out = (
            row["bytes"],
            {
                "file": row["file"],
                "shard": row.get("shard", ""),
                "prepared": None,
                "error": "",
                "content_hash": "",
            },
        )
        try:
            image = open_media(data)
            out["content_hash"] = image.content_hash
            out["prepared"] = self.encoder.prepare(image)
        except PieMediaError as e:
            out["content_hash"] = out["content_hash"] or content_hash(data)
            out["error"] = json.dumps(e.to_dict())
        return out


class Caption:
    """GPU/CPU stage: one engine per actor; a batch's rows generate together."""

    def __init__(self, model_ref: str, prompt: str, max_tokens: int):
        import torch

        from api.model_ref import load_model
        from engine import freeze_startup_heap

        torch.set_num_threads(1)
        self.model = load_model(model_ref)
        freeze_startup_heap()  # the actor's loaded heap out of the GC's walks (engine/startup_heap.py)
        self.prompt, self.max_tokens = prompt, max_tokens
        self.settings = {"model": self.model.name, "prompt": prompt, "max_tokens": max_tokens}

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        from engine import caption_async, run_sync

        async def one(file: str, shard: str, h: str, prepared: Any, error: str) -> dict[str, Any]:
            file, shard, h = str(file), str(shard), str(h) or None
            if error:
                return make_record(
                    file,
                    self.settings,
                    content_hash=h,
                    error=json.loads(str(error)),
                    extra=_extra(file, shard),
                )
            t0 = time.perf_counter()
            try:
                text = await caption_async(
                    self.model, prepared, prompt=self.prompt, max_tokens=self.max_tokens
                )
            except Exception as e:  # one file's failure is its record
                return make_record(
                    file, self.settings, content_hash=h, error=error_dict(e), extra=_extra(file, shard)
                )
            return make_record(
                file,
                self.settings,
                content_hash=h,
                caption=text,
                elapsed_s=time.perf_counter() - t0,
                extra=_extra(file, shard),
            )

        async def all_rows() -> list[dict[str, Any]]:
            rows = zip(
                batch["file"],
                batch["shard"],
                batch["content_hash"],
                batch["prepared"],
                batch["error"],
                strict=True,
            )
            return list(await asyncio.gather(*(one(*r) for r in rows)))

        # JSON text: Arrow would merge the records' different keys into one struct schema.
        return {"record": [json.dumps(r, ensure_ascii=False) for r in run_sync(all_rows())]}


def _init_ray(address: str | None, replicas: int, started: list[Any] | None = None) -> Any:
    """Ray, started here unless this process already holds a session (then that one is used
    as it is). A session started here is appended to ``started``: the caller shuts it down;
    one it was handed stays up for whoever started it."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if not ray.is_initialized():
        if started is not None:
            started.append(ray)
        if address:
            ray.init(address=address, log_to_driver=False)
        else:  # logical CPUs: the actors and the decode workers all get a slot on a small machine
            ray.init(
                num_cpus=max(os.cpu_count() or 1, replicas + 2), include_dashboard=False, log_to_driver=False
            )
    ray.data.DataContext.get_current().enable_progress_bars = False
    return ray


def caption_with_ray(
    sources: list[str],
    out: str | os.PathLike[str],
    *,
    model: str = "tiny",
    prompt: str = "Describe this image.",
    max_tokens: int = 32,
    replicas: int = 2,
    address: str | None = None,
    batch_size: int = DEFAULT_BATCH,
    column: str | None = None,
    spec: Any = None,
    out_format: str | None = None,
) -> Any:
    """Caption every file of ``sources`` into ``out`` (see the module docstring). WebDataset
    and Parquet shards go through Ray Data's own readers (``api.batch.ray_shards``) and
    take the whole ``spec`` (default: ``prompt`` and ``max_tokens``)."""
    from api.model_ref import resolve_model_dir

    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    out = Path(out)
    local_shards = open_shards([s for s in sources if "://" not in s], column=column, exclude=out)
    data_shards = [s for s in local_shards if s.kind in ("webdataset", "parquet")]
    if data_shards:
        if len(data_shards) != len(local_shards) or any("://" in s for s in sources):
            raise ValueError(
                "--ray reads either WebDataset/Parquet shards or media files, not both in one job"
            )
        from api.batch.ray_shards import caption_shards_with_ray
        from api.batch.spec import CaptionSpec

        started: list[Any] = []

        def start_ray() -> Any:
            return _init_ray(address, replicas, started)

        try:
            return caption_shards_with_ray(
                start_ray,
                data_shards,
                out,
                model=model,
                spec=spec or CaptionSpec(prompts=(prompt,), max_tokens=max_tokens),
                replicas=replicas,
                out_format=out_format,
                batch_size=batch_size,
            )
        finally:
            for ray in started:
                ray.shutdown()
    model_dir = str(resolve_model_dir(model))
    settings = {"model": Path(model_dir).name, "prompt": prompt, "max_tokens": max_tokens}  # Model.name
    local = [s for s in sources if "://" not in s]
    remote = [s for s in sources if "://" in s]
    files = [str(f) for f in expand_paths(local, exclude=out)]
    shard_of = {name: s.id for s in open_shards(local, exclude=out) if s.kind == "files" for name in s.names}
    done: set[str] = set()
    if out.suffix == ".jsonl":
        records, _ = read_records(out)
        done = {r["file"] for r in records if all(r.get(k) == v for k, v in settings.items())}
    summary = RaySummary(total=len(files), replicas=replicas)
    todo = [f for f in files if f not in done]
    summary.skipped = len(files) - len(todo)
    t0 = time.perf_counter()
    if not todo and not remote:
        return summary
    started: list[Any] = []
    ray = _init_ray(address, replicas, started)
    try:
        parts = []
        if todo:
            parts.append(
                ray.data.from_items([{"file": f, "shard": shard_of.get(f, "")} for f in todo]).map(
                    _read_local
                )
            )
        if remote:
            parts.append(ray.data.read_binary_files(remote, include_paths=True).map(_rename_path))
        if not parts:
            summary.elapsed_s = time.perf_counter() - t0
            return summary
        ds = parts[0] if len(parts) == 1 else parts[0].union(*parts[1:])
        import torch

        gpus = 1 if torch.cuda.is_available() else 0
        ds = ds.map(Prepare, fn_constructor_args=(model_dir,), concurrency=1)
        ds = ds.map_batches(
            Caption,
            fn_constructor_args=(model, prompt, max_tokens),
            batch_size=batch_size,
            concurrency=replicas,
            num_gpus=gpus,
            batch_format="numpy",
        )
        if out.suffix == ".parquet":
            ds.map(_flat).write_parquet(str(out))
            summary.captioned = summary.total - summary.skipped
        else:
            writer = JournalWriter(out)
            try:
                for row in ds.iter_rows():
                    rec = json.loads(row["record"])
                    writer.write(rec)
                    if "error" in rec:
                        summary.errors += 1
                    else:
                        summary.captioned += 1
            finally:
                writer.close()
    finally:
        if started:
            ray.shutdown()
    summary.elapsed_s = time.perf_counter() - t0
    return summary


def _extra(file: str, shard: str) -> dict[str, Any]:
    """The record's key and shard, as the single-process job writes them."""
    return {"key": file, "shard": shard} if shard else {}


def _read_local(row: dict[str, Any]) -> dict[str, Any]:
    path = Path(row["file"])
    try:
        data = path.read_bytes()
    except OSError:
        data = b""
    return {"file": row["file"], "shard": row["shard"], "bytes": data}


def _rename_path(row: dict[str, Any]) -> dict[str, Any]:
    return {"file": row["path"], "shard": "", "bytes": row["bytes"]}


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    """A record as Parquet columns (the error as JSON text, null when captioned)."""
    rec = json.loads(row["record"])
    error = rec.get("error")
    return {
        "file": rec["file"],
        "content_hash": rec.get("content_hash"),
        "caption": rec.get("caption"),
        "error": json.dumps(error) if error is not None else None,
        "model": rec["model"],
        "prompt": rec["prompt"],
        "max_tokens": rec["max_tokens"],
        "elapsed_s": rec.get("elapsed_s"),
    }
