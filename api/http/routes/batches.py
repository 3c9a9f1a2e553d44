"""OpenAI's Batch API: ``POST /v1/batches`` (an uploaded JSONL of requests to one endpoint:
``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` or ``/v1/responses``), ``GET /v1/batches[/{id}]``,
``POST /v1/batches/{id}/cancel``.

A batch is a job of the job store (kind "batch"): each line an item, run through the
same code path as a request to its endpoint (``ENDPOINTS``), its result committed as it
finishes, resumed after a restart. When every line is done the output file (successes)
and the error file (failures) are written in OpenAI's batch output format.
"""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, ValidationError

from api.http.deps import Service, get_service
from api.http.errors import ServiceError, error_body, status_for
from api.http.routes.chat import complete_chat
from api.http.routes.completions import complete_text
from api.http.routes.embeddings import EmbeddingRequest, embed_request
from api.http.routes.files import get_file
from api.http.routes.responses import complete_response
from api.http.schemas.chat import ChatCompletionRequest
from api.http.schemas.completions import CompletionRequest
from api.http.schemas.responses import ResponsesRequest
from api.http.security.audit import audit
from api.http.security.tenancy import current_caller
from api.http.stores.jobs import JobRecord
from media import InvalidRequestError, PieMediaError

router = APIRouter(tags=["batches"])


@dataclass(frozen=True)
class Endpoint:
    """What a batch line to one endpoint is checked against, and the code that answers it
    (the route's own path, without an HTTP request or an admission slot)."""

    schema: type[BaseModel]
    answer: Callable[[Any, Service], Awaitable[BaseModel]]


async def _embed(body: EmbeddingRequest, service: Service) -> BaseModel:
    return await embed_request(body, service, admit=False)


ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": Endpoint(ChatCompletionRequest, complete_chat),
    "/v1/completions": Endpoint(CompletionRequest, complete_text),
    "/v1/embeddings": Endpoint(EmbeddingRequest, _embed),
    "/v1/responses": Endpoint(ResponsesRequest, complete_response),
}
EndpointPath = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
assert set(get_args(EndpointPath)) == set(ENDPOINTS)  # the schema's enum names every endpoint
MAX_LINES = 50_000
BATCH_CONCURRENCY = 8
_STATUS = {
    "queued": "validating",
    "running": "in_progress",
    "completed": "completed",
    "cancelled": "cancelled",
    "failed": "failed",
}


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: EndpointPath
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = None


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: Any = None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    completed_at: int | None = None
    cancelled_at: int | None = None
    failed_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    has_more: bool = False


def batch_view(job: JobRecord) -> Batch:
    m = job.meta
    status = _STATUS[job.status]
    if status == "completed" and not m.get("output_file_id") and not m.get("error_file_id"):
        status = "finalizing"
    done = int(job.finished_at) if job.finished_at else None
    return Batch(
        id=job.id,
        endpoint=m["endpoint"],
        input_file_id=m["input_file_id"],
        completion_window=m["completion_window"],
        status=status,
        output_file_id=m.get("output_file_id"),
        error_file_id=m.get("error_file_id"),
        created_at=int(job.created_at),
        in_progress_at=int(job.started_at) if job.started_at else None,
        expires_at=int(job.created_at) + 24 * 3600,
        completed_at=done if job.status == "completed" else None,
        cancelled_at=done if job.status == "cancelled" else None,
        failed_at=done if job.status == "failed" else None,
        request_counts=RequestCounts(total=job.total, completed=job.done, failed=job.failed),
        metadata=m.get("metadata"),
    )


def _line_error(custom_id: str, status: int, code: str, message: str) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": status,
            "request_id": f"req_{uuid.uuid4().hex}",
            "body": error_body(message, status, code=code),
        },
        "error": None,
    }


def _parse(data: bytes, endpoint: str) -> list[tuple[str, str | None, dict[str, Any] | None, str | None]]:
    """Items (custom_id, None, error record, request body JSON) of a batch input file whose
    lines must all go to ``endpoint`` (as OpenAI requires)."""
    schema = ENDPOINTS[endpoint].schema
    lines = [ln for ln in data.decode("utf-8", errors="replace").splitlines() if ln.strip()]
    if not lines:
        raise InvalidRequestError("the input file has no requests", param="input_file_id")
    if len(lines) > MAX_LINES:
        raise InvalidRequestError(f"{len(lines)} requests, over the limit of {MAX_LINES}", limit=MAX_LINES)
    items, seen = [], set()
    for n, line in enumerate(lines):
        req: Any = None
        try:
            req = json.loads(line)
            custom_id = str(req["custom_id"])
            if custom_id in seen:
                raise ValueError(f"duplicate custom_id {custom_id!r}")
            seen.add(custom_id)
            if req.get("url") != endpoint or req.get("method", "POST") != "POST":
                raise ValueError(f"url must be the batch's endpoint {endpoint} with method POST")
            schema(**req["body"])
        except (ValueError, KeyError, TypeError, ValidationError) as e:
            custom_id = (
                str(req.get("custom_id", f"line-{n + 1}")) if isinstance(req, dict) else f"line-{n + 1}"
            )
            items.append(
                (custom_id, None, _line_error(custom_id, 400, "invalid_request", f"line {n + 1}: {e}"), None)
            )
            continue
        items.append((custom_id, None, None, json.dumps(req["body"])))
    return items


