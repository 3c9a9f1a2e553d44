"""OpenAI's Files API, as far as batches need it: ``POST /v1/files`` (multipart ``file`` +
``purpose``), ``GET /v1/files``, ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``,
``DELETE /v1/files/{id}``."""

from __future__ import annotations

import asyncio
import functools
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel

from api.http.deps import Service, get_service
from api.http.errors import ServiceError
from api.http.routes.media import storage_room
from api.http.security.audit import audit
from api.http.security.tenancy import current_caller
from api.http.stores.files import FileRecord
from api.http.uploads import receive_multipart
from media import InvalidRequestError

router = APIRouter(tags=["files"])

PURPOSES = ("batch", "batch_output", "user_data")


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


def file_object(r: FileRecord) -> FileObject:
    return FileObject(
        id=r.id, bytes=r.bytes, created_at=int(r.created_at), filename=r.filename, purpose=r.purpose
    )


async def get_file(service: Service, file_id: str) -> FileRecord:
    record = await asyncio.to_thread(
        functools.partial(service.files.get, file_id, scope=current_caller().scope)
    )
    if record is None:
        raise ServiceError("not_found", f"no file {file_id!r}", param="file_id")
    return record


@router.post("/v1/files", response_model=FileObject, responses=Service.error_responses(400, 401, 413))
async def upload_file(request: Request, service: Service = Depends(get_service)) -> FileObject:
    s = service.settings
    form = await receive_multipart(
        request,
        service.store.spool_dir,
        max_file_bytes=s.max_batch_file_bytes,
        max_total_bytes=s.max_batch_file_bytes,
        max_files=1,
    )
    try:
        purpose = form.fields.get("purpose", "")
        if purpose not in PURPOSES:
            raise InvalidRequestError(
                f"purpose must be one of {', '.join(PURPOSES)}, got {purpose!r}", param="purpose"
            )
        f = form.files[0]
        await storage_room(service, f.size)
        record = await asyncio.to_thread(
            functools.partial(
                service.files.add,
                f.path,
                filename=f.filename or "upload",
                purpose=purpose,
                tenant=current_caller().tenant,
            )
        )
    finally:
        form.cleanup()
    audit("create", "file", record.id)
    return file_object(record)


@router.get("/v1/files", response_model=FileList, responses=Service.error_responses(401))
async def list_files(
    limit: int = Query(10_000, ge=1, le=10_000),
    after: str | None = Query(None, max_length=64, description="the last id of the previous page"),
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = Query(None, max_length=32),
    service: Service = Depends(get_service),
) -> FileList:
    records, more = await asyncio.to_thread(
        functools.partial(
            service.files.list, limit, scope=current_caller().scope, after=after, order=order, purpose=purpose
        )
    )
    data = [file_object(r) for r in records]
    return FileList(
        data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None, has_more=more
    )


@router.get("/v1/files/{file_id}", response_model=FileObject, responses=Service.error_responses(401, 404))
async def retrieve_file(file_id: str, service: Service = Depends(get_service)) -> FileObject:
    return file_object(await get_file(service, file_id))


@router.get(
    "/v1/files/{file_id}/content",
    responses={200: {"content": {"application/octet-stream": {}}}, **Service.error_responses(401, 404)},
)
async def file_content(file_id: str, service: Service = Depends(get_service)) -> FileResponse:
    record = await get_file(service, file_id)
    path = service.files.path(record.id)
    assert path is not None
    return FileResponse(path, media_type="application/octet-stream", filename=record.filename)


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, responses=Service.error_responses(401, 404))
async def delete_file(file_id: str, service: Service = Depends(get_service)) -> FileDeleted:
    if not await asyncio.to_thread(
        functools.partial(service.files.delete, file_id, scope=current_caller().scope)
    ):
        raise ServiceError("not_found", f"no file {file_id!r}", param="file_id")
    audit("delete", "file", file_id)
    return FileDeleted(id=file_id, deleted=True)
