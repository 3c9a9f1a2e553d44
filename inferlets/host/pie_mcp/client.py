"""``pie:mcp/client``: MCP servers the run's client registered (Pie's relay: the client runs
the servers on the user's side and the calls travel over its WebSocket). The host reaches
them through the run control's ``mcp`` (the server sets it to its relay's client for the
run: ``available_servers()``, ``connect(name)`` -> a session whose calls return futures of
the JSON-RPC result as JSON text). A run without one lists no servers, and ``connect``
names the missing server. Errors are MCP error records (code, message, data)."""

from __future__ import annotations

from typing import Any

from inferlets.host.binding import Interface, Resource, wit


class McpError(Exception):
    def __init__(self, message: str, rpc_code: int = -32603, data: Any = None):
        super().__init__(message)
        self.message = message
        self.rpc_code = rpc_code
        self.data = data


class McpSession(Resource):
    WIT = ("pie:mcp/client", "session")

    def __init__(self, host: Any, session: Any, server: str):
        self.host = host
        self.session = session
        self.server = server

    def call(self, method: str, *args: Any) -> str:
        return str(self.host.wait_future(getattr(self.session, method)(*args)))


class Client(Interface):
    NAME = "pie:mcp/client"
    RESOURCES = (McpSession,)

    def _relay(self) -> Any:
        return self.host.mcp

    @wit("available-servers")
    def available_servers(self) -> list[str]:
        relay = self._relay()
        return sorted(relay.available_servers()) if relay is not None else []

    @wit("connect")
    def connect(self, name: str) -> McpSession:
        relay = self._relay()
        if relay is None:
            raise McpError(
                f"no MCP server named {name!r}: this run has no client relay (MCP servers are registered "
                "by a connected Pie client with register_mcp_server)",
                rpc_code=-32000,
            )
        return McpSession(self.host, relay.connect(name), name)

    @wit("[method]session.list-tools")
    def list_tools(self, s: McpSession) -> str:
        return s.call("list_tools")

    @wit("[method]session.call-tool")
    def call_tool(self, s: McpSession, name: str, args: str) -> str:
        return s.call("call_tool", name, args)

    @wit("[method]session.list-resources")
    def list_resources(self, s: McpSession) -> str:
        return s.call("list_resources")

    @wit("[method]session.read-resource")
    def read_resource(self, s: McpSession, uri: str) -> str:
        return s.call("read_resource", uri)

    @wit("[method]session.list-prompts")
    def list_prompts(self, s: McpSession) -> str:
        return s.call("list_prompts")

    @wit("[method]session.get-prompt")
    def get_prompt(self, s: McpSession, name: str, args: str) -> str:
        return s.call("get_prompt", name, args)
