"""One Pie protocol connection: frames in, dispatched by ``type``; answers and process
events out through one writer, in order.

Requests are answered in the order their work ends; quick ones inline, those that wait
(installing a program, ``run_processes``) as tasks, so the connection keeps reading
(``terminate_process`` reaches a process while ``run_processes`` waits for it).

Before sign-in only ``auth_*`` messages are served; any other request is answered ok:false
("authenticate first"), never left without an answer, and a connection that has not signed
in after ``auth_timeout_s`` is closed. A frame that is not a msgpack map with a ``type`` is
dropped (logged at debug level), an unknown ``type`` answered ok:false naming it.

Messages without an answer (``signal_process``, ``transfer_file``, ``mcp_response``) that
cannot be taken are dropped, except a ``transfer_file`` that breaks the chunk rules (order,
hash, size, stalled) or names a process that has ended: the client gets a ``stderr`` event
for that process, ``[pie-media] transfer_file ...: <why>``, and the process runs on.

A connection runs at most ``MAX_LIVE_PROCESSES`` processes at once (launches past it are
answered ok:false), each launch admitted by the key's limits (``api/http/security/key_limits.py``:
one request, one stream slot held while the process runs, refused while its token bucket is
empty); installs, launches and terminations leave audit lines (``via: "pie"``).

``file`` messages for a process the client has no queue for yet are dropped by the client
(unlike events, which it keeps), so a file a process sends before its launch or attach
response has reached the client is held (with the events after it, in order) until
``FILE_GRACE_S`` after that response."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from api.http.errors import ServiceError
from api.http.pie_protocol import framing
from api.http.pie_protocol.auth import Auth
from api.http.pie_protocol.children import child_launcher
from api.http.pie_protocol.daemons import DaemonTable
from api.http.pie_protocol.mcp_relay import RELAY, McpEndpoint, client_for
from api.http.pie_protocol.processes import LaunchError, ProcessHub, args_of, budget_of, launch_args
from api.http.pie_protocol.programs import (
    ProgramError,
    ProgramStore,
    Uploads,
    blake3_hex,
    check_name,
    install,
    split_ref,
)
from api.http.security.audit import audit
from api.http.security.tenancy import enter
from media import cache_scope
from media.errors import PieMediaError

log = logging.getLogger("pie_media.pie_protocol")

AUTH_TYPES = frozenset({"auth_identify", "auth_prove", "auth_by_token"})
MAX_LIVE_PROCESSES = 32
"""Processes one connection may have running at once (its launches past it: ok:false)."""
FILE_GRACE_S = 0.05
"""How long after a launch / attach response a held ``file`` waits (see the docstring)."""
NOT_YET = {
    "submit_workflow": "workflows are not supported by pie-media",
    "cancel_workflow": "workflows are not supported by pie-media",
    "attach_workflow": "workflows are not supported by pie-media",
    "detach_workflow": "workflows are not supported by pie-media",
}
"""Requests this server knows and answers ok:false (PROTOCOL.md §3)."""


class Reply(Exception):
    """Answer the request ok:false with this text."""


class Opens(str):
    """An ok result after which the client holds an event queue for each of ``pids``."""

    pids: tuple[str, ...] = ()


def opens(text: str, pids: Any) -> Opens:
    out = Opens(text)
    out.pids = tuple(pids)
    return out


class Session:
    def __init__(
        self,
        ws: WebSocket,
        *,
        service: Any,
        keys: Any,
        hub: ProcessHub,
        programs: ProgramStore,
        daemons: DaemonTable,
        auth_timeout_s: float,
        upload_timeout_s: float,
    ):
        self.ws = ws
        self.service = service
        self.hub = hub
        self.programs = programs
        self.daemons = daemons
        self.auth = Auth(keys)
        self.auth_timeout_s = auth_timeout_s
        self.upload_timeout_s = upload_timeout_s
        self.uploads = Uploads(service.settings.max_inferlet_bytes)
        self.files = Uploads(service.settings.max_inferlet_bytes, kind="transfer_file")
        self.mcp: McpEndpoint | None = None
        self._live: set[str] = set()
        """Ids of the processes this connection launched that may still run."""
        self._ready: set[str] = set()
        """Processes the client holds a queue for (a launch / attach answered)."""
        self._held: dict[str, list[tuple[str, str | bytes]]] = {}
        self._out: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._run_process_ids: set[str] = set()
        self.closed = False
        self.handlers: dict[str, Callable[[dict[str, Any]], Awaitable[str | None]]] = {
            "ping": self.ping,
            "query": self.query,
            "check_program": self.check_program,
            "launch_process": self.launch_process,
            "launch_processes": self.launch_processes,
            "run_processes": self.run_processes,
            "attach_process": self.attach_process,
            "terminate_process": self.terminate_process,
            "list_processes": self.list_processes,
            "add_program": self.add_program,
            "launch_daemon": self.launch_daemon,
            "register_mcp_server": self.register_mcp_server,
        }

    # -- the connection ---------------------------------------------------------------------
    async def serve(self) -> None:
        await self.ws.accept()
        self.mcp = McpEndpoint(self.send, loop=asyncio.get_running_loop())
        writer = asyncio.create_task(self._write())
        watchdog = asyncio.create_task(self._watch())
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                data = message.get("bytes")
                if data is None:
                    data = message.get("text") or ""
                try:
                    msg = framing.decode(data)
                except framing.FrameError as e:
                    log.debug("pie protocol: frame dropped: %s", e)
                    continue
                await self._dispatch(msg)
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            self.closed = True
            watchdog.cancel()
            self.mcp.close()
            self._held.clear()
            for task in list(self._tasks):
                task.cancel()
            for rec in self.hub.detach(self.deliver):
                self.service.inferlet_runs.cancel(rec)  # capture_outputs: ends with its launcher
                audit("cancel", "inferlet_run", rec.id, via="pie", reason="its launcher disconnected")
            for run_id in self._run_process_ids:
                rec = self.service.inferlet_runs.get(run_id)
                if rec is not None and not rec.done:
                    self.service.inferlet_runs.cancel(rec)
            self._out.put_nowait(None)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(writer, timeout=1)

    async def _write(self) -> None:
        while True:
            data = await self._out.get()
            if data is None:
                return
            try:
                await self.ws.send_bytes(data)
            except Exception:  # noqa: BLE001 - the peer went away; the reader sees it too
                return

    async def _watch(self) -> None:
        """Close a connection that never signs in; answer uploads that stopped part-way."""
        started = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(min(1.0, self.auth_timeout_s, self.upload_timeout_s))
            if (
                not self.auth.authenticated
                and asyncio.get_running_loop().time() - started >= self.auth_timeout_s
            ):
                log.info("pie protocol: closing a connection that did not authenticate")
                self._out.put_nowait(None)
                with contextlib.suppress(Exception):
                    await self.ws.close(code=1008, reason="authenticate first")
                return
            for up in self.uploads.stale(self.upload_timeout_s):
                self.respond(
                    up.corr_id,
                    False,
                    f"add_program: upload incomplete: {up.next_index} of {up.total_chunks} chunks came, "
                    f"then nothing for {self.upload_timeout_s:g} s",
                )
            for up in self.files.stale(self.upload_timeout_s):
                self._notice(
                    up.key[0],
                    f"transfer_file {up.hash[:16]}... incomplete: {up.next_index} of {up.total_chunks} "
                    f"chunks came, then nothing for {self.upload_timeout_s:g} s; the file was dropped",
                )

    def send(self, data: bytes) -> None:
        if not self.closed:
            self._out.put_nowait(data)

    def respond(self, corr_id: Any, ok: bool, result: str) -> None:
        self.send(framing.response(corr_id, ok, result))

    def deliver(self, process_id: str, event: str, value: str | bytes) -> None:
        """A process's event to this client (the hub's sink); a ``file`` as ``file`` chunks."""
        held = self._held.get(process_id)
        if held is not None:
            held.append((event, value))
        elif event == "file" and process_id not in self._ready:
            self._held[process_id] = [(event, value)]
        else:
            self._send_event(process_id, event, value)

    def _send_event(self, process_id: str, event: str, value: str | bytes) -> None:
        if event == "file":
            data = value if isinstance(value, bytes) else str(value).encode()
            for frame in framing.file_chunks(process_id, blake3_hex(data), data):
                self.send(frame)
            return
        self.send(framing.process_event(process_id, event, str(value)))
        if event in ("return", "error"):
            self._ready.discard(process_id)  # the client drops its queue

    def _opened(self, pids: tuple[str, ...]) -> None:
        """The client has (or is about to have) a queue for each of ``pids``: send what was
        held for them, ``FILE_GRACE_S`` from now (the client makes the queue once it has read
        the response, and reads the frames after it before that)."""
        loop = asyncio.get_running_loop()

        def flush(pid: str) -> None:
            if self.closed:
                return
            self._ready.add(pid)
            for event, value in self._held.pop(pid, []):
                self._send_event(pid, event, value)

        for pid in pids:
            loop.call_later(FILE_GRACE_S, flush, pid)

    def _notice(self, process_id: Any, text: str) -> None:
        """Tell the client about input of its that was dropped, as a ``stderr`` event of the
        process it named."""
        log.info("pie protocol: %s", text)
        if isinstance(process_id, str) and process_id:
            self.deliver(process_id, "stderr", f"[pie-media] {text}\n")

    # -- dispatch ---------------------------------------------------------------------------
    async def _dispatch(self, msg: dict[str, Any]) -> None:
        kind, corr_id = msg["type"], msg.get("corr_id")
        if kind in AUTH_TYPES:
            await self._authenticate(kind, msg)
            return
        if not self.auth.authenticated:
            if corr_id is not None:
                self.respond(
                    corr_id, False, f"{kind}: authenticate first (auth_identify, or auth_by_token with a key)"
                )
            return
        if kind == "add_program":
            self._add_program_chunk(msg)
        elif kind == "signal_process":
            self._signal(msg)
        elif kind == "transfer_file":
            self._transfer_chunk(msg)
        elif kind == "mcp_response":
            if self.mcp is None or not self.mcp.answer(msg):
                log.debug("pie protocol: mcp_response for no call in flight (%r); dropped", corr_id)
        elif kind in self.handlers:
            if corr_id is None:
                return  # a request without corr_id cannot be answered
            self._spawn(self._answer(kind, corr_id, msg))
        elif corr_id is not None:
            self.respond(corr_id, False, NOT_YET.get(kind, f"unknown message type {kind!r}"))
        else:
            log.debug("pie protocol: unknown message type %r without corr_id; dropped", kind)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, kind: str, corr_id: Any, msg: dict[str, Any]) -> None:
        try:
            result = await self.handlers[kind](msg)
        except Reply as e:
            self.respond(corr_id, False, str(e))
        except (ProgramError, LaunchError) as e:
            self.respond(corr_id, False, str(e))
        except PieMediaError as e:
            self.respond(corr_id, False, f"{e.code}: {e.message}")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - answered, logged; the connection goes on
            log.exception("pie protocol: %s failed", kind)
            self.respond(corr_id, False, f"{kind} failed: {type(e).__name__}: {e}")
        else:
            if result is not None:
                self.respond(corr_id, True, result)
                if isinstance(result, Opens):
                    self._opened(result.pids)

    async def _authenticate(self, kind: str, msg: dict[str, Any]) -> None:
        corr_id = msg.get("corr_id")
        if kind == "auth_identify":
            ok, result = self.auth.identify(msg.get("username"))
        elif kind == "auth_prove":
            ok, result = self.auth.prove(msg.get("signature"))
        else:
            ok, result = await self.auth.by_token(msg.get("token"))
        if self.auth.caller is not None:
            if self.mcp is not None:
                self.mcp.tenant = self.auth.caller.tenant
            # this task and every task it starts from now on act as the caller (tenancy.py)
            enter(self.auth.caller, shared_caches=self.service.settings.share_prefix_cache)
        if corr_id is not None:
            self.respond(corr_id, ok, result)

    @property
    def caller(self) -> Any:
        assert self.auth.caller is not None
        return self.auth.caller

    # -- requests ---------------------------------------------------------------------------
    async def ping(self, msg: dict[str, Any]) -> str:
        return "Pong"

    async def query(self, msg: dict[str, Any]) -> str:
        subject = msg.get("subject")
        if subject != "model_status":
            raise Reply(f"query: unknown subject {subject!r} (this server answers 'model_status')")
        status: dict[str, int] = {}
        for served in self.service.models:
            if getattr(served, "adapter", None) is not None:
                continue
            model = served.model
            try:
                if served.kind == "speech":
                    status[f"{served.name}.kv_pages_used"] = int(model.pool_stats().in_use)
                else:
                    status[f"{served.name}.kv_pages_used"] = int(model.metrics().pages_used)
            except Exception:  # noqa: BLE001 - a model without page counts is left out
                log.debug("pie protocol: no page count for %s", served.name, exc_info=True)
        return json.dumps(status)

    def _runtime(self) -> Any:
        if self.service.inferlets is None:
            raise Reply("the inferlet host starts with the models; retry shortly")
        return self.service.inferlets

    def _args(self, runtime: Any, program: Any, path: Any, input_text: Any) -> list[str]:
        """The run's arguments (``launch_args``); children it launches reach this tenant's
        programs."""
        if runtime.launch_child is None:
            runtime.launch_child = child_launcher(self.service, self.programs, asyncio.get_running_loop())
        try:
            return launch_args(program, runtime.is_pie_world(path), input_text)
        except PieMediaError as e:
            raise Reply(f"{e.code}: {e.message}") from None

    def _program(self, ref: Any) -> tuple[Any, Any]:
        """(program, component path) of ``name@version`` for this session's tenant."""
        name, version = split_ref(ref)
        tenant = self.caller.tenant
        program = self.programs.get(tenant, name, version)
        path = (
            None if program is None else self.service.inferlet_store.path(program.inferlet_id, scope=tenant)
        )
        if program is None or path is None:
            raise Reply(f"program {name}@{version} is not installed (add_program first)")
        return program, path

    async def check_program(self, msg: dict[str, Any]) -> str:
        name = check_name(msg.get("name"), "name")
        version = check_name(msg.get("version"), "version")
        tenant = self.caller.tenant
        program = self.programs.get(tenant, name, version)
        if program is None or self.service.inferlet_store.path(program.inferlet_id, scope=tenant) is None:
            return "false"
        wasm_hash, manifest_hash = msg.get("wasm_hash"), msg.get("manifest_hash")
        if isinstance(wasm_hash, str) and wasm_hash.lower() != program.wasm_hash:
            return "false"
        if isinstance(manifest_hash, str) and manifest_hash.lower() != program.manifest_hash:
            return "false"
        return "true"

    def _add_program_chunk(self, msg: dict[str, Any]) -> None:
        corr_id = msg.get("corr_id")
        if self.uploads.failed(corr_id):
            return  # the rest of an upload already answered with its error
        try:
            upload = self.uploads.chunk(msg)
        except ProgramError as e:
            self.uploads.fail(corr_id)
            if corr_id is not None:
                self.respond(corr_id, False, str(e))
            return
        if upload is not None:
            self._spawn(self._answer("add_program", corr_id, {"upload": upload}))

    async def add_program(self, msg: dict[str, Any]) -> str:
        runtime = self._runtime()
        upload = msg["upload"]
        store = self.service.inferlet_store
        result, program = await asyncio.to_thread(
            install,
            upload,
            tenant=self.caller.tenant,
            store=store,
            programs=self.programs,
            runtime=runtime,
            spool=self.service.store.spool_dir,
        )
        if program is not None:
            audit("create", "inferlet", program.inferlet_id, program=program.ref, via="pie")
        return result

    def _admit(self) -> Callable[[int], None]:
        """Count one launch against the caller's key limits (one request; a stream slot,
        held while the process runs; refused while the key's token bucket is empty). Returns
        ``done(tokens)``: the slot back and the run's tokens charged, when it ends."""
        caller = self.caller
        if caller.limits.any:
            self.service.metrics.key_requests.labels(caller.name).inc()
        try:
            return self.service.key_limits.admit_run(caller)
        except ServiceError as e:
            self.service.metrics.key_limited.labels(caller.name, e.code).inc()
            raise Reply(f"{e.code}: {e.message}") from None

    def _launch(
        self, msg: dict[str, Any], input_text: Any, budget: Any, capture: bool, keep: bool = True
    ) -> Any:
        runtime = self._runtime()
        program, path = self._program(msg.get("inferlet"))
        runs = self.service.inferlet_runs
        self._live = {i for i in self._live if (r := runs.get(i)) is not None and not r.done}
        if len(self._live) >= MAX_LIVE_PROCESSES:
            raise Reply(
                f"this connection has {len(self._live)} processes running, its maximum "
                f"({MAX_LIVE_PROCESSES}); wait for one to end or terminate one"
            )
        token_budget = budget_of(budget)
        args = self._args(runtime, program, path, input_text)
        admitted = self._admit()
        try:
            rec = self.hub.launch(
                runtime,
                program.inferlet_id,
                path,
                args,
                tenant=self.caller.tenant,
                token_budget=token_budget,
                sink=self.deliver if capture else None,
                keep=keep,
            )
        except BaseException as e:
            admitted(0)
            if isinstance(e, ServiceError):  # queue_full
                raise Reply(f"{e.code}: {e.message}") from None
            raise
        if rec.task is not None:
            control = rec.control
            rec.task.add_done_callback(lambda _t: admitted(control.tokens_used))
        else:
            admitted(0)
        self._live.add(rec.id)
        rec.control.username = self.caller.name or ""
        if self.mcp is not None:
            RELAY.bind(rec.control, self.mcp, rec.id)
        rec.control.mcp = client_for(rec.control)
        audit("create", "inferlet_run", rec.id, inferlet=program.inferlet_id, program=program.ref, via="pie")
        return rec

    async def launch_process(self, msg: dict[str, Any]) -> str:
        rec = self._launch(
            msg, msg.get("input"), msg.get("token_budget"), bool(msg.get("capture_outputs", True))
        )
        return opens(rec.id, [rec.id])

    def _many(self, msg: dict[str, Any]) -> list[tuple[Any, Any]]:
        inputs, budgets = msg.get("inputs"), msg.get("token_budgets")
        if not isinstance(inputs, list) or not inputs:
            raise Reply("inputs must be a non-empty list of JSON texts")
        if budgets is None:
            budgets = [None] * len(inputs)
        if not isinstance(budgets, list) or len(budgets) != len(inputs):
            raise Reply(f"token_budgets must be a list as long as inputs ({len(inputs)})")
        for text, budget in zip(inputs, budgets, strict=True):
            args_of(text), budget_of(budget)  # every one checked before any starts
        return list(zip(inputs, budgets, strict=True))

    async def launch_processes(self, msg: dict[str, Any]) -> str:
        capture = bool(msg.get("capture_outputs", True))
        started = []
        try:
            for text, budget in self._many(msg):
                started.append(self._launch(msg, text, budget, capture))
        except BaseException:
            for rec in started:
                self.service.inferlet_runs.cancel(rec)
            raise
        return opens(json.dumps([r.id for r in started]), [r.id for r in started])

    async def run_processes(self, msg: dict[str, Any]) -> str:
        started = []
        try:
            for text, budget in self._many(msg):
                rec = self._launch(msg, text, budget, False, keep=False)
                started.append(rec)
                self._run_process_ids.add(rec.id)
            await asyncio.gather(*(asyncio.shield(r.task) for r in started if r.task is not None))
        except BaseException:
            for rec in started:
                self.service.inferlet_runs.cancel(rec)
            raise
        finally:
            self._run_process_ids.difference_update(r.id for r in started)
        for rec in started:
            if rec.status != "succeeded":
                error = rec.error or {}
                reason = "Signal" if rec.status == "cancelled" else error.get("message", rec.status)
                raise Reply(f"process {rec.id} failed: {error.get('code', rec.status)}: {reason}")
        return json.dumps([r.result or "" for r in started])

    def _run(self, process_id: Any) -> Any:
        rec = (
            self.service.inferlet_runs.get(process_id, scope=self.caller.scope)
            if isinstance(process_id, str)
            else None
        )
        if rec is None:
            raise Reply(f"no process {process_id!r}")
        return rec

    async def attach_process(self, msg: dict[str, Any]) -> str:
        rec = self._run(msg.get("process_id"))
        self._ready.discard(rec.id)  # the client makes a new queue once answered
        self.hub.attach(rec, self.deliver)
        if self.mcp is not None:
            RELAY.bind(rec.control, self.mcp, rec.id)
        return opens("Process attached", [rec.id])

    async def launch_daemon(self, msg: dict[str, Any]) -> str:
        runtime = self._runtime()
        program, path = self._program(msg.get("inferlet"))  # one not installed is told so first
        try:
            daemon = await asyncio.to_thread(
                self.daemons.launch,
                runtime=runtime,
                wasm=path,
                program=program.ref,
                port=msg.get("port"),
                tenant=self.caller.tenant,
                username=self.caller.name or "",
                cache_scope=cache_scope(),
                admit=functools.partial(self.service.key_limits.admit_run, self.caller),
                loop=asyncio.get_running_loop(),
                max_body_bytes=self.service.settings.max_inferlet_bytes,
            )
        except ValueError as e:
            raise Reply(f"launch_daemon: {e}") from None
        audit("create", "inferlet_daemon", f"port-{daemon.port}", program=program.ref, via="pie")
        return "server launched"

    async def register_mcp_server(self, msg: dict[str, Any]) -> str:
        assert self.mcp is not None
        try:
            reg = self.mcp.register(msg)
        except ValueError as e:
            raise Reply(str(e)) from None
        log.info("pie protocol: MCP server %r registered (%s)", reg.name, reg.transport)
        return "MCP server registered"

    def _transfer_chunk(self, msg: dict[str, Any]) -> None:
        """One ``transfer_file`` chunk; the whole file, checked, to the process's
        ``session.receive-file`` (``InferletRun.post_file``)."""
        process_id = msg.get("process_id")
        key = self.files.key_of(msg)
        if self.files.failed(key):
            if msg.get("chunk_index") != 0:
                return  # the rest of a transfer already refused
            self.files.forgive(key)  # the same file sent again
        try:
            rec = self._run(process_id)
            if rec.done:
                raise Reply(f"process {process_id} has ended ({rec.status})")
            done = self.files.chunk(msg)
        except (Reply, ProgramError) as e:
            self.files.fail(key)
            self._notice(process_id, f"transfer_file {str(key[1])[:16]}... dropped: {e}")
            return
        if done is not None:
            rec.control.post_file(bytes(done.data))

    async def terminate_process(self, msg: dict[str, Any]) -> str:
        rec = self._run(msg.get("process_id"))
        if not rec.done:
            self.service.inferlet_runs.cancel(rec)
            audit("cancel", "inferlet_run", rec.id, via="pie")
        return "Process terminated"

    async def list_processes(self, msg: dict[str, Any]) -> str:
        return json.dumps(self.hub.running(self.caller.scope))

    def _signal(self, msg: dict[str, Any]) -> None:
        process_id, text = msg.get("process_id"), msg.get("message")
        rec = (
            self.service.inferlet_runs.get(process_id, scope=self.caller.scope)
            if isinstance(process_id, str)
            else None
        )
        if rec is None or rec.done or not isinstance(text, str):
            log.debug("pie protocol: signal for %r dropped (no such running process, or no text)", process_id)
            return
        rec.control.post(text)
