"""Daemons: Pie's ``launch_daemon``. A program whose component exports
``wasi:http/incoming-handler`` serves HTTP on 127.0.0.1:port, each request with a fresh
instance (``InferletRuntime.serve_http``), as Pie 0.4 does.

The port is bound here first, so a port in use is the launch's ``ok: false``; uvicorn then
serves it on a thread of its own (its own event loop: off the main thread it installs no
signal handlers). Each request's body is read whole, up to the server's component-size
limit, as Pie buffers it. Then the guest runs on the inferlet host's worker threads, with
engine calls on the server's loop. The response streams back as the guest writes it.

``GET /v1/pie/daemons`` lists a tenant's daemons and ``DELETE /v1/pie/daemons/{port}`` stops
one (``api/http/routes/pie_daemons.py``; Pie's protocol has no message for either).

A daemon runs as its launcher: the tenant's programs, saved contexts and cache scope, under
the server's run limits per request; each request counts against the launcher's key limits
(a request, a stream slot while it runs, the tokens it generates), past them a 429. It lives until the server stops; ``DaemonTable.close``
stops them all."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from api.http.errors import ServiceError
from inferlets import InferletRun
from inferlets.host.wasi.http import HttpExchange

log = logging.getLogger(__name__)

MAX_DAEMONS = 16
"""Daemons one server runs at once (each holds a port and a thread)."""


@dataclass
class Daemon:
    port: int
    program: str
    tenant: str
    username: str
    started: float = field(default_factory=time.time)
    requests: int = 0
    in_flight: int = 0
    server: Any = None
    thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"Daemon({self.program} on 127.0.0.1:{self.port}, {self.requests} requests)"


class DaemonTable:
    """The daemons one server runs (``launch``), by port."""

    def __init__(self, max_daemons: int = MAX_DAEMONS):
        self.max_daemons = max_daemons
        self._by_port: dict[int, Daemon] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"DaemonTable({len(self._by_port)} daemons)"

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._by_port.values()))

    def launch(
        self,
        *,
        runtime: Any,
        wasm: Path,
        program: str,
        port: int,
        tenant: str,
        username: str,
        cache_scope: str,
        admit: Callable[[], Callable[[int], None]],
        loop: asyncio.AbstractEventLoop,
        max_body_bytes: int,
    ) -> Daemon:
        """Bind 127.0.0.1:``port`` and serve the component there. ``admit()``: each request
        counted against the launcher's key limits (``KeyLimiter.admit_run``; its error is a
        429). ``ValueError`` with the reason when it cannot (not a daemon, a bad or busy
        port, too many daemons)."""
        if not runtime.is_daemon(wasm):
            raise ValueError(
                f"{program} is not a daemon: its component exports no wasi:http/incoming-handler "
                "(launch it with launch_process)"
            )
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise ValueError(f"port must be an integer from 1 to 65535, got {port!r}")
        with self._lock:
            if len(self._by_port) >= self.max_daemons:
                raise ValueError(f"this server runs {self.max_daemons} daemons already, its maximum")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen(128)
            except OSError as e:
                sock.close()
                raise ValueError(f"cannot serve on 127.0.0.1:{port}: {e.strerror or e}") from None
            daemon = Daemon(port=port, program=program, tenant=tenant, username=username)
            app = functools.partial(
                _serve_request,
                daemon=daemon,
                runtime=runtime,
                wasm=wasm,
                cache_scope=cache_scope,
                admit=admit,
                engine_loop=loop,
                max_body_bytes=max_body_bytes,
            )
            config = uvicorn.Config(
                app, interface="asgi3", log_level="warning", lifespan="off", access_log=False
            )
            daemon.server = uvicorn.Server(config)
            daemon.thread = threading.Thread(
                target=daemon.server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"daemon-{port}"
            )
            self._by_port[port] = daemon
        daemon.thread.start()
        log.info("daemon %s serving on http://127.0.0.1:%d/ for %r", program, port, tenant)
        return daemon

    def of_tenant(self, tenant: str) -> list[Daemon]:
        """The daemons ``tenant``'s callers launched, by port."""
        with self._lock:
            return sorted((d for d in self._by_port.values() if d.tenant == tenant), key=lambda d: d.port)

    def stop(self, port: int, tenant: str, timeout_s: float = 5.0) -> Daemon | None:
        """Stop the daemon on ``port`` if ``tenant`` launched it (its port is free again; a
        request in flight ends with it); None when there is no such daemon of the tenant's."""
        with self._lock:
            daemon = self._by_port.get(port)
            if daemon is None or daemon.tenant != tenant:
                return None
            del self._by_port[port]
        daemon.server.should_exit = True
        if daemon.thread is not None:
            daemon.thread.join(timeout_s)
        log.info("daemon %s on port %d stopped", daemon.program, port)
        return daemon

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every daemon (its open requests end with the server)."""
        with self._lock:
            daemons, self._by_port = list(self._by_port.values()), {}
        for d in daemons:
            d.server.should_exit = True
        for d in daemons:
            if d.thread is not None:
                d.thread.join(timeout_s)


async def _serve_request(
    scope: dict[str, Any],
    receive: Any,
    send: Any,
    *,
    daemon: Daemon,
    runtime: Any,
    wasm: Path,
    cache_scope: str,
    admit: Callable[[], Callable[[int], None]],
    engine_loop: asyncio.AbstractEventLoop,
    max_body_bytes: int,
) -> None:
    """The ASGI app of one daemon (on its own thread's loop)."""
    if scope["type"] != "http":
        return
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if len(body) > max_body_bytes:
            await _plain(send, 413, f"the request body is over {max_body_bytes} bytes\n")
            return
        if not message.get("more_body"):
            break
    try:
        admitted = admit()
    except ServiceError as e:
        await _plain(send, 429, f"{e.code}: {e.message}\n")
        return
    daemon.requests += 1
    daemon.in_flight += 1
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[str, Any, Any]] = asyncio.Queue()

    def put(*item: Any) -> None:
        loop.call_soon_threadsafe(events.put_nowait, item)

    headers = [(k.decode("latin-1").lower(), bytes(v)) for k, v in scope["headers"]]
    query = scope.get("query_string", b"")
    target = scope.get("raw_path") or scope["path"].encode()
    exchange = HttpExchange(
        method=scope["method"],
        path_with_query=target.decode("latin-1") + (f"?{query.decode('latin-1')}" if query else ""),
        headers=headers,
        body=bytes(body),
        on_head=lambda status, h: put("head", status, h),
        on_body=lambda data: put("body", data, None),
        on_end=lambda error: put("end", error, None),
        scheme=scope.get("scheme", "http"),
        authority=next((v.decode("latin-1") for k, v in headers if k == "host"), None),
    )
    control = InferletRun(namespace=daemon.tenant, cache_scope=cache_scope, username=daemon.username)
    serve = functools.partial(runtime.serve_http, wasm, exchange, loop=engine_loop, control=control)
    try:
        done = loop.run_in_executor(runtime.threads, serve)
    except BaseException:
        admitted(0)
        daemon.in_flight -= 1
        raise

    def ended(_f: Any) -> None:
        admitted(control.tokens_used)
        daemon.in_flight -= 1

    done.add_done_callback(ended)
    # the client's leaving (http.disconnect, which uvicorn gives once the body is read)
    # stops the guest; without this watch its answer would go on into the void
    left = asyncio.ensure_future(_disconnect(receive))
    started = answered = False
    try:
        while True:
            got = asyncio.ensure_future(events.get())
            await asyncio.wait({got, left}, return_when=asyncio.FIRST_COMPLETED)
            if not got.done():
                got.cancel()
                log.info("daemon %s: the client left; its request stops", daemon.program)
                return
            kind, a, b = got.result()
            if kind == "head":
                started = True
                await send(
                    {
                        "type": "http.response.start",
                        "status": a,
                        "headers": [(k.encode("latin-1"), v) for k, v in b],
                    }
                )
            elif kind == "body":
                if a:
                    await send({"type": "http.response.body", "body": a, "more_body": True})
            else:
                if a is not None:
                    log.warning("daemon %s: a response failed: %s", daemon.program, a)
                    if not started:
                        await _plain(send, 500, f"{a}\n")
                        return
                    raise RuntimeError(f"the daemon's response failed: {a}")  # uvicorn drops the connection
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                answered = True
                return
    finally:
        left.cancel()
        if not answered and not done.done():
            control.cancel()  # the client left, or the response failed: the guest stops
        # answered, the guest may go on working (wasi:http lets it), within its run limits
        try:
            await done
        except Exception:  # noqa: BLE001 - told to the client above; the server goes on
            log.debug("daemon %s request ended with an error", daemon.program, exc_info=True)


async def _disconnect(receive: Any) -> None:
    """Returns when the client has gone."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _plain(send: Any, status: int, text: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain; charset=utf-8")],
        }
    )
    await send({"type": "http.response.body", "body": text.encode(), "more_body": False})
