"""The service object every route depends on (settings, models, store, media, metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from api.http.media_refs import MediaResolver
from api.http.metrics import ServiceMetrics
from api.http.registry import ModelRegistry
from api.http.runs.inferlets import RunTable
from api.http.runs.jobs import JobRunner
from api.http.schemas.chat import ErrorResponse
from api.http.security.key_limits import KeyLimiter
from api.http.settings import ServeSettings
from api.http.stores.files import FileStore
from api.http.stores.inferlets import InferletStore
from api.http.stores.jobs import JobStore
from api.http.stores.responses import ResponseStore
from api.http.stores.uploads import MediaStore
from api.http.uploads import ReceivedForm, receive_multipart

_STATUS_TEXT = {
    400: "Invalid request (bad parameters, corrupt or empty media, too many media items)",
    401: "Missing or wrong API key",
    404: "Unknown model or media id",
    413: "Media or upload over a size/duration limit",
    415: "Unsupported media format",
    408: "The request took too long",
    409: "Conflicts with the resource's state (e.g. a cancelled inferlet run)",
    422: "Remote media could not be fetched, or an inferlet run failed (trap, limit, timeout)",
    429: "The model is at its concurrency limit, or the key at one of its limits; retry after Retry-After seconds",
    503: "Models not loaded yet, or the KV pool is full",
}


@dataclass
class Service:
    settings: ServeSettings
    models: ModelRegistry
    store: MediaStore
    media: MediaResolver
    metrics: ServiceMetrics
    jobs: JobStore
    job_runner: JobRunner
    files: FileStore
    responses: ResponseStore
    inferlet_store: InferletStore
    inferlet_runs: RunTable
    inferlets: Any = None
    """The ``inferlets.InferletRuntime`` over the served models (set once they are loaded)."""
    key_limits: KeyLimiter = field(default_factory=KeyLimiter)
    """Per-key request, token, stream and storage limits (``api.http.security.key_limits``)."""

    @staticmethod
    def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
        """OpenAPI entries for the error statuses a route can answer."""
        return {s: {"model": ErrorResponse, "description": _STATUS_TEXT[s]} for s in statuses}


async def get_service(request: Request) -> Service:
    """The app's ``Service`` (async: FastAPI runs a plain ``def`` dependency on its thread
    pool, a thread hop on every request for an attribute read)."""
    return request.app.state.service


def multipart_body(**fields: str) -> dict[str, Any]:
    """OpenAPI for a multipart body of repeatable ``file`` parts plus text ``fields``
    (name -> JSON type): the routes read the stream themselves, so FastAPI cannot infer it."""
    properties: dict[str, Any] = {"file": {"type": "array", "items": {"type": "string", "format": "binary"}}}
    properties.update({name: {"type": kind} for name, kind in fields.items()})
    return {
        "requestBody": {
            "content": {"multipart/form-data": {"schema": {"type": "object", "properties": properties}}},
            "required": True,
        }
    }


async def receive_upload(request: Request, service: Service) -> ReceivedForm:
    """A request's multipart body spooled under the store, within the upload caps."""
    s = service.settings
    return await receive_multipart(
        request,
        service.store.spool_dir,
        max_file_bytes=s.max_upload_bytes,
        max_total_bytes=s.max_upload_bytes * s.max_upload_files,
        max_files=s.max_upload_files,
    )
