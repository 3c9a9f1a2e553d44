"""``/v1/pie/programs``: Pie programs (``name@version``: a component and its ``Pie.toml``)
over HTTP, for the page at /ui and for scripts, beside Pie's WebSocket protocol
(``api/http/pie_protocol``). Both doors share one program index and one process model:
a program installed here is the one ``pie-client`` launches, and the reverse; a run
launched here is a process ``pie-client`` can attach to, listed and cancelled under
``/v1/inferlets/runs``.

* ``GET /v1/pie/programs``: the caller's programs (tenant's own), each with its manifest's
  description and ``[parameters]`` (name, type, optional, description).
* ``POST /v1/pie/programs``: multipart, the component in ``file`` and the ``Pie.toml`` text
  in ``manifest`` (or as a second ``file`` part named ``*.toml``); ``force_overwrite=true``
  replaces a program installed with other bytes. Installed by the protocol's own
  ``install`` (compiled and checked against either world).
* ``POST /v1/pie/programs/{name}@{version}/launch`` ``{input, token_budget}``: the input
  (a JSON object, or JSON text as the protocol takes it) is checked against the program's
  ``[parameters]`` (a 400 naming the field otherwise) and the run starts in the server's run
  table as a protocol process (its events are kept for whoever attaches first). Answers the
  run at once (``inferlet.run``).
* ``DELETE /v1/pie/programs/{name}@{version}``: the caller's program is forgotten (its
  component stays under ``/v1/inferlets``; runs and daemons already going go on).
* ``GET /v1/pie/runs/{run_id}/events``: server-sent events of any run of the caller's, as
  Pie's client gets them: ``message``, ``stdout``, ``stderr``, ``file`` (base64), then
  ``return`` or ``error``. Leaving the stream detaches; the run goes on (cancel it with
  ``POST /v1/inferlets/{inferlet_id}/runs/{run_id}/cancel``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from api.http.deps import Service, get_service, multipart_body
from api.http.errors import ServiceError
from api.http.pie_protocol.children import child_launcher
from api.http.pie_protocol.mcp_relay import client_for
from api.http.pie_protocol.processes import LaunchError, budget_of, launch_args
from api.http.pie_protocol.programs import (
    Program,
    ProgramError,
    ProgramStore,
    Upload,
    blake3_hex,
    install,
    parse_manifest,
    split_ref,
)
from api.http.pie_protocol.route import PieProtocol, protocol_state
from api.http.runs.inferlets import RunRecord
from api.http.schemas.inferlets import RunObject
from api.http.security.audit import audit
from api.http.security.tenancy import current_caller
from api.http.uploads import receive_multipart
from inferlets.pie_project import PieManifest
from media.errors import PieMediaError

router = APIRouter(tags=["pie programs"])

MAX_MANIFEST_BYTES = 64 << 10
"""A ``Pie.toml`` sent as a file part is read up to this (as a text field is)."""


class PieParameter(BaseModel):
    name: str
    type: str
    optional: bool = False
    description: str = ""


class PieProgramObject(BaseModel):
    id: str
    """``name@version``: what a launch names (here and in ``pie-client``)."""
    object: Literal["pie.program"] = "pie.program"
    name: str
    version: str
    description: str = ""
    parameters: list[PieParameter] = Field(default_factory=list)
    """The manifest's ``[parameters]``, in its order (empty: none declared)."""
    manifest_error: str | None = None
    """Why the manifest's description and parameters could not be read (it still runs)."""
    inferlet_id: str
    """The component in the inferlet store (``/v1/inferlets/{id}``; its runs' ``inferlet_id``)."""
    wasm_hash: str
    manifest_hash: str
    created_at: int


class PieProgramList(BaseModel):
    object: Literal["list"] = "list"
    data: list[PieProgramObject]


class PieProgramInstalled(PieProgramObject):
    installed: bool
    """False when the same bytes were installed already (nothing changed)."""
    message: str


class LaunchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: dict[str, Any] | list[Any] | str | None = None
    """The program's input: a JSON object (checked against ``[parameters]``), or JSON text
    as Pie's ``launch_process`` takes it. None: ``{}``."""
    token_budget: int | None = Field(default=None, ge=0)


def _runtime(service: Service) -> Any:
    if service.inferlets is None:
        raise ServiceError("not_ready", "the inferlet host starts with the models; retry shortly")
    return service.inferlets


def _protocol(request: Request) -> PieProtocol:
    return protocol_state(request.app)


