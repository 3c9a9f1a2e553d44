"""``/v1/media``: upload (multipart, streamed to disk under a byte cap), look up, delete.

An upload is decoded and validated by ``media`` once; the file and its metadata are
kept in the store (same bytes -> same id) and survive restarts. Each file's answer
includes the tokens every loaded chat model would spend on it.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from api.http.deps import Service, get_service, multipart_body, receive_upload
from api.http.errors import ServiceError, error_body, status_for
from api.http.schemas.chat import MediaDeleted, MediaObject, MediaUploadResponse, MediaUploadResult
from api.http.security.audit import audit
from api.http.security.key_limits import check_storage
from api.http.security.tenancy import current_caller
from encoders import UnsupportedMediaKindError
from media import PieMediaError, open_media

router = APIRouter(tags=["media"])


def media_object(record: Any) -> MediaObject:
    meta = dict(record.metadata)
    token_counts = meta.pop("token_counts", {})
    return MediaObject(
        id=record.id,
        kind=record.kind,
        filename=record.filename,
        content_type=record.content_type,
        bytes=record.size,
        content_hash=record.content_hash,
        created_at=int(record.created_at),
        metadata=meta,
        token_counts=token_counts,
    )


async def storage_room(service: Service, adding: int) -> None:
    """429 when ``adding`` bytes would pass the caller's stored-bytes limit (uploads and
    files of its tenant together)."""
    caller = current_caller()
    if caller.limits.max_stored_bytes is None:
        return
    used = await asyncio.to_thread(service.store.stored_bytes, caller.tenant)
    used += await asyncio.to_thread(service.files.stored_bytes, caller.tenant)
    check_storage(caller, used, adding)


def token_counts(service: Service, media: Any) -> dict[str, int | None]:
    """Tokens each loaded chat model spends on ``media`` (None: it cannot take this kind)."""
    out: dict[str, int | None] = {}
    for served in service.models.of_kind("chat"):
        try:
            out[served.name] = served.model.prepare(media).token_count
        except UnsupportedMediaKindError:
            out[served.name] = None
    return out


async def ingest(service: Service, spooled: Any) -> MediaObject:
    """Decode, validate, count and store one spooled upload (the spool file is consumed)."""
    await storage_room(service, spooled.size)
    data = await asyncio.to_thread(spooled.path.read_bytes)
    media = await asyncio.to_thread(open_media, data, service.media.limits)
    counts = await asyncio.to_thread(token_counts, service, media)
    metadata = {**media.to_dict(), "token_counts": counts}
    record, _created = await asyncio.to_thread(
        service.store.put,
        spooled.path,
        content_hash=media.content_hash,
        kind=media.kind,
        size=spooled.size,
        filename=spooled.filename,
        content_type=spooled.content_type,
        metadata=metadata,
        tenant=current_caller().tenant,
    )
    if _created:
        audit("create", "media", record.id)
    return media_object(record)


@router.post(
    "/v1/media",
    response_model=MediaUploadResponse,
    responses=Service.error_responses(400, 401, 413, 415),
    openapi_extra=multipart_body(),
)
async def upload_media(request: Request, service: Service = Depends(get_service)):
    form = await receive_upload(request, service)
    results: list[MediaUploadResult] = []
    first_error: PieMediaError | None = None
    try:
        for f in form.files:
            try:
                results.append(MediaUploadResult(filename=f.filename, media=await ingest(service, f)))
            except PieMediaError as e:
                service.metrics.media_errors.labels(e.code).inc()
                first_error = first_error or e
                results.append(MediaUploadResult(filename=f.filename, error=e.to_dict()))
    finally:
        form.cleanup()
    if first_error is not None:
        # The stored files are not lost: their ids come back beside the error.
        status = status_for(first_error)
        body = error_body(f"{first_error.message}", status, code=first_error.code, param="file")
        body["data"] = [r.model_dump() for r in results]
        retry_after = getattr(first_error, "retry_after", None)
        headers = {"Retry-After": str(retry_after)} if retry_after else {"x-should-retry": "false"}
        return JSONResponse(body, status, headers=headers)
    return MediaUploadResponse(data=results)


@router.get("/v1/media/{media_id}", response_model=MediaObject, responses=Service.error_responses(401, 404))
async def get_media(media_id: str, service: Service = Depends(get_service)) -> MediaObject:
    record = await asyncio.to_thread(
        functools.partial(service.store.get, media_id, scope=current_caller().scope)
    )
    if record is None:
        raise ServiceError("media_not_found", f"no uploaded media with id {media_id!r}", param="media_id")
    return media_object(record)


@router.delete(
    "/v1/media/{media_id}", response_model=MediaDeleted, responses=Service.error_responses(401, 404)
)
async def delete_media(media_id: str, service: Service = Depends(get_service)) -> MediaDeleted:
    if not await asyncio.to_thread(
        functools.partial(service.store.delete, media_id, scope=current_caller().scope)
    ):
        raise ServiceError("media_not_found", f"no uploaded media with id {media_id!r}", param="media_id")
    audit("delete", "media", media_id)
    return MediaDeleted(id=media_id, deleted=True)
