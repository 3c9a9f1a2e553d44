"""``/v1/pie/daemons``: the daemons a tenant launched with Pie's ``launch_daemon``
(``api/http/pie_protocol/daemons.py``), which Pie's protocol can neither list nor stop.

* ``GET /v1/pie/daemons``: the caller's tenant's daemons (port, program, requests served).
* ``DELETE /v1/pie/daemons/{port}``: stop one; its port is free again (a request in flight
  ends with it). Another tenant's daemon is a 404, as one that is not there.
"""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from api.http.deps import Service, get_service
from api.http.errors import ServiceError
from api.http.pie_protocol.daemons import Daemon
from api.http.pie_protocol.route import protocol_state
from api.http.security.audit import audit
from api.http.security.tenancy import current_caller

router = APIRouter(tags=["pie programs"])


class PieDaemonObject(BaseModel):
    id: str
    """``daemon-<port>``."""
    object: Literal["pie.daemon"] = "pie.daemon"
    port: int
    """It serves http://127.0.0.1:<port>/."""
    program: str
    """``name@version``, as launched."""
    requests: int
    """Requests it has taken (each with a fresh instance)."""
    in_flight: int
    """Requests being answered now."""
    created_at: int


class PieDaemonList(BaseModel):
    object: Literal["list"] = "list"
    data: list[PieDaemonObject]


class PieDaemonStopped(BaseModel):
    id: str
    object: Literal["pie.daemon"] = "pie.daemon"
    deleted: bool = True


def _object(d: Daemon) -> PieDaemonObject:
    return PieDaemonObject(
        id=f"daemon-{d.port}",
        port=d.port,
        program=d.program,
        requests=d.requests,
        in_flight=d.in_flight,
        created_at=int(d.started),
    )


@router.get("/v1/pie/daemons", response_model=PieDaemonList, responses=Service.error_responses(401))
async def list_daemons(request: Request, service: Service = Depends(get_service)) -> PieDaemonList:
    daemons = protocol_state(request.app).daemons
    return PieDaemonList(data=[_object(d) for d in daemons.of_tenant(current_caller().tenant)])


@router.delete(
    "/v1/pie/daemons/{port}", response_model=PieDaemonStopped, responses=Service.error_responses(401, 404)
)
async def stop_daemon(
    port: int, request: Request, service: Service = Depends(get_service)
) -> PieDaemonStopped:
    daemons = protocol_state(request.app).daemons
    stopped = await asyncio.to_thread(daemons.stop, port, current_caller().tenant)
    if stopped is None:
        raise ServiceError("not_found", f"no daemon of yours serves port {port}", param="port")
    audit("delete", "inferlet_daemon", f"port-{port}", program=stopped.program)
    return PieDaemonStopped(id=f"daemon-{port}")
