"""``pie:mcp/client``: MCP servers the run's client registered (Pie's relay: the client
runs the servers on the user's side and the calls travel over its WebSocket). The host
reaches them through ``host.mcp`` (the server wires the relay of the launching
connection); a run without one lists no servers, and ``connect`` names the missing one."""

from __future__ import annotations

import json
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

    def __init__(self, relay: Any, server: str):
        self.relay = relay
        self.server = server

    def call(self, method: str, params: dict[str, Any] | None = None) -> str:
        result = self.relay.call(self.server, method, params or {})
        return json.dumps(result)


def _json_arg(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError as e:
        raise McpError(f"arguments are not JSON: {e}", rpc_code=-32602) from None
    if not isinstance(value, dict):
        raise McpError("arguments must be a JSON object", rpc_code=-32602)
    return value


class Client(Interface):
    NAME = "pie:mcp/client"
    RESOURCES = (McpSession,)

    @wit("available-servers")
    def available_servers(self) -> list[str]:
        relay = self.host.mcp
        return sorted(relay.servers()) if relay is not None else []

    @wit("connect")
    def connect(self, name: str) -> McpSession:
        relay = self.host.mcp
        have = sorted(relay.servers()) if relay is not None else []
        if name not in have:
            raise McpError(
                f"no MCP server named {name!r} is registered for this run "
                f"(registered: {have or 'none'}; a Pie client registers servers with register_mcp_server)",
                rpc_code=-32601,
            )
        return McpSession(relay, name)

    @wit("[method]session.list-tools")
    def list_tools(self, s: McpSession) -> str:
        return s.call("tools/list")

    @wit("[method]session.call-tool")
    def call_tool(self, s: McpSession, name: str, args: str) -> str:
        return s.call("tools/call", {"name": name, "arguments": _json_arg(args)})

    @wit("[method]session.list-resources")
    def list_resources(self, s: McpSession) -> str:
        return s.call("resources/list")

    @wit("[method]session.read-resource")
    def read_resource(self, s: McpSession, uri: str) -> str:
        return s.call("resources/read", {"uri": uri})

    @wit("[method]session.list-prompts")
    def list_prompts(self, s: McpSession) -> str:
        return s.call("prompts/list")

    @wit("[method]session.get-prompt")
    def get_prompt(self, s: McpSession, name: str, args: str) -> str:
        return s.call("prompts/get", {"name": name, "arguments": _json_arg(args)})
