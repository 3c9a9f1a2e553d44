"""Reading a ``pie_client`` process's events in the protocol tests."""

from __future__ import annotations

import asyncio
from typing import Any

from pie_client import Event

T = 60


async def recv_all(p: Any, timeout: float = T) -> list[tuple[str, Any]]:
    """A process's events up to and including ``return`` / ``error``."""
    events = []
    while True:
        ev, value = await asyncio.wait_for(p.recv(), timeout)
        events.append((ev.value, value))
        if ev in (Event.Return, Event.Error):
            return events


async def recv_until(p: Any, want: tuple[str, Any], timeout: float = T) -> list[tuple[str, Any]]:
    """A process's events up to ``want``; it must not end before."""
    events = []
    while True:
        ev, value = await asyncio.wait_for(p.recv(), timeout)
        events.append((ev.value, value))
        if (ev.value, value) == want:
            return events
        assert ev not in (Event.Return, Event.Error), events
