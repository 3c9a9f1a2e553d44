"""Runs caption jobs and batches inside the server: one asyncio task per job, at most
``concurrency`` contexts each (their decode steps share the model's forward passes with
interactive requests). On start every unfinished job resumes from its pending items; on
shutdown the tasks stop and give back their claims, so the next start (or another replica)
resumes them.

Items are claimed one at a time (:meth:`JobStore.claim_items`) under this runner's owner
id, and a heartbeat renews the claims every third of the lease, so replicas sharing the
store split a job between them and take over the claims of one that died once its lease
runs out. The replica that wins :meth:`JobStore.claim_finalize` writes a batch's output
files and marks the job completed. On a shared store a watcher also starts, every
``poll_s``, the unfinished jobs other replicas created."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from api.batch.records import error_dict, make_record
from api.http.media_refs import MediaResolver
from api.http.registry import ModelRegistry
from api.http.security.tenancy import enter, owner_of_tenant
from api.http.stores.jobs import JobRecord, JobStore
from api.http.stores.uploads import MediaStore
from engine import caption_async
from media import PieMediaError

log = logging.getLogger("pie_media.jobs")


class JobRunner:
    def __init__(
        self,
        jobs: JobStore,
        media: MediaStore,
        models: ModelRegistry,
        resolver: MediaResolver,
        *,
        lease_s: float = 30.0,
        poll_s: float = 1.0,
    ):
        self.jobs = jobs
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        """This runner's claims carry this id."""
        self.lease_s = lease_s
        self.poll_s = poll_s
        self._background: list[asyncio.Task] = []
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
        # (endpoint, custom_id, request body JSON) -> (output record, failed)
        self.batch_line: Callable[[str, str, str | None], Awaitable[tuple[dict[str, Any], bool]]] | None = (
            None
        )
        self.on_batch_done: Callable[[str], Awaitable[None]] | None = None
        self.share_caches = False
        """``--share-prefix-cache``: a job's lines reuse caches across tenants too."""

    def __repr__(self) -> str:
        return f"JobRunner(running={sorted(self._tasks)})"

    def start(self, job_id: str) -> None:
        if not self._background:
            self._background.append(asyncio.create_task(self._heartbeat(), name="job-claims-heartbeat"))
            if self.jobs.shared:
                self._background.append(asyncio.create_task(self._watch(), name="job-watch"))
        if job_id not in self._tasks:
            task = asyncio.create_task(self._run(job_id), name=job_id)
            self._tasks[job_id] = task
            task.add_done_callback(lambda _t: self._tasks.pop(job_id, None))

    async def resume_all(self) -> int:
        unfinished = await asyncio.to_thread(self.jobs.unfinished)
        for job in unfinished:
            log.info("resuming %s (%d/%d finished)", job.id, job.done + job.failed, job.total)
            self.start(job.id)
        if self.jobs.shared and not self._background:
            self._background.append(asyncio.create_task(self._heartbeat(), name="job-claims-heartbeat"))
            self._background.append(asyncio.create_task(self._watch(), name="job-watch"))
        return len(unfinished)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await asyncio.to_thread(self.jobs.renew, self.owner)
            except Exception:  # a blip of the index: the next beat tries again
                log.exception("renewing the job claims failed")

    async def _watch(self) -> None:
        """Start here the unfinished jobs of the shared store that no task here runs."""
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                for job in await asyncio.to_thread(self.jobs.unfinished):
                    if job.id not in self._tasks and job.id not in self._cancelled:
                        self.start(job.id)
            except Exception:
                log.exception("looking for shared jobs failed")

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
        tasks = [*self._tasks.values(), *self._background]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._background.clear()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.jobs.release, self.owner)

    async def wait(self, job_id: str) -> None:
        task = self._tasks.get(job_id)
        if task is not None:
            await asyncio.shield(task)

    async def _run(self, job_id: str) -> None:
        job = await asyncio.to_thread(self.jobs.get, job_id)
        if job is None or job.finished:
            return
        # The job's lines run as its creator (this task's own context): a batch line's
        # pie-media:// reference reaches that tenant's uploads only, after a restart too.
        enter(owner_of_tenant(job.tenant), shared_caches=self.share_caches)
        try:
            model = self.models.get(job.model, kind="chat").model
        except PieMediaError as e:
            await asyncio.to_thread(self.jobs.set_status, job_id, "failed", error=e.message)
            return
        await asyncio.to_thread(self.jobs.set_status, job_id, "running")
        settings = {"model": job.model, "prompt": job.prompt, "max_tokens": job.max_tokens}

        async def worker() -> None:
            while job_id not in self._cancelled:
                got = await asyncio.to_thread(self.jobs.claim_items, job_id, self.owner, 1, self.lease_s)
                if not got:
                    return
                idx, name, media_id, payload = got[0]
                if job.kind == "batch":
                    assert self.batch_line is not None
                    record, failed = await self.batch_line(job.meta["endpoint"], name, payload)
                else:
                    record = {"index": idx, **await self._caption(model, job, name, media_id, settings)}
                    failed = "error" in record
                await asyncio.to_thread(self.jobs.finish_item, job_id, idx, record, failed=failed)
                await self._notify()

        while True:
            await asyncio.gather(*(worker() for _ in range(job.concurrency)))
            now = await asyncio.to_thread(self.jobs.get, job_id)
            if now is None or now.finished or job_id in self._cancelled:
                return
            if await asyncio.to_thread(self.jobs.claim_finalize, job_id, self.owner, self.lease_s):
                break
            if not await asyncio.to_thread(self.jobs.pending_count, job_id):
                return  # another replica finishes it (its watcher retries if that one dies)
            await asyncio.sleep(self.poll_s)  # others hold the rest: wait for them or their lease
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
