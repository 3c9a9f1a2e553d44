"""Batch captioning job: many files in, one JSONL record per file out, resumable.

``run_caption_job(paths, out)`` expands directories (recursively, sorted; hidden files
and the output file itself are skipped), then captions every file through the batched
engine with at most ``concurrency`` contexts in flight (their decode steps share forward
passes in the model's scheduler). Each record is appended to ``out`` as soon as it is
ready, flushed and fsync'ed, so a killed run loses at most the records in flight.

Records (one JSON object per line)::

    {"file", "content_hash", "caption", "model", "prompt", "max_tokens", "elapsed_s"}
    {"file", "content_hash"?, "error": {"code", "message", ...}, "model", "prompt", "max_tokens"}

``content_hash`` is the decoded image's ``media.Image.content_hash``; for a file that does
not decode it is the hash of its raw bytes (absent when the file cannot be read).

Resume: at start the existing JSONL is read (a torn last line from a killed run is cut
off). A file is skipped when a record with the same file name, content hash and settings
(model, prompt, max_tokens) exists. A file whose content was already captioned under
another name (same hash and settings, in an earlier run or in this one) gets its own
record with that caption, without running the model again.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.batch.file_source import expand_paths
from api.batch.journal import JournalWriter, read_records
from api.batch.records import make_record
from media import DEFAULT_LIMITS, Image, PieMediaError, content_hash


@dataclass
class JobSummary:
    total: int = 0
    skipped: int = 0
    captioned: int = 0
    reused: int = 0
    """Records written from an earlier caption of the same content (no model run)."""
    errors: int = 0
    earlier_errors: int = 0
    """Files skipped because an earlier run recorded an error for them."""
    torn_bytes: int = 0
    """Bytes of a torn last line cut from the output at start."""
    elapsed_s: float = 0.0
    files: list[str] = field(default_factory=list)


def _load(path: Path) -> tuple[Image | None, str | None, dict[str, Any] | None]:
    """(image, content_hash, error): read and decode one file."""
    try:
        if path.stat().st_size > DEFAULT_LIMITS.max_bytes:
            raw = None
        else:
            raw = path.read_bytes()
    except OSError as e:
        return None, None, {"code": "unreadable", "message": f"{path}: {e.strerror or e}"}
    if raw is None:
        return (
            None,
            None,
            {"code": "too_large", "message": f"{path}: larger than {DEFAULT_LIMITS.max_bytes} bytes"},
        )
    try:
        image = Image.from_bytes(raw)
    except PieMediaError as e:
        return None, content_hash(raw), e.to_dict()
    return image, image.content_hash, None


async def caption_job_async(
    model: Any,
    files: list[Path],
    out: Path,
    *,
    prompt: str,
    max_tokens: int,
    concurrency: int,
    progress: bool = True,
) -> JobSummary:
    from engine import caption_async

    settings = {"model": model.name, "prompt": prompt, "max_tokens": max_tokens}
    records, torn = read_records(out)
    summary = JobSummary(total=len(files), torn_bytes=torn, files=[str(f) for f in files])
    mine = [r for r in records if all(r.get(k) == v for k, v in settings.items())]
    done = {(r["file"], r.get("content_hash")): "error" in r for r in mine}
    captions: dict[str, asyncio.Future[str]] = {}  # content hash -> caption (earlier or in flight)
    loop = asyncio.get_running_loop()
    for r in mine:
        if "caption" in r and r.get("content_hash") and r["content_hash"] not in captions:
            captions[r["content_hash"]] = loop.create_future()
            captions[r["content_hash"]].set_result(r["caption"])

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(files), file=sys.stderr, unit="file", dynamic_ncols=True, desc="caption")
    writer = JournalWriter(out)
    sem = asyncio.Semaphore(concurrency)

    async def one(path: Path) -> None:
        name = str(path)
        async with sem:
            t0 = time.perf_counter()
            image, h, err = await asyncio.to_thread(_load, path)
            if (name, h) in done:
                summary.skipped += 1
                summary.earlier_errors += done[(name, h)]
                return
            if err is not None:
                rec = make_record(name, settings, content_hash=h, error=err)
                summary.errors += 1
                writer.write(rec)
                return
            assert h is not None
            fut = captions.get(h)
            if fut is None:
                fut = captions[h] = loop.create_future()
                try:
                    text = await caption_async(model, image, prompt=prompt, max_tokens=max_tokens)
                except Exception as e:  # one file's failure is its record; the run goes on
                    fut.set_exception(e)
                    fut.exception()  # the other names of this content read it; no "never retrieved"
                else:
                    fut.set_result(text)
                    summary.captioned += 1
            else:
                summary.reused += 1
            try:
                text = await fut
            except Exception as e:
                rec = make_record(
                    name,
                    settings,
                    content_hash=h,
                    error={"code": getattr(e, "code", None) or type(e).__name__, "message": str(e)},
                )
                summary.errors += 1
            else:
                rec = make_record(
                    name, settings, content_hash=h, caption=text, elapsed_s=time.perf_counter() - t0
                )
            writer.write(rec)

    async def tracked(path: Path) -> None:
        try:
            await one(path)
        finally:
            if bar is not None:
                bar.set_postfix(skipped=summary.skipped, errors=summary.errors, refresh=False)
                bar.update(1)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(tracked(f) for f in files))
    finally:
        writer.close()
        if bar is not None:
            bar.close()
    summary.elapsed_s = time.perf_counter() - t0
    return summary


def run_caption_job(
    paths: Iterable[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    model: Any,
    prompt: str = "Describe this image.",
    max_tokens: int = 32,
    concurrency: int = 8,
    progress: bool = True,
) -> JobSummary:
    """Blocking: caption every file under ``paths`` into the JSONL at ``out`` (resumable).
    ``model`` is a loaded ``engine.Model``."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    out = Path(out)
    files = expand_paths(paths, exclude=out)
    return asyncio.run(
        caption_job_async(
            model,
            files,
            out,
            prompt=prompt,
            max_tokens=max_tokens,
            concurrency=concurrency,
            progress=progress,
        )
    )
