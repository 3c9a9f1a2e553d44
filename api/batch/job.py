"""The batch caption job: shards in, records out, resumable.

``run_caption_job(inputs, out, model=...)`` reads every input as shards
(``api.batch.sources``), prepares their samples ahead of the engine
(``api.batch.pipeline``), captions at most ``concurrency`` samples at once through the
batched engine (their decode steps share forward passes) and writes each record to the
sink (``api.batch.sinks``: JSONL, Parquet or WebDataset) as soon as it is made. A
finished shard is noted in the sink's ledger.

A record (``api.batch.records``)::

    {"file", "key", "shard", "content_hash", "caption" | "error", "prompt", "model",
     "max_tokens", ...other settings, "elapsed_s"?, "segment"/"start"/"end"?, "structured"?}

``content_hash`` is the decoded media's (for media that does not decode, its bytes').

Resume: shards in the ledger are skipped whole; in the others a sample whose records
(same key, content hash, settings and prompt) exist is skipped, and a record that exists
is never written again. Content captioned earlier in this run (same hash, prompts and
settings, under another name) is reused, without running the model again.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from api.batch.captioner import Outcome, caption_prompts
from api.batch.heap import TRIM_EVERY, trim_heap
from api.batch.item_records import item_records
from api.batch.ledger import record_id
from api.batch.pipeline import Pipeline, default_workers
from api.batch.preparation import Preparer
from api.batch.progress import EngineClock, JobSummary, Progress
from api.batch.samples import ShardEnd, WorkItem
from api.batch.sink_open import open_sink
from api.batch.sinks import Sink, format_for
from api.batch.sources import Shard, UrlOptions, open_shards
from api.batch.spec import CaptionSpec

JOB_CACHED_KV_PAGES = 64
"""Cached (released, still findable) KV pages the pool keeps while a job runs: enough for
text pages every sample shares; the distinct media's pages go back to the free pages."""

REUSE_ENTRIES = 50_000
"""Captions remembered by content for reuse (a bounded LRU: memory stays flat)."""

__all__ = ["JobSummary", "run_caption_job", "caption_job_async"]


class _ShardState:
    def __init__(self, shard: Shard):
        self.shard = shard
        self.handled = 0
        self.errors = 0
        self.expected: int | None = None


async def caption_job_async(
    model: Any,
    shards: list[Shard],
    sink: Sink,
    spec: CaptionSpec,
    *,
    concurrency: int,
    workers: int = 0,
    depth: int | None = None,
    progress: bool = True,
    subtitles: str | None = None,
    subtitles_dir: Path | None = None,
) -> JobSummary:
    settings = spec.settings(model.name)
    summary = JobSummary(torn_bytes=sink.torn_bytes, shards=len(shards))
    todo, finished = sink.ledger.unfinished(shards)
    summary.shards_skipped = finished.shards
    summary.skipped = finished.samples
    summary.earlier_errors = finished.errors
    counted = all(s.kind == "files" for s in shards)
    total = sum(len(s.names) for s in shards) if counted else None
    summary.total = summary.skipped
    clock = EngineClock()
    prep = Preparer.for_model_dir(str(model.path), spec) if workers == 0 else None
    pipeline = Pipeline(
        todo,
        sink.index,
        spec,
        workers=workers,
        depth=depth or 2 * concurrency,
        model_dir=str(model.path),
        inline_prepare=prep,
    )
    bar = Progress(progress, total, summary, clock, input_wait=lambda: pipeline.waited_s)
    bar.advance(summary.skipped) if summary.skipped and bar.bar is not None else None
    states = {s.id: _ShardState(s) for s in todo}
    reuse: OrderedDict[tuple[Any, ...], asyncio.Future[list[Outcome]]] = OrderedDict()
    sem = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task] = set()
    loop = asyncio.get_running_loop()
    segmented = bool(spec.segments or spec.scene_cuts)

    def maybe_finish(st: _ShardState) -> None:
        if st.expected is not None and st.handled == st.expected:
            sink.finish_shard(st.shard, st.handled, st.errors)
            del states[st.shard.id]

    async def outcomes(item: WorkItem, seg_index: int, prepared: Any) -> tuple[list[Outcome], bool]:
        """The prompts' outcomes for one caption target, and whether they were reused."""
        key = (item.content_hash, seg_index, tuple(item.prompts)) if item.content_hash else None
        fut = reuse.get(key) if key is not None else None
        if fut is not None:
            reuse.move_to_end(key)
            return await fut, True
        fut = loop.create_future()
        if key is not None:
            reuse[key] = fut
            if len(reuse) > REUSE_ENTRIES:
                reuse.popitem(last=False)
        clock.begin()
        try:
            got = await caption_prompts(model, prepared, item.prompts, spec)
        finally:
            clock.end()
        fut.set_result(got)
        return got, False

    async def handle(item: WorkItem) -> None:
        st = states[item.shard]
        try:
            if item.skip:
                summary.skipped += 1
                summary.earlier_errors += item.skip_errors > 0
                return
            made = await item_records(item, spec, settings, outcomes)
            recs, ran, reused = made.records, made.ran, made.reused
            summary.tokens += made.tokens
            have = sink.index.lookup(item.shard, item.key, item.content_hash)
            failed = False
            for rec in recs:
                failed = failed or "error" in rec
                if have is not None and record_id(rec) in have[0]:
                    continue  # written by an earlier run (a segment job killed mid-sample)
                sink.write(st.shard, rec)
                summary.records += 1
            if failed:
                summary.errors += 1
                st.errors += 1
            elif reused and not ran:
                summary.reused += 1
            else:
                summary.captioned += 1
            if subtitles and segmented and item.kind == "video" and subtitles_dir is not None:
                from api.batch.subtitles import write_subtitles

                first = item.prompts[0]
                cues = [
                    (r["start"], r["end"], r["caption"])
                    for r in recs
                    if r.get("prompt") == first and r.get("caption") is not None
                ]
                if cues:
                    write_subtitles(subtitles_dir, item.key, cues, subtitles)
        finally:
            st.handled += 1
            summary.total += 1
            if summary.total % TRIM_EVERY == 0:
                trim_heap()  # the samples' freed buffers back to the OS: RSS stays flat
            maybe_finish(st)
            sem.release()
            bar.advance()

    t0 = time.perf_counter()
    items = pipeline.items()
    keep_budget = _stop_encoder_cache(model)
    keep_kv_cache = _limit_kv_cache(model)
    try:
        while True:
            # A slot first, then the next item: a wait for input (``pipeline.waited_s``) is
            # then always a wait with room in the engine, the time it was starved.
            await sem.acquire()
            try:
                x = await anext(items)
            except StopAsyncIteration:
                sem.release()
                break
            if isinstance(x, ShardEnd):
                sem.release()
                st = states[x.shard]
                st.expected = x.samples
                maybe_finish(st)
                continue
            task = asyncio.create_task(handle(x))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*list(tasks))
    finally:
        await items.aclose()
        _restore_encoder_cache(model, keep_budget)
        _restore_kv_cache(model, keep_kv_cache)
        for t in list(tasks):
            t.cancel()
        clock.stop()
        sink.close()
        bar.close()
    summary.elapsed_s = time.perf_counter() - t0
    summary.idle_s = clock.idle_s
    summary.input_wait_s = pipeline.waited_s
    return summary


