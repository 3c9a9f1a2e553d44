"""``/v1/inferlets``: upload a WebAssembly inferlet once, launch runs of it, stream what
they send, talk to them, cancel them.

* ``POST /v1/inferlets``: the component as the raw body (``application/wasm``) or a
  multipart ``file``; stored by content hash (the same bytes give the same id) and
  compiled now, so a file that is not a component is a 400 here, not at launch.
* ``GET /v1/inferlets``, ``GET|DELETE /v1/inferlets/{id}``; ``GET /v1/inferlets/runs``: the
  runs kept, HTTP's and those launched over Pie's protocol (``api/http/pie_protocol``).
* ``POST /v1/inferlets/{id}/runs`` ``{args, stream, background, messages, close_input,
  limits}``: whole (the run object when it ends; a failed run is its typed error),
  streamed (SSE: ``run``, then one ``send`` per message, then ``result`` or ``error``), or
  in the background (202, poll the run).
* ``GET /v1/inferlets/{id}/runs/{run_id}``, ``POST .../runs/{run_id}/cancel``,
  ``POST .../runs/{run_id}/messages`` (``{"text": ...}`` for ``receive()``; null closes).

A client that goes away cancels the run it was waiting on or streaming: its contexts close
and their pages return. The engine work is the inferlet host's (``inferlets``)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from api.http.deps import Service, get_service
from api.http.disconnect import ClientDisconnected, cancel_on_disconnect
from api.http.errors import ServiceError
from api.http.runs.inferlets import RunRecord
from api.http.schemas.inferlets import (
    InferletDeleted,
    InferletList,
    InferletObject,
    MessageRequest,
    RunList,
    RunObject,
    RunRequest,
)
from api.http.security.audit import audit
from api.http.security.tenancy import current_caller
from api.http.stores.inferlets import InferletRecord
from api.http.uploads import receive_multipart
from inferlets import RunLimits

router = APIRouter(tags=["inferlets"])


def _object(r: InferletRecord) -> InferletObject:
    return InferletObject(id=r.id, bytes=r.bytes, created_at=r.created_at, sha256=r.sha256)


def _runtime(service: Service):
    if service.inferlets is None:
        raise ServiceError("not_ready", "the inferlet host starts with the models; retry shortly")
    return service.inferlets


def _inferlet(service: Service, inferlet_id: str) -> tuple[InferletRecord, Path]:
    scope = current_caller().scope
    rec = service.inferlet_store.get(inferlet_id, scope=scope)
    path = service.inferlet_store.path(inferlet_id, scope=scope)
    if rec is None or path is None:
        raise ServiceError("not_found", f"no inferlet {inferlet_id!r}", param="inferlet_id")
    return rec, path


def _run(service: Service, inferlet_id: str, run_id: str) -> RunRecord:
    rec = service.inferlet_runs.get(run_id, scope=current_caller().scope)
    if rec is None or rec.inferlet_id != inferlet_id:
        raise ServiceError("not_found", f"no run {run_id!r} of inferlet {inferlet_id!r}", param="run_id")
    return rec


async def _spool_body(request: Request, spool: Path, limit: int) -> Path:
    """The raw request body in a spool file, refused (413) past ``limit`` bytes."""
    path = spool / f"inferlet-{uuid.uuid4().hex}.part"
    size = 0
    try:
        with path.open("wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ServiceError(
                        "too_large", f"the component is over {limit} bytes", limit=limit, param="body"
                    )
                f.write(chunk)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    if size == 0:
        path.unlink(missing_ok=True)
        raise ServiceError("empty", "no component in the request body", param="body")
    return path


@router.post(
    "/v1/inferlets",
    response_model=InferletObject,
    responses={
        200: {"content": {"application/json": {}}},
        **Service.error_responses(400, 401, 413, 503),
    },
    openapi_extra={
        "requestBody": {
            "content": {
                "application/wasm": {"schema": {"type": "string", "format": "binary"}},
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "properties": {"file": {"type": "string", "format": "binary"}},
                    }
                },
            }
        }
    },
)
async def upload_inferlet(request: Request, service: Service = Depends(get_service)) -> InferletObject:
    runtime = _runtime(service)
    limit = service.settings.max_inferlet_bytes
    spool = service.store.spool_dir
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        form = await receive_multipart(
            request, spool, max_file_bytes=limit, max_total_bytes=limit, max_files=1
        )
        try:
            path = form.claim(form.files[0])
        finally:
            form.cleanup()
    else:
        path = await _spool_body(request, spool, limit)
    try:
        record, new = await asyncio.to_thread(
            functools.partial(service.inferlet_store.add, path, tenant=current_caller().tenant)
        )
    finally:
        path.unlink(missing_ok=True)
    stored = service.inferlet_store.path(record.id)
    assert stored is not None
    try:
        await asyncio.to_thread(runtime.component, stored)  # compiled once, cached on disk
    except BaseException:
        if new:
            service.inferlet_store.delete(record.id)
        raise
    audit("create", "inferlet", record.id)
    return _object(record)


@router.get("/v1/inferlets/runs", response_model=RunList, responses=Service.error_responses(401))
async def list_runs(service: Service = Depends(get_service)) -> RunList:
    """Every run the server keeps (running, and the newest finished), whoever launched it
    (HTTP or Pie's protocol), oldest first; a user key sees its tenant's."""
    return RunList(data=[RunObject.of(r) for r in service.inferlet_runs.list(scope=current_caller().scope)])


@router.get("/v1/inferlets", response_model=InferletList, responses=Service.error_responses(401))
async def list_inferlets(service: Service = Depends(get_service)) -> InferletList:
    records = await asyncio.to_thread(
        functools.partial(service.inferlet_store.list, scope=current_caller().scope)
    )
    return InferletList(data=[_object(r) for r in records])


@router.get(
    "/v1/inferlets/{inferlet_id}", response_model=InferletObject, responses=Service.error_responses(401, 404)
)
async def get_inferlet(inferlet_id: str, service: Service = Depends(get_service)) -> InferletObject:
    return _object(_inferlet(service, inferlet_id)[0])


@router.delete(
    "/v1/inferlets/{inferlet_id}", response_model=InferletDeleted, responses=Service.error_responses(401, 404)
)
async def delete_inferlet(inferlet_id: str, service: Service = Depends(get_service)) -> InferletDeleted:
    _inferlet(service, inferlet_id)
    deleted = service.inferlet_store.delete(inferlet_id, scope=current_caller().scope)
    audit("delete", "inferlet", inferlet_id)
    return InferletDeleted(id=inferlet_id, deleted=deleted)


def _limits(base: RunLimits, body: RunRequest) -> RunLimits:
    if body.limits is None:
        return base
    asked = body.limits.model_dump(exclude_none=True)
    return dataclasses.replace(base, **{k: min(v, getattr(base, k)) for k, v in asked.items()})


def _raise_for(rec: RunRecord) -> None:
    """A run that did not succeed, as its typed error (status from the errors table)."""
    error = dict(rec.error or {"code": "inferlet_failed", "message": "the run failed"})
    code, message = error.pop("code"), error.pop("message", "")
    raise ServiceError(code, message, run_id=rec.id, **{k: v for k, v in error.items() if k != "param"})


def _args(runtime: Any, path: Any, body: RunRequest) -> list[str]:
    """A Pie-world component's one argument is its input JSON (``input``, or ``args[0]``);
    a ``pie:media`` component takes ``args``."""
    if not runtime.is_pie_world(path):
        if body.input is not None:
            raise ServiceError(
                "invalid_request", "input is for Pie-world components; this one takes args", param="input"
            )
        return body.args
    if body.input is not None and body.args:
        raise ServiceError("invalid_request", "give input or args, not both", param="input")
    if body.input is not None:
        return [json.dumps(body.input)]
    if len(body.args) > 1:
        raise ServiceError(
            "invalid_request",
            "a Pie-world component takes one argument: its input JSON (or use input)",
            param="args",
        )
    return body.args or ["{}"]


@router.post(
    "/v1/inferlets/{inferlet_id}/runs",
    response_model=RunObject,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "the run, or SSE events when stream=true"},
        202: {"model": RunObject, "description": "background=true: the run, still running"},
        **Service.error_responses(400, 401, 404, 422, 429, 503),
    },
)
async def start_run(
    inferlet_id: str, body: RunRequest, request: Request, service: Service = Depends(get_service)
):
    runtime = _runtime(service)
    _, path = _inferlet(service, inferlet_id)
    args = _args(runtime, path, body)
    if sum(len(a.encode()) for a in args) > runtime.limits.max_text_bytes:
        raise ServiceError(
            "invalid_request",
            f"args are over {runtime.limits.max_text_bytes} bytes",
            param="args",
            limit=runtime.limits.max_text_bytes,
        )
    caller = current_caller()
    # a stream slot held while the run goes, its tokens charged when it ends (the middleware
    # counted the request)
    admitted = service.key_limits.admit_run(caller, count_request=False)
    try:
        rec = service.inferlet_runs.start(
            runtime,
            inferlet_id,
            path,
            args,
            _limits(runtime.limits, body),
            body.messages,
            body.close_input,
            tenant=caller.tenant,
        )
    except BaseException:
        admitted(0)
        raise
    assert rec.task is not None
    rec.task.add_done_callback(lambda _t: admitted(rec.control.tokens_used))
    audit("create", "inferlet_run", rec.id, inferlet=inferlet_id)
    if body.background:
        return JSONResponse(RunObject.of(rec).model_dump(), status_code=202)
    if body.stream:
        return StreamingResponse(
            _events(service, rec),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    assert rec.task is not None
    try:
        await cancel_on_disconnect(request, asyncio.shield(rec.task))
    except (asyncio.CancelledError, ClientDisconnected):  # the client left, or shutdown
        service.inferlet_runs.cancel(rec)
        raise
    if rec.status != "succeeded":
        _raise_for(rec)
    return RunObject.of(rec)


def _sse(event: str, data: object) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


async def _events(service: Service, rec: RunRecord) -> AsyncIterator[str]:
    try:
        yield _sse("run", RunObject.of(rec).model_dump())
        while True:
            kind, text = await rec.events.get()
            if kind == "send":
                yield _sse("send", {"text": text})
                continue
            if rec.status == "succeeded":
                yield _sse("result", {"result": rec.result})
            else:
                yield _sse("error", {"error": rec.error, "status": rec.status})
            return
    finally:  # the client left (or the run ended): a running run stops
        if not rec.done:
            service.inferlet_runs.cancel(rec)


@router.get(
    "/v1/inferlets/{inferlet_id}/runs/{run_id}",
    response_model=RunObject,
    responses=Service.error_responses(401, 404),
)
async def get_run(inferlet_id: str, run_id: str, service: Service = Depends(get_service)) -> RunObject:
    return RunObject.of(_run(service, inferlet_id, run_id))


@router.post(
    "/v1/inferlets/{inferlet_id}/runs/{run_id}/cancel",
    response_model=RunObject,
    responses=Service.error_responses(401, 404),
)
async def cancel_run(inferlet_id: str, run_id: str, service: Service = Depends(get_service)) -> RunObject:
    """Stop the run and wait (briefly) for it to end; a finished run is returned as is."""
    rec = _run(service, inferlet_id, run_id)
    if not rec.done and rec.task is not None:
        service.inferlet_runs.cancel(rec)
        audit("cancel", "inferlet_run", rec.id)
        await asyncio.wait([rec.task], timeout=10)
    return RunObject.of(rec)


@router.post(
    "/v1/inferlets/{inferlet_id}/runs/{run_id}/messages",
    response_model=RunObject,
    responses=Service.error_responses(400, 401, 404),
)
async def post_message(
    inferlet_id: str, run_id: str, body: MessageRequest, service: Service = Depends(get_service)
) -> RunObject:
    rec = _run(service, inferlet_id, run_id)
    if rec.done:
        raise ServiceError("invalid_request", f"run {run_id!r} has ended ({rec.status})", param="run_id")
    if body.text is None:
        rec.control.close_input()
    else:
        rec.control.post(body.text)
    return RunObject.of(rec)
