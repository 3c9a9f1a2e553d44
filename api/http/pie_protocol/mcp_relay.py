"""The server side of Pie's MCP relay (PROTOCOL.md §7): MCP servers run on the user's side,
next to ``pie-client``; an inferlet's MCP calls travel to them over the client's WebSocket.

The client starts a server itself (stdio), does the MCP handshake, then announces it with
``register_mcp_server {name, transport, command, args, url}``. A call goes to the client as
``mcp_request {corr_id, process_id, server_name, method, params}`` (``params`` JSON text,
``corr_id`` this server's counter) and comes back as ``mcp_response {corr_id, ok, result}``:
ok -> ``result`` is the JSON-RPC result as JSON text; not ok -> a JSON-RPC error object
``{"code", "message", "data"?}`` as JSON text, raised here as ``McpError``.

Registrations belong to one connection (so to its tenant): a run sees the servers of the
connections it is bound to -- the one that launched it and those attached to it (the
session binds them, ``RELAY.bind``), the most recent first. Nothing else sees them.

Public API (what the WIT host's ``pie:mcp/client`` calls):

``McpError(code, message, data=None)``
    A JSON-RPC error (WIT ``pie:mcp/types.error``: ``code`` s32, ``message``, ``data`` as
    JSON text via ``data_json``). -32000: no such server, the client went away, too many
    calls in flight; -32001: no answer within the timeout; else the MCP server's own.
``await mcp_call(who, server, method, params=None, *, timeout_s=None) -> result``
    One call on the event loop; ``who`` is an ``McpEndpoint`` (one connection) or a run's
    ``InferletRun`` control (the connections bound to it). Returns the decoded JSON result.
``submit(who, server, method, params=None, *, timeout_s=None) -> concurrent.futures.Future``
    The same from any thread (the guest's worker thread): the future's result is the
    result's JSON text, or it raises ``McpError``.
``available_servers(who) -> list[str]``
    The server names ``who`` can call (WIT ``available-servers``).
``client_for(control) -> McpClient``
    ``pie:mcp/client`` for one run: ``available_servers()``, ``connect(name) ->
    McpSession`` (``McpError`` for a name not registered). An ``McpSession`` has
    ``list_tools()``, ``call_tool(name, args_json)``, ``list_resources()``,
    ``read_resource(uri)``, ``list_prompts()``, ``get_prompt(name, args_json)``, each a
    ``concurrent.futures.Future`` of the raw JSON-RPC ``result`` as JSON text (the WIT's
    ``json``), callable from the worker thread.
``RELAY``
    This process's registry of which connections each run is bound to (``bind``,
    ``forget``, ``endpoints``); the protocol's sessions keep it up to date.
``McpEndpoint``
    One connection's side (made by the session): ``register(msg)``, ``names()``,
    ``call(...)``, ``answer(msg)`` (an ``mcp_response``), ``close()``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from api.http.pie_protocol import framing

DEFAULT_TIMEOUT_S = 60.0
"""How long a call waits for the client's ``mcp_response``."""
MAX_SERVERS = 64
"""MCP servers one connection may register."""
MAX_PENDING = 256
"""Calls in flight on one connection."""
UNAVAILABLE = -32000
TIMED_OUT = -32001
INTERNAL = -32603


class McpError(Exception):
    """A JSON-RPC error, as the client relays it or as this server makes it."""

    def __init__(self, code: int, message: str, data: Any = None):
        super().__init__(f"MCP error {code}: {message}")
        self.code = int(code)
        self.message = str(message)
        self.data = data

    @property
    def data_json(self) -> str | None:
        """``data`` as JSON text (the WIT record's ``option<json>``)."""
        return None if self.data is None else json.dumps(self.data)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            out["data"] = self.data
        return out

    @classmethod
    def from_result(cls, text: Any) -> McpError:
        """The error of a not-ok ``mcp_response`` (its ``result``: a JSON-RPC error object)."""
        try:
            obj = json.loads(text) if isinstance(text, str) else None
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("code"), int) and not isinstance(obj["code"], bool):
            return cls(obj["code"], str(obj.get("message", "")), obj.get("data"))
        return cls(UNAVAILABLE, f"the client answered with an error: {str(text)[:500]}")


@dataclass(frozen=True)
class Registration:
    name: str
    transport: str
    command: str | None
    args: tuple[str, ...]
    url: str | None