def _object(program: Program) -> PieProgramObject:
    description, parameters, problem = "", [], None
    try:
        manifest = PieManifest.parse(program.manifest)
        description = manifest.description
        parameters = [
            PieParameter(name=p.name, type=p.type, optional=p.optional, description=p.description)
            for p in manifest.parameters.values()
        ]
    except PieMediaError as e:
        problem = e.message
    return PieProgramObject(
        id=program.ref,
        name=program.name,
        version=program.version,
        description=description,
        parameters=parameters,
        manifest_error=problem,
        inferlet_id=program.inferlet_id,
        wasm_hash=program.wasm_hash,
        manifest_hash=program.manifest_hash,
        created_at=program.created_at,
    )


def _program(service: Service, programs: ProgramStore, ref: str) -> tuple[Program, Path]:
    """The caller's program ``name@version`` and its component (404 when not installed)."""
    try:
        name, version = split_ref(ref)
    except ProgramError as e:
        raise ServiceError("invalid_request", str(e), param="program") from None
    tenant = current_caller().tenant
    program = programs.get(tenant, name, version)
    path = None if program is None else service.inferlet_store.path(program.inferlet_id, scope=tenant)
    if program is None or path is None:
        raise ServiceError("not_found", f"program {name}@{version} is not installed", param="program")
    return program, path


@router.get("/v1/pie/programs", response_model=PieProgramList, responses=Service.error_responses(401))
async def list_programs(request: Request, service: Service = Depends(get_service)) -> PieProgramList:
    programs = _protocol(request).programs
    tenant = current_caller().tenant

    def read() -> list[PieProgramObject]:
        out = []
        for name, version in programs.list(tenant):
            program = programs.get(tenant, name, version)
            if program is not None and service.inferlet_store.path(program.inferlet_id, scope=tenant):
                out.append(_object(program))
        return out

    return PieProgramList(data=await asyncio.to_thread(read))


def _manifest_of(form: Any) -> tuple[Path, str]:
    """(the component's spooled file, the manifest text) of an install form."""
    wasm, manifest = [], form.fields.get("manifest")
    for f in form.files:
        if (f.filename or "").lower().endswith(".toml"):
            if manifest:
                raise ServiceError("invalid_request", "two manifests: send one Pie.toml", param="manifest")
            if f.size > MAX_MANIFEST_BYTES:
                raise ServiceError(
                    "too_large", f"the manifest is over {MAX_MANIFEST_BYTES} bytes", param="manifest"
                )
            try:
                manifest = f.path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                raise ServiceError(
                    "invalid_request", "the manifest is not UTF-8 text", param="manifest"
                ) from None
        else:
            wasm.append(f)
    if len(wasm) != 1:
        raise ServiceError(
            "invalid_request", "send the component (.wasm) in the field 'file', once", param="file"
        )
    if not manifest or not manifest.strip():
        raise ServiceError(
            "invalid_request",
            "no manifest: send the program's Pie.toml text in the field 'manifest' (or as a file named *.toml)",
            param="manifest",
        )
    return wasm[0].path, manifest


@router.post(
    "/v1/pie/programs",
    response_model=PieProgramInstalled,
    responses=Service.error_responses(400, 401, 413, 503),
    openapi_extra=multipart_body(manifest="string", force_overwrite="boolean"),
)
async def install_program(request: Request, service: Service = Depends(get_service)) -> PieProgramInstalled:
    runtime = _runtime(service)
    programs = _protocol(request).programs
    limit = service.settings.max_inferlet_bytes
    spool = service.store.spool_dir
    tenant = current_caller().tenant
    form = await receive_multipart(
        request,
        spool,
        max_file_bytes=limit,
        max_total_bytes=limit + MAX_MANIFEST_BYTES,
        max_files=2,
        max_field_bytes=MAX_MANIFEST_BYTES,
    )
    try:
        path, manifest = _manifest_of(form)
        data = await asyncio.to_thread(path.read_bytes)
    finally:
        form.cleanup()
    if not data:
        raise ServiceError("empty", "the component file is empty", param="file")
    force = form.fields.get("force_overwrite", "").strip().lower() in ("1", "true", "yes", "on")
    upload = Upload(key=None, hash=blake3_hex(data), total_chunks=1, manifest=manifest, force_overwrite=force)
    upload.data += data
    try:
        message, program = await asyncio.to_thread(
            install,
            upload,
            tenant=tenant,
            store=service.inferlet_store,
            programs=programs,
            runtime=runtime,
            spool=spool,
        )
    except ProgramError as e:
        raise ServiceError("invalid_request", str(e), param="file") from None
    installed = program is not None
    if program is None:  # the same bytes were there already
        program = programs.get(tenant, *parse_manifest(manifest))
        if program is None:
            raise ServiceError("invalid_request", message, param="file")
    else:
        audit("create", "inferlet", program.inferlet_id, program=program.ref)
    return PieProgramInstalled(**_object(program).model_dump(), installed=installed, message=message)