def _stop_encoder_cache(model: Any) -> int | None:
    """A job's samples are distinct (repeated content is reused by hash, several prompts
    share one prefill), so their tower outputs are not kept in the model's encoder cache
    while it runs: with the default 512 MiB budget the cache grew the process by ~380 MB
    over the first 2,000 images (bench/dataset_captions.py) and kept nothing useful.
    Returns the budget to restore (None: the model has no such cache)."""
    cache = getattr(getattr(model, "encoder", None), "cache", None)
    budget = getattr(cache, "byte_budget", None)
    if budget is not None:
        cache.byte_budget = 0
    return budget


def _restore_encoder_cache(model: Any, budget: int | None) -> None:
    if budget is not None:
        model.encoder.cache.byte_budget = budget


def _limit_kv_cache(model: Any) -> tuple[bool, int | None]:
    """The same for the KV pool's prefix cache: a job's media pages would never be found
    again, and kept, the pool (256 MiB on the CPU) became resident page by page as they
    filled it: +178 MB of RSS over the bench's 2,000 images. Returns (limited, the limit
    to restore)."""
    pool = getattr(model, "pool", None)
    if pool is None or not hasattr(pool, "set_cache_limit"):
        return False, None
    return True, pool.set_cache_limit(JOB_CACHED_KV_PAGES)


def _restore_kv_cache(model: Any, keep: tuple[bool, int | None]) -> None:
    if keep[0]:
        model.pool.set_cache_limit(keep[1])


def run_caption_job(
    paths: Iterable[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    model: Any,
    prompt: str = "Describe this image.",
    max_tokens: int = 32,
    concurrency: int = 8,
    progress: bool = True,
    spec: CaptionSpec | None = None,
    out_format: str | None = None,
    workers: int | None = 0,
    column: str | None = None,
    urls: bool = False,
    url_options: UrlOptions | None = None,
    subtitles: str | None = None,
    files_per_shard: int | None = None,
) -> JobSummary:
    """Blocking: caption every sample of ``paths`` into ``out`` (resumable; see the module
    docstring). ``model`` is a loaded ``engine.Model``; ``spec`` (default: ``prompt`` and
    ``max_tokens``) says what a caption is; ``workers`` prepares in that many processes
    (0: a thread of this one; None: ``pipeline.default_workers()``, by the cores)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if workers is None:
        workers = default_workers()
    if workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    out = Path(out)
    spec = spec or CaptionSpec(prompts=(prompt,), max_tokens=max_tokens)
    fmt = format_for(out, out_format)
    kw = {"files_per_shard": files_per_shard} if files_per_shard else {}
    shards = open_shards(paths, column=column, exclude=out, url_options=url_options, urls=urls, **kw)
    sink = open_sink(out, fmt, spec.fingerprint(model.name), spec.settings(model.name))
    sub_dir = out.with_name(out.name.split(".")[0] + ".subtitles") if subtitles else None
    return asyncio.run(
        caption_job_async(
            model,
            shards,
            sink,
            spec,
            concurrency=concurrency,
            workers=workers,
            progress=progress,
            subtitles=subtitles,
            subtitles_dir=sub_dir,
        )
    )
