"""Runs caption jobs inside the server: one asyncio task per job, at most ``concurrency``
contexts each (their decode steps share the model's forward passes with interactive
requests). On start every unfinished job resumes from its pending items; on shutdown the
tasks stop without marking anything, so the next start resumes them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from api.http.jobs_store import JobRecord, JobStore
from api.http.media_refs import MediaResolver
from api.http.registry import ModelRegistry
from api.http.store import MediaStore
from api.jobs import error_dict, make_record
from engine import caption_async
from media import PieMediaError

log = logging.getLogger("pie_media.jobs")


class JobRunner:
    def __init__(self, jobs: JobStore, media: MediaStore, models: ModelRegistry, resolver: MediaResolver):
        self.jobs = jobs
        self.media = media
        self.models = models
        self.resolver = (
            resolver  # decodes through its cache: an upload decoded at submission is not decoded again
        )
        self.version = 0
        """Bumped whenever an item or a job finishes (result streams wait on it)."""
        self._changed = asyncio.Event()
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancelled: set[str] = set()
        # Set by the Batch API: run one batch line; write the output files at the end.
        self.batch_line: Callable[[str, str | None], Awaitable[tuple[dict[str, Any], bool]]] | None = None
        self.on_batch_done: Callable[[str], Awaitable[None]] | None = None

    def __repr__(self) -> str:
        return f"JobRunner(running={sorted(self._tasks)})"

    def start(self, job_id: str) -> None:
        if job_id not in self._tasks:
            task = asyncio.create_task(self._run(job_id), name=job_id)
            self._tasks[job_id] = task
            task.add_done_callback(lambda _t: self._tasks.pop(job_id, None))

    async def resume_all(self) -> int:
        unfinished = await asyncio.to_thread(self.jobs.unfinished)
        for job in unfinished:
            log.info("resuming %s (%d/%d finished)", job.id, job.done + job.failed, job.total)
            self.start(job.id)
        return len(unfinished)

    async def cancel(self, job_id: str) -> None:
        self._cancelled.add(job_id)
        await asyncio.to_thread(self.jobs.set_status, job_id, "cancelled")
        await self._notify()
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()

    async def _notify(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for_change(self, seen: int, timeout: float) -> None:
        """Return once ``version`` has moved past ``seen`` (at once if it already has), or
        after ``timeout`` seconds (a safety net, not a poll rate)."""
        if self.version != seen:
            return
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            pass

    async def shutdown(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def wait(self, job_id: str) -> None:
        task = self._tasks.get(job_id)
        if task is not None:
            await asyncio.shield(task)

    async def _run(self, job_id: str) -> None:
        job = await asyncio.to_thread(self.jobs.get, job_id)
        if job is None or job.finished:
            return
        try:
            model = self.models.get(job.model, kind="chat").model
        except PieMediaError as e:
            await asyncio.to_thread(self.jobs.set_status, job_id, "failed", error=e.message)
            return
        await asyncio.to_thread(self.jobs.set_status, job_id, "running")
        pending = await asyncio.to_thread(self.jobs.pending_items, job_id)
        gate = asyncio.Semaphore(job.concurrency)
        settings = {"model": job.model, "prompt": job.prompt, "max_tokens": job.max_tokens}

        async def one(idx: int, name: str, media_id: str | None, payload: str | None) -> None:
            async with gate:
                if job.kind == "batch":
                    assert self.batch_line is not None
                    record, failed = await self.batch_line(name, payload)
                else:
                    record = {"index": idx, **await self._caption(model, job, name, media_id, settings)}
                    failed = "error" in record
                await asyncio.to_thread(self.jobs.finish_item, job_id, idx, record, failed=failed)
                await self._notify()

        await asyncio.gather(*(one(*item) for item in pending))
        if job.kind == "batch" and self.on_batch_done is not None:
            await self.on_batch_done(job_id)
        await asyncio.to_thread(self.jobs.set_status, job_id, "completed")
        await self._notify()

    async def _caption(
        self, model: Any, job: JobRecord, name: str, media_id: str | None, settings: dict[str, Any]
    ) -> dict[str, Any]:
        t0 = time.perf_counter()
        h = None
        try:
            raw = await asyncio.to_thread(self.media.read_bytes, media_id)
            image = await self.resolver.decode(raw, "image")
            h = image.content_hash
            text = await caption_async(model, image, prompt=job.prompt, max_tokens=job.max_tokens)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # one item's failure is its record, never the job's
            return make_record(name, settings, content_hash=h, error=error_dict(e))
        return make_record(name, settings, content_hash=h, caption=text, elapsed_s=time.perf_counter() - t0)