async def run_line(
    service: Service, endpoint: str, custom_id: str, payload: str | None
) -> tuple[dict[str, Any], bool]:
    """One batch line through its endpoint's code path: (output record, failed)."""
    route = ENDPOINTS[endpoint]
    try:
        body = route.schema(**json.loads(payload or "{}"))
        if getattr(body, "stream", False):
            raise InvalidRequestError("stream is not supported in a batch", param="stream")
        answer = await route.answer(body, service)
    except PieMediaError as e:
        return _line_error(custom_id, status_for(e), e.code, e.message), True
    except ValidationError as e:
        return _line_error(custom_id, 400, "invalid_request", str(e)), True
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": 200,
            "request_id": f"req_{uuid.uuid4().hex}",
            "body": answer.model_dump(),
        },
        "error": None,
    }, False


async def write_outputs(service: Service, job_id: str) -> None:
    """The output file (successful lines) and the error file (failed lines) of a batch."""
    job = await asyncio.to_thread(service.jobs.get, job_id)
    if job is None or job.meta.get("output_file_id") or job.meta.get("error_file_id"):
        return
    ok, bad = [], []
    for _seq, rec in await asyncio.to_thread(lambda: list(service.jobs.results(job_id))):
        (ok if rec["response"] and rec["response"]["status_code"] == 200 else bad).append(
            json.dumps(rec) + "\n"
        )
    ids: dict[str, str] = {}
    for key, lines in (("output_file_id", ok), ("error_file_id", bad)):
        if lines:
            rec = await asyncio.to_thread(
                functools.partial(
                    service.files.add,
                    "".join(lines).encode(),
                    filename=f"{job_id}_{key.split('_')[0]}.jsonl",
                    purpose="batch_output",
                    tenant=job.tenant,  # the batch's creator owns its outputs
                )
            )
            ids[key] = rec.id
    await asyncio.to_thread(service.jobs.update_meta, job_id, **ids)


@router.post("/v1/batches", response_model=Batch, responses=Service.error_responses(400, 401, 404))
async def create_batch(body: BatchCreate, service: Service = Depends(get_service)) -> Batch:
    record = await get_file(service, body.input_file_id)
    if record.purpose != "batch":
        raise InvalidRequestError(
            f"file {record.id} has purpose {record.purpose!r}, not 'batch'", param="input_file_id"
        )
    path = service.files.path(record.id)
    assert path is not None
    items = _parse(await asyncio.to_thread(path.read_bytes), body.endpoint)
    models = {json.loads(p)["model"] for _, _, e, p in items if p}
    for name in models:
        service.models.get(name, kind="chat")  # an unknown model fails the batch at creation
    meta = {
        "endpoint": body.endpoint,
        "input_file_id": body.input_file_id,
        "completion_window": body.completion_window,
        "metadata": body.metadata,
    }
    job = await asyncio.to_thread(
        service.jobs.create,
        model=",".join(sorted(models)),
        prompt="",
        max_tokens=0,
        concurrency=BATCH_CONCURRENCY,
        items=items,
        kind="batch",
        meta=meta,
        prefix="batch_",
        tenant=current_caller().tenant,
    )
    audit("create", "batch", job.id)
    service.job_runner.start(job.id)
    return batch_view(job)


async def _batch(service: Service, batch_id: str) -> JobRecord:
    job = await asyncio.to_thread(functools.partial(service.jobs.get, batch_id, scope=current_caller().scope))
    if job is None or job.kind != "batch":
        raise ServiceError("not_found", f"no batch {batch_id!r}", param="batch_id")
    return job


@router.get("/v1/batches", response_model=BatchList, responses=Service.error_responses(401))
async def list_batches(
    limit: int = Query(20, ge=1, le=100), service: Service = Depends(get_service)
) -> BatchList:
    jobs = await asyncio.to_thread(
        functools.partial(service.jobs.list, limit, "batch", scope=current_caller().scope)
    )
    return BatchList(data=[batch_view(j) for j in jobs])


@router.get("/v1/batches/{batch_id}", response_model=Batch, responses=Service.error_responses(401, 404))
async def retrieve_batch(batch_id: str, service: Service = Depends(get_service)) -> Batch:
    return batch_view(await _batch(service, batch_id))


@router.post(
    "/v1/batches/{batch_id}/cancel", response_model=Batch, responses=Service.error_responses(401, 404)
)
async def cancel_batch(batch_id: str, service: Service = Depends(get_service)) -> Batch:
    await _batch(service, batch_id)
    await service.job_runner.cancel(batch_id)
    audit("cancel", "batch", batch_id)
    await write_outputs(service, batch_id)
    return batch_view(await _batch(service, batch_id))
