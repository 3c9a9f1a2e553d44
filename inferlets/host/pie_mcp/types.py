"""``pie:mcp/types``: types only (``json``, the ``error`` record); nothing to call."""

from __future__ import annotations

from inferlets.host.binding import Interface


class McpTypes(Interface):
    NAME = "pie:mcp/types"
