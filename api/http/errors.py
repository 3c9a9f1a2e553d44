"""One table from error codes to HTTP statuses, and the OpenAI error shape.

Every error any room raises on purpose is a ``PieMediaError`` with a stable ``code``;
this module is the only place that decides which status a code gets. A request error
is never a 500: an exception that is not a ``PieMediaError`` is a bug and is reported
as a 500 ``server_error`` without its text.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.http.disconnect import CLIENT_CLOSED_REQUEST, ClientDisconnected
from media import PieMediaError

log = logging.getLogger("pie_media.http")

# code -> HTTP status. Codes not listed fall back by class (see status_for).
STATUS_BY_CODE: dict[str, int] = {
    # media
    "too_large": 413,
    "too_long": 413,
    "unsupported_format": 415,
    "corrupt": 400,
    "empty": 400,
    "invalid_request": 400,
    # encoders / engine / speech: the request asks for something this model cannot do
    "unsupported_media": 400,
    "unsupported_model": 400,
    "text_too_long": 400,
    "context_length_exceeded": 400,
    "empty_text": 400,
    "unsupported_voice": 400,
    "unsupported_audio_format": 400,
    "invalid_max_duration": 400,
    "context_closed": 409,
    "invalid_grammar": 400,
    # inferlets: the upload is the caller's; a run that ends badly is its guest's doing
    "invalid_inferlet": 400,
    "inferlet_trap": 422,
    "inferlet_failed": 422,
    "inferlet_timeout": 422,
    "inferlet_limit": 422,
    "inferlet_bad_handle": 422,
    "inferlet_cancelled": 409,
    "grammar_unavailable": 501,
    "out_of_kv_pages": 503,
    # the service itself
    "too_many_media_items": 400,
    "model_not_found": 404,
    "media_not_found": 404,
    "not_found": 404,
    "queue_full": 429,
    "rate_limit_exceeded": 429,
    "too_many_streams": 429,
    "storage_limit_exceeded": 429,
    "admin_key_required": 403,
    "not_ready": 503,
    "invalid_api_key": 401,
    # remote media (a failed fetch is the caller's URL, not our outage: 4xx, no retry)
    "remote_media_forbidden": 400,
    "remote_media_timeout": 422,
    "remote_media_unreachable": 422,
    "remote_media_too_large": 413,
}

# Statuses the official client must not retry (it retries 408/409/429/5xx by default).
_NO_RETRY = {409, 503}


def status_for(err: PieMediaError) -> int:
    """The HTTP status of a typed error."""
    status = STATUS_BY_CODE.get(err.code)
    if status is not None:
        return status
    if isinstance(err, ValueError):  # InvalidRequestError, MediaError and their kin
        return 400
    return 500


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for a status."""
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(
    message: str, status: int, *, code: str | None, param: str | None = None, **extra: Any
) -> dict:
    """``{"error": {"message", "type", "param", "code", ...details}}``."""
    body: dict[str, Any] = {"message": message, "type": error_type(status), "param": param, "code": code}
    body.update({k: v for k, v in extra.items() if v is not None and k not in body})
    return {"error": body}


RECENT_DURATIONS = 32
"""How many finished requests' durations a Retry-After estimate looks at."""


def retry_after_estimate(started: Iterable[float], durations: Iterable[float], now: float) -> int:
    """Whole seconds (at least 1) until the first of the requests in flight (begun at
    ``started``, monotonic) is likely to end and free its slot: the median of the recent
    ``durations`` less each one's age. 1 when nothing has been measured yet, or when one has
    already run past the median (it may end any moment)."""
    recent = sorted(durations)
    ages = [now - s for s in started]
    if not recent or not ages:
        return 1
    typical = recent[len(recent) // 2]
    return max(1, round(min(max(0.0, typical - age) for age in ages)))


def retry_after_header(value: Any) -> str:
    """A Retry-After value as the header's whole seconds (at least 1)."""
    return str(max(1, math.ceil(float(value))))


class ServiceError(PieMediaError):
    """An error of the service itself (unknown model, queue full, ...); ``code`` per instance."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        retry_after: int | None = None,
        **details: Any,
    ):
        super().__init__(message, **details)
        self.code = code
        self.param = param
        self.retry_after = retry_after


def error_response(err: PieMediaError, *, param: str | None = None) -> JSONResponse:
    status = status_for(err)
    details = {k: v for k, v in err.details.items() if _jsonable(v) and k not in ("param", "code", "message")}
    param = param or getattr(err, "param", None) or err.details.get("param")
    headers: dict[str, str] = {}
    retry_after = getattr(err, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = retry_after_header(retry_after)
    if status in _NO_RETRY or (400 <= status < 500 and status != 429):
        headers["x-should-retry"] = "false"
    if status == 413:  # else the server keeps reading (and discarding) the rest of a refused upload
        headers["Connection"] = "close"
    return JSONResponse(
        error_body(err.message, status, code=err.code, param=param, **details), status, headers=headers
    )


def _jsonable(v: Any) -> bool:
    return isinstance(v, str | int | float | bool) or v is None


def install_error_handlers(app: FastAPI, on_error: Any = None) -> None:
    """Map typed errors, validation errors and HTTP exceptions to the OpenAI shape.
    ``on_error(code)`` is called for every typed error (metrics)."""

    @app.exception_handler(PieMediaError)
    async def _typed(request: Request, exc: PieMediaError) -> JSONResponse:
        if on_error is not None:
            on_error(exc.code)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        message = f"{'.'.join(loc) or 'request'}: {first.get('msg', 'invalid request')}"
        if on_error is not None:
            on_error("invalid_request")
        return JSONResponse(
            error_body(message, 400, code="invalid_request", param=".".join(loc) or None),
            400,
            headers={"x-should-retry": "false"},
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.detail, dict) and "error" in exc.detail:
            body = exc.detail
        else:
            code = {
                401: "invalid_api_key",
                404: "not_found",
                405: "method_not_allowed",
                413: "too_large",
            }.get(exc.status_code)
            body = error_body(str(exc.detail), exc.status_code, code=code)
        return JSONResponse(body, exc.status_code, headers=dict(exc.headers or {}))

    @app.exception_handler(ClientDisconnected)
    async def _left(request: Request, exc: ClientDisconnected) -> Response:
        log.info(
            "client left %s %s before its answer; the work was cancelled", request.method, request.url.path
        )
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error", 500, code="server_error"), 500)
