"""Caption jobs over HTTP: ``POST /v1/jobs/captions`` (uploaded media ids, multipart files,
or a folder under ``--allowed-local-media-path``), ``GET /v1/jobs``, ``GET /v1/jobs/{id}``
(progress, rate, ETA), ``GET /v1/jobs/{id}/results`` (JSONL, streamed, following a running
job), ``POST /v1/jobs/{id}/cancel``. Items that fail are records; a job never fails for them."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from api.batch.file_source import expand_paths
from api.batch.records import error_dict, make_record
from api.http.deps import Service, get_service
from api.http.errors import ServiceError
from api.http.security.audit import audit
from api.http.security.tenancy import current_caller
from api.http.stores.jobs import JobRecord
from api.http.uploads import receive_multipart
from engine.caption import DEFAULT_PROMPT
from media import InvalidRequestError, PieMediaError

router = APIRouter(tags=["jobs"])

MAX_JOB_ITEMS = 100_000
WAKE_S = 1.0


class CaptionJobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str = Field(default=DEFAULT_PROMPT, min_length=1, max_length=8192)
    max_tokens: int = Field(default=64, ge=1)
    concurrency: int = Field(default=8, ge=1, le=256)
    media_ids: list[str] | None = Field(default=None, max_length=MAX_JOB_ITEMS)
    directory: str | None = None


class Job(BaseModel):
    id: str
    object: str = "job"
    status: str
    model: str
    prompt: str
    max_tokens: int
    concurrency: int
    total: int
    done: int
    failed: int
    created_at: float
    started_at: float | None
    finished_at: float | None
    rate: float | None = Field(description="items finished per second since the job started")
    eta_s: float | None
    error: str | None = None


class JobList(BaseModel):
    object: str = "list"
    data: list[Job]


def job_view(job: JobRecord) -> Job:
    finished = job.done + job.failed
    rate = eta = None
    if job.started_at is not None:
        elapsed = (job.finished_at or time.time()) - job.started_at
        rate = finished / elapsed if elapsed > 0 else None
        if rate and not job.finished:
            eta = (job.total - finished) / rate
    return Job(
        id=job.id,
        status=job.status,
        model=job.model,
        prompt=job.prompt,
        max_tokens=job.max_tokens,
        concurrency=job.concurrency,
        total=job.total,
        done=job.done,
        failed=job.failed,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        rate=rate,
        eta_s=eta,
        error=job.error,
    )


async def _ingest(
    service: Service, name: str, data: bytes, content_type: str | None, spool: Path | None = None
) -> tuple[str, str | None, dict[str, Any] | None]:
    """(name, media id, None), or (name, None, error record) for bytes that are no image."""
    try:
        image = await service.media.decode(data, "image")
    except PieMediaError as e:
        return name, None, e.to_dict()
    if spool is None:
        spool = service.store.spool_dir / f"job-{time.time_ns()}.part"
        await asyncio.to_thread(spool.write_bytes, data)
    record, _ = await asyncio.to_thread(
        functools.partial(
            service.store.put,
            spool,
            content_hash=image.content_hash,
            kind="image",
            size=len(data),
            filename=name,
            content_type=content_type,
            metadata=image.to_dict(),
            tenant=current_caller().tenant,
        )
    )
    return name, record.id, None


async def _items_from_json(service: Service, body: CaptionJobRequest) -> list[tuple[str, str | None, Any]]:
    if (body.media_ids is None) == (body.directory is None):
        raise InvalidRequestError(
            "give exactly one of media_ids or directory (or send multipart files)", param="media_ids"
        )
    if body.media_ids is not None:
        items = []
        for media_id in body.media_ids:
            record = await asyncio.to_thread(
                functools.partial(service.store.get, media_id, scope=current_caller().scope)
            )
            if record is None or record.kind != "image":
                what = "no uploaded media" if record is None else f"a {record.kind}, not an image:"
                code = "media_not_found" if record is None else "unsupported_media"
                items.append((media_id, None, {"code": code, "message": f"{what} {media_id}"}))
            else:
                items.append((record.filename or media_id, media_id, None))
        return items
    root = service.settings.allowed_local_media_path
    if root is None:
        raise InvalidRequestError(
            "directory jobs need the server's --allowed-local-media-path", param="directory"
        )
    folder = Path(body.directory or "").resolve()
    if not folder.is_relative_to(root.resolve()) or not folder.is_dir():
        raise InvalidRequestError(f"directory must be a folder under {root}", param="directory")
    files = await asyncio.to_thread(expand_paths, [folder])
    if len(files) > MAX_JOB_ITEMS:
        raise InvalidRequestError(
            f"{len(files)} files, over the limit of {MAX_JOB_ITEMS}", limit=MAX_JOB_ITEMS
        )
    items = []
    for f in files:
        name = str(f.relative_to(folder))
        try:
            if f.stat().st_size > service.media.limits.max_bytes:
                raise InvalidRequestError(f"{name}: larger than {service.media.limits.max_bytes} bytes")
            data = await asyncio.to_thread(f.read_bytes)
        except (OSError, PieMediaError) as e:
            items.append((name, None, error_dict(e)))
            continue
        items.append(await _ingest(service, name, data, None))
    return items


@router.post("/v1/jobs/captions", response_model=Job, responses=Service.error_responses(400, 401, 404, 413))
async def create_caption_job(request: Request, service: Service = Depends(get_service)) -> Job:
    if request.headers.get("content-type", "").startswith("multipart/"):
        s = service.settings
        form = await receive_multipart(
            request,
            service.store.spool_dir,
            max_file_bytes=s.max_upload_bytes,
            max_total_bytes=s.max_job_upload_bytes,
            max_files=s.max_job_upload_files,
        )
        try:
            try:
                body = CaptionJobRequest(**form.fields)  # pydantic parses the digits of the text fields
            except ValueError as e:
                raise InvalidRequestError(f"invalid job request: {e}") from None
            items = [
                await _ingest(
                    service,
                    f.filename or f"file-{i}",
                    await asyncio.to_thread(f.path.read_bytes),
                    f.content_type,
                    spool=f.path,
                )
                for i, f in enumerate(form.files)
            ]
        finally:
            form.cleanup()
    else:
        try:
            body = CaptionJobRequest(**json.loads(await request.body() or b"{}"))
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"invalid job request: {e}") from None
        items = await _items_from_json(service, body)
    chat = service.models.of_kind("chat")
    name = body.model or (chat[0].name if chat else "")
    service.models.get(name, kind="chat", adapters=False)
    if body.max_tokens > service.settings.max_tokens_limit:
        raise InvalidRequestError(
            f"max_tokens over this server's limit of {service.settings.max_tokens_limit}", param="max_tokens"
        )
    if not items:
        raise InvalidRequestError("the job has no items", param="media_ids")
    settings = {"model": name, "prompt": body.prompt, "max_tokens": body.max_tokens}
    job = await asyncio.to_thread(
        service.jobs.create,
        model=name,
        prompt=body.prompt,
        max_tokens=body.max_tokens,
        concurrency=body.concurrency,
        items=[
            (n, m, {"index": i, **make_record(n, settings, error=e)} if e is not None else None, None)
            for i, (n, m, e) in enumerate(items)
        ],
        tenant=current_caller().tenant,
    )
    audit("create", "caption_job", job.id)
    service.job_runner.start(job.id)
    return job_view(job)


async def _job(service: Service, job_id: str) -> JobRecord:
    job = await asyncio.to_thread(functools.partial(service.jobs.get, job_id, scope=current_caller().scope))
    if job is None:
        raise ServiceError("not_found", f"no job {job_id!r}", param="job_id")
    return job


@router.get("/v1/jobs", response_model=JobList, responses=Service.error_responses(401))
async def list_jobs(
    limit: int = Query(100, ge=1, le=1000), service: Service = Depends(get_service)
) -> JobList:
    jobs = await asyncio.to_thread(functools.partial(service.jobs.list, limit, scope=current_caller().scope))
    return JobList(data=[job_view(j) for j in jobs])


@router.get("/v1/jobs/{job_id}", response_model=Job, responses=Service.error_responses(401, 404))
async def get_job(job_id: str, service: Service = Depends(get_service)) -> Job:
    return job_view(await _job(service, job_id))


@router.post("/v1/jobs/{job_id}/cancel", response_model=Job, responses=Service.error_responses(401, 404))
async def cancel_job(job_id: str, service: Service = Depends(get_service)) -> Job:
    await _job(service, job_id)
    await service.job_runner.cancel(job_id)
    audit("cancel", "caption_job", job_id)
    return job_view(await _job(service, job_id))


@router.get(
    "/v1/jobs/{job_id}/results",
    responses={200: {"content": {"application/x-ndjson": {}}}, **Service.error_responses(401, 404)},
)
async def job_results(
    job_id: str,
    follow: bool = Query(True, description="keep the stream open until the job ends"),
    timeout: float = Query(3600, gt=0, le=86400, description="stop following after this many seconds"),
    service: Service = Depends(get_service),
) -> StreamingResponse:
    await _job(service, job_id)

    async def lines() -> AsyncIterator[bytes]:
        seen = 0
        deadline = time.monotonic() + timeout
        while True:
            version = service.job_runner.version
            job = await asyncio.to_thread(service.jobs.get, job_id)
            rows = await asyncio.to_thread(lambda after=seen: list(service.jobs.results(job_id, after)))
            for seq, record in rows:
                seen = seq
                yield (json.dumps(record, ensure_ascii=False) + "\n").encode()
            if job is None or job.finished or not follow or time.monotonic() > deadline:
                if rows:
                    continue  # drain what finished between the two reads
                return
            await service.job_runner.wait_for_change(version, WAKE_S)

    return StreamingResponse(lines(), media_type="application/x-ndjson")
