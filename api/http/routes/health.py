"""``/health`` (the process answers), ``/ready`` (models loaded), ``/metrics`` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from api.http.deps import Service, get_service

router = APIRouter(tags=["health"])


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready", responses={503: {"description": "models are still loading"}})
async def ready(request: Request) -> JSONResponse:
    service = getattr(request.app.state, "service", None)
    if service is None or not service.models.ready:
        return JSONResponse({"status": "loading"}, 503, headers={"Retry-After": "1"})
    return JSONResponse({"status": "ready", "models": [m.name for m in service.models]})


async def operator_only(request: Request) -> None:
    """``/metrics`` is the operator's: the app's check (``security.admin_only``) decides."""
    check = getattr(request.app.state, "operator_check", None)
    if check is not None:
        await check(request, None)


@router.get(
    "/metrics",
    response_class=Response,
    dependencies=[Depends(operator_only)],
    responses={401: {"description": "Missing or wrong API key"}, 403: {"description": "Needs an admin key"}},
)
async def metrics(service: Service = Depends(get_service)) -> Response:
    return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)