class McpEndpoint:
    """One client connection's MCP servers and its calls in flight. Lives on the loop that
    ``send`` (the session's writer) belongs to; ``call`` and ``answer`` run there."""

    def __init__(
        self,
        send: Callable[[bytes], None],
        *,
        tenant: str = "",
        loop: asyncio.AbstractEventLoop | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        self.send = send
        self.tenant = tenant
        self.loop = loop or asyncio.get_running_loop()
        self.timeout_s = timeout_s
        self.servers: dict[str, Registration] = {}
        self.closed: str | None = None
        """Why the endpoint closed (None while open)."""
        self._next = 0
        self._pending: dict[int, asyncio.Future[Any]] = {}

    def __repr__(self) -> str:
        return f"McpEndpoint({sorted(self.servers)}, {len(self._pending)} in flight)"

    def register(self, msg: dict[str, Any]) -> Registration:
        """Record a ``register_mcp_server`` (``ValueError`` saying what is wrong with it). A
        name registered again is replaced (the client refuses duplicates on its side)."""
        name, transport = msg.get("name"), msg.get("transport")
        if not isinstance(name, str) or not name or len(name) > 256:
            raise ValueError(f"register_mcp_server: name must be a non-empty string, got {name!r}")
        if not isinstance(transport, str) or not transport:
            raise ValueError(f"register_mcp_server: transport must be a string, got {transport!r}")
        if name not in self.servers and len(self.servers) >= MAX_SERVERS:
            raise ValueError(f"register_mcp_server: {MAX_SERVERS} MCP servers are registered already")
        args = msg.get("args") or []
        command, url = msg.get("command"), msg.get("url")
        reg = Registration(
            name,
            transport,
            command if isinstance(command, str) else None,
            tuple(str(a) for a in args) if isinstance(args, list) else (),
            url if isinstance(url, str) else None,
        )
        self.servers[name] = reg
        return reg

    def names(self) -> list[str]:
        return [] if self.closed else list(self.servers)

    async def call(
        self,
        server: str,
        method: str,
        params: Any = None,
        *,
        process_id: str = "",
        timeout_s: float | None = None,
    ) -> Any:
        """``method(params)`` on the client's MCP server ``server``; its decoded result, or
        ``McpError``. Call on this endpoint's loop."""
        if self.closed:
            raise McpError(UNAVAILABLE, f"MCP server {server!r} is unreachable: {self.closed}")
        if server not in self.servers:
            raise McpError(
                UNAVAILABLE,
                f"MCP server {server!r} is not registered on this client session"
                + (
                    f" (registered: {', '.join(sorted(self.servers))})"
                    if self.servers
                    else " (none registered)"
                ),
            )
        if not isinstance(method, str) or not method:
            raise McpError(-32600, f"method must be a non-empty string, got {method!r}")
        if len(self._pending) >= MAX_PENDING:
            raise McpError(
                UNAVAILABLE, f"{MAX_PENDING} MCP calls are in flight on this client session already"
            )
        try:
            params_text = json.dumps({} if params is None else params)
        except (TypeError, ValueError) as e:
            raise McpError(-32602, f"params are not JSON: {e}") from None
        self._next = self._next % 0xFFFFFFFF + 1  # the client's corr_id is a u32
        corr_id = self._next
        frame = framing.encode(
            {
                "type": "mcp_request",
                "corr_id": corr_id,
                "process_id": process_id,
                "server_name": server,
                "method": method,
                "params": params_text,
            }
        )
        if len(frame) >= framing.CLIENT_MAX_FRAME:
            raise McpError(-32602, f"params are over the protocol's 1 MiB frame ({len(frame)} bytes)")
        fut: asyncio.Future[Any] = self.loop.create_future()
        self._pending[corr_id] = fut
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            self.send(frame)
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise McpError(
                TIMED_OUT, f"MCP server {server!r} did not answer {method} within {timeout:g} s"
            ) from None
        finally:
            self._pending.pop(corr_id, None)

    def answer(self, msg: dict[str, Any]) -> bool:
        """An ``mcp_response`` from the client; False when no call waits for its corr_id."""
        fut = self._pending.pop(msg.get("corr_id"), None)  # type: ignore[arg-type]
        if fut is None or fut.done():
            return False
        result = msg.get("result")
        if msg.get("ok") is True:
            try:
                fut.set_result(json.loads(result) if isinstance(result, str) else result)
            except ValueError:
                fut.set_exception(McpError(INTERNAL, f"the client's result is not JSON: {str(result)[:200]}"))
        else:
            fut.set_exception(McpError.from_result(result))
        return True

    def close(self, reason: str = "the client connection closed") -> None:
        """Fail every call in flight; no call is sent from now on."""
        if self.closed:
            return
        self.closed = reason
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(McpError(UNAVAILABLE, f"MCP call abandoned: {reason}"))
        RELAY.forget(self)


class McpRelay:
    """Which connections each run is bound to (keyed by its ``InferletRun`` control, held
    weakly: a run forgotten by the run table leaves no trace). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: weakref.WeakKeyDictionary[Any, list[tuple[McpEndpoint, str]]] = (
            weakref.WeakKeyDictionary()
        )

    def bind(self, control: Any, endpoint: McpEndpoint, process_id: str = "") -> None:
        """The run (``control``) sees ``endpoint``'s servers from now on, before those bound
        earlier. ``process_id``: what its ``mcp_request``s name."""
        with self._lock:
            bound = [b for b in self._runs.get(control, []) if b[0] is not endpoint]
            self._runs[control] = [(endpoint, process_id), *bound]

    def forget(self, endpoint: McpEndpoint) -> None:
        """A connection has gone: no run sees it any more."""
        with self._lock:
            for control, bound in list(self._runs.items()):
                kept = [b for b in bound if b[0] is not endpoint]
                if kept:
                    self._runs[control] = kept
                else:
                    del self._runs[control]

    def endpoints(self, control: Any) -> list[tuple[McpEndpoint, str]]:
        """(endpoint, process id) the run is bound to, open ones, the most recent first."""
        with self._lock:
            return [b for b in self._runs.get(control, []) if not b[0].closed]


RELAY = McpRelay()


def _route(who: Any, server: str) -> tuple[McpEndpoint, str]:
    """The endpoint (and process id) that serves ``server`` for ``who``."""
    if isinstance(who, McpEndpoint):
        return who, ""
    bound = RELAY.endpoints(who)
    for endpoint, process_id in bound:
        if server in endpoint.servers:
            return endpoint, process_id
    names = sorted({n for e, _ in bound for n in e.names()})
    raise McpError(
        UNAVAILABLE,
        f"MCP server {server!r} is not registered by any client session of this process"
        + (
            f" (registered: {', '.join(names)})"
            if names
            else " (none registered; no client session attached)"
        ),
    )


def available_servers(who: Any) -> list[str]:
    """Server names ``who`` (an ``McpEndpoint`` or a run's control) can call."""
    if isinstance(who, McpEndpoint):
        return who.names()
    seen: dict[str, None] = {}
    for endpoint, _ in RELAY.endpoints(who):
        for name in endpoint.names():
            seen.setdefault(name, None)
    return list(seen)


async def mcp_call(
    who: Any, server: str, method: str, params: Any = None, *, timeout_s: float | None = None
) -> Any:
    """``method(params)`` on MCP server ``server`` as ``who`` sees it; the decoded result,
    or ``McpError``. Call on the server's event loop."""
    endpoint, process_id = _route(who, server)
    return await endpoint.call(server, method, params, process_id=process_id, timeout_s=timeout_s)


def submit(
    who: Any, server: str, method: str, params: Any = None, *, timeout_s: float | None = None
) -> concurrent.futures.Future:
    """``mcp_call`` from any thread but the loop's: a future of the result as JSON text
    (``McpError`` on failure)."""
    try:
        endpoint, process_id = _route(who, server)
    except McpError as e:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_exception(e)
        return fut

    async def go() -> str:
        result = await endpoint.call(server, method, params, process_id=process_id, timeout_s=timeout_s)
        return json.dumps(result)

    return asyncio.run_coroutine_threadsafe(go(), endpoint.loop)


class McpSession:
    """WIT ``pie:mcp/client.session``: one registered server, for one run."""

    def __init__(self, who: Any, server: str):
        self.who, self.server = who, server

    def _with_args(self, method: str, name: str, args: str) -> concurrent.futures.Future:
        try:
            decoded = json.loads(args) if args else {}
        except ValueError as e:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.set_exception(McpError(-32602, f"args are not JSON: {e}"))
            return fut
        return submit(self.who, self.server, method, {"name": name, "arguments": decoded})

    def list_tools(self) -> concurrent.futures.Future:
        return submit(self.who, self.server, "tools/list", {})

    def call_tool(self, name: str, args: str) -> concurrent.futures.Future:
        return self._with_args("tools/call", name, args)

    def list_resources(self) -> concurrent.futures.Future:
        return submit(self.who, self.server, "resources/list", {})

    def read_resource(self, uri: str) -> concurrent.futures.Future:
        return submit(self.who, self.server, "resources/read", {"uri": uri})

    def list_prompts(self) -> concurrent.futures.Future:
        return submit(self.who, self.server, "prompts/list", {})

    def get_prompt(self, name: str, args: str) -> concurrent.futures.Future:
        return self._with_args("prompts/get", name, args)


class McpClient:
    """WIT ``pie:mcp/client`` for one run (its ``InferletRun`` control)."""

    def __init__(self, control: Any):
        self.control = control

    def available_servers(self) -> list[str]:
        return available_servers(self.control)

    def connect(self, server: str) -> McpSession:
        _route(self.control, server)  # McpError when nobody registered it
        return McpSession(self.control, server)


def client_for(control: Any) -> McpClient:
    return McpClient(control)
