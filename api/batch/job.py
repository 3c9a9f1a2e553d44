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

from api.batch.captioner import Outcome, caption_prompts, structured
from api.batch.ledger import record_id
from api.batch.pipeline import Pipeline
from api.batch.preparation import Preparer
from api.batch.progress import EngineClock, JobSummary, Progress
from api.batch.records import error_dict, make_record
from api.batch.samples import ShardEnd, WorkItem
from api.batch.sinks import Sink, format_for, open_sink
from api.batch.sources import Shard, UrlOptions, open_shards
from api.batch.spec import CaptionSpec

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
    todo = []
    for s in shards:
        done = sink.ledger.done.get(s.id)
        if done is None:
            todo.append(s)
        else:
            summary.shards_skipped += 1
            summary.skipped += int(done.get("samples", 0))
            summary.earlier_errors += int(done.get("errors", 0))
    counted = all(s.kind == "files" for s in shards)
    total = sum(len(s.names) for s in shards) if counted else None
    summary.total = summary.skipped
    clock = EngineClock()
    bar = Progress(progress, total, summary, clock)
    bar.advance(summary.skipped) if summary.skipped and bar.bar is not None else None
    prep = Preparer(model.prepare, getattr(model.encoder, "family", ""), spec) if workers == 0 else None
    pipeline = Pipeline(
        todo,
        sink.index,
        spec,
        workers=workers,
        depth=depth or 2 * concurrency,
        model_dir=str(model.path),
        inline_prepare=prep,
    )
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

    def record(item: WorkItem, prompt: str, seg: Any, seg_index: int | None, **what: Any) -> dict[str, Any]:
        extra: dict[str, Any] = {"key": item.key, "shard": item.shard}
        if seg_index is not None:
            extra.update(segment=seg_index, start=seg.start, end=seg.end)
        rec = make_record(
            item.name, {**settings, "prompt": prompt}, content_hash=item.content_hash, extra=extra, **what
        )
        return rec

    async def handle(item: WorkItem) -> None:
        st = states[item.shard]
        t0 = time.perf_counter()
        try:
            if item.skip:
                summary.skipped += 1
                summary.earlier_errors += item.skip_errors > 0
                return
            recs: list[dict[str, Any]] = []
            ran = reused = False
            if item.error is not None or not item.segments:
                err = item.error or {"code": "no_segments", "message": "the video gave no segment to caption"}
                recs = [record(item, p, None, None, error=err) for p in item.prompts]
            else:
                for i, seg in enumerate(item.segments):
                    idx = i if segmented else None
                    if seg.error is not None:
                        recs += [record(item, p, seg, idx, error=seg.error) for p in item.prompts]
                        continue
                    outs, was_reused = await outcomes(item, i, seg.prepared)
                    ran, reused = ran or not was_reused, reused or was_reused
                    for o in outs:
                        if o.error is not None:
                            recs.append(record(item, o.prompt, seg, idx, error=error_dict(o.error)))
                            continue
                        summary.tokens += o.tokens if not was_reused else 0
                        rec = record(
                            item, o.prompt, seg, idx, caption=o.text, elapsed_s=time.perf_counter() - t0
                        )
                        parsed = structured(o.text, spec)
                        if parsed is not None:
                            rec["structured"] = parsed
                        recs.append(rec)
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
            maybe_finish(st)
            sem.release()
            bar.advance()

    t0 = time.perf_counter()
    try:
        async for x in pipeline.items():
            if isinstance(x, ShardEnd):
                st = states[x.shard]
                st.expected = x.samples
                maybe_finish(st)
                continue
            await sem.acquire()
            task = asyncio.create_task(handle(x))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*list(tasks))
    finally:
        for t in list(tasks):
            t.cancel()
        clock.stop()
        sink.close()
        bar.close()
    summary.elapsed_s = time.perf_counter() - t0
    summary.idle_s = clock.idle_s
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
    spec: CaptionSpec | None = None,
    out_format: str | None = None,
    workers: int = 0,
    column: str | None = None,
    urls: bool = False,
    url_options: UrlOptions | None = None,
    subtitles: str | None = None,
    files_per_shard: int | None = None,
) -> JobSummary:
    """Blocking: caption every sample of ``paths`` into ``out`` (resumable; see the module
    docstring). ``model`` is a loaded ``engine.Model``; ``spec`` (default: ``prompt`` and
    ``max_tokens``) says what a caption is; ``workers`` prepares in that many processes
    (0: a thread of this one)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
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