def _input_args(program: Program, pie_world: bool, body: LaunchRequest) -> list[str]:
    """The run's arguments, as the protocol's launch makes them (``launch_args``)."""
    text = body.input if isinstance(body.input, str) else json.dumps({} if body.input is None else body.input)
    try:
        return launch_args(program, pie_world, text)
    except LaunchError as e:
        raise ServiceError("invalid_request", str(e), param="input") from None


@router.post(
    "/v1/pie/programs/{program}/launch",
    response_model=RunObject,
    responses=Service.error_responses(400, 401, 404, 429, 503),
)
async def launch_program(
    program: str, body: LaunchRequest, request: Request, service: Service = Depends(get_service)
) -> RunObject:
    """Start a run of ``name@version`` (answered at once, still running)."""
    runtime = _runtime(service)
    proto = _protocol(request)
    found, path = _program(service, proto.programs, program)
    try:
        budget = budget_of(body.token_budget)
    except LaunchError as e:
        raise ServiceError("invalid_request", str(e), param="token_budget") from None
    if runtime.launch_child is None:  # children (runtime.launch) reach the tenant's programs
        runtime.launch_child = child_launcher(service, proto.programs, asyncio.get_running_loop())
    args = _input_args(found, await asyncio.to_thread(runtime.is_pie_world, path), body)
    caller = current_caller()
    # a stream slot held while the run goes, its tokens charged when it ends (the middleware
    # counted the request)
    admitted = service.key_limits.admit_run(caller, count_request=False)
    try:
        rec = proto.hub.launch(
            runtime, found.inferlet_id, path, args, tenant=caller.tenant, token_budget=budget, sink=None
        )
    except LaunchError as e:
        admitted(0)
        raise ServiceError("invalid_request", str(e), param="input") from None
    except BaseException:
        admitted(0)
        raise
    if rec.task is not None:
        rec.task.add_done_callback(lambda _t: admitted(rec.control.tokens_used))
    else:
        admitted(0)
    rec.control.username = caller.name or ""
    rec.control.mcp = client_for(rec.control)  # no MCP servers over HTTP: the guest is told so
    audit("create", "inferlet_run", rec.id, inferlet=found.inferlet_id, program=found.ref)
    return RunObject.of(rec)


class PieProgramDeleted(BaseModel):
    id: str
    object: Literal["pie.program"] = "pie.program"
    deleted: bool = True


@router.delete(
    "/v1/pie/programs/{program}",
    response_model=PieProgramDeleted,
    responses=Service.error_responses(400, 401, 404),
)
async def delete_program(
    program: str, request: Request, service: Service = Depends(get_service)
) -> PieProgramDeleted:
    """Forget ``name@version`` for the caller's tenant."""
    programs = _protocol(request).programs
    try:
        name, version = split_ref(program)
    except ProgramError as e:
        raise ServiceError("invalid_request", str(e), param="program") from None
    found = programs.get(current_caller().tenant, name, version)
    if found is None or not await asyncio.to_thread(programs.delete, current_caller().tenant, name, version):
        raise ServiceError("not_found", f"program {name}@{version} is not installed", param="program")
    audit("delete", "inferlet_program", found.ref, inferlet=found.inferlet_id)
    return PieProgramDeleted(id=found.ref)


def _sse(event: str, data: object) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def _event(rec: RunRecord, kind: str, value: str | bytes) -> str:
    if kind == "file":
        data = value if isinstance(value, bytes) else str(value).encode()
        return _sse(
            "file",
            {
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "data": base64.b64encode(data).decode(),
            },
        )
    if kind == "return":
        return _sse("return", {"result": value, "status": rec.status})
    if kind == "error":
        return _sse("error", {"message": value, "status": rec.status, "error": rec.error})
    return _sse(kind, {"text": value})


async def _follow(proto: PieProtocol, rec: RunRecord) -> AsyncIterator[str]:
    queue: asyncio.Queue[tuple[str, str | bytes]] = asyncio.Queue()

    def sink(_pid: str, kind: str, value: str | bytes) -> None:  # the hub's, on the loop
        queue.put_nowait((kind, value))

    try:
        yield _sse("run", RunObject.of(rec).model_dump())
        proto.hub.attach(rec, sink)
        while True:
            kind, value = await queue.get()
            yield _event(rec, kind, value)
            if kind in ("return", "error"):
                return
    finally:  # the client left or the run ended: detach (the run goes on)
        proto.hub.detach(sink)


@router.get(
    "/v1/pie/runs/{run_id}/events",
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "the run's events (SSE)"},
        **Service.error_responses(401, 404),
    },
)
async def run_events(run_id: str, request: Request, service: Service = Depends(get_service)):
    rec = service.inferlet_runs.get(run_id, scope=current_caller().scope)
    if rec is None:
        raise ServiceError("not_found", f"no run {run_id!r}", param="run_id")
    return StreamingResponse(
        _follow(_protocol(request), rec),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
