"""The WebSocket at ``/`` on ``pie-media serve``'s port, where Pie's client
(``pie-client==0.4.0``: ``PieClient("ws://HOST:PORT")``) connects. HTTP ``GET /`` is
another route (the page's redirect) and answers as before: the two match by scope type.

The app's protocol state (the process hub over the run table, the program index, the
daemons) is made on the first connection and kept on ``app.state.pie_protocol``."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import APIRouter, WebSocket

from api.http.pie_protocol.daemons import DaemonTable
from api.http.pie_protocol.processes import ProcessHub
from api.http.pie_protocol.programs import ProgramStore
from api.http.pie_protocol.session import Session

router = APIRouter()


@dataclass
class PieProtocol:
    hub: ProcessHub
    programs: ProgramStore
    daemons: DaemonTable


def protocol_state(app: object) -> PieProtocol:
    state = app.state  # type: ignore[attr-defined]
    found = getattr(state, "pie_protocol", None)
    if found is None:
        service = state.service
        found = PieProtocol(
            hub=ProcessHub(service.inferlet_runs),
            programs=ProgramStore(service.settings.state_dir / "pie_programs"),
            daemons=DaemonTable(),
        )
        state.pie_protocol = found
    return found


@router.websocket("/")
async def pie_protocol(websocket: WebSocket) -> None:
    app = websocket.app
    service = app.state.service
    proto = protocol_state(app)
    settings = service.settings
    await Session(
        websocket,
        service=service,
        keys=app.state.keys,
        hub=proto.hub,
        programs=proto.programs,
        daemons=proto.daemons,
        auth_timeout_s=settings.pie_auth_timeout_s,
        upload_timeout_s=settings.pie_upload_timeout_s,
    ).serve()
