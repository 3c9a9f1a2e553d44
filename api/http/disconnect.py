"""Cancel a request's work when its client goes away (non-streaming requests; a
streaming response watches for itself, ``api/http/sse.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")
POLL_S = 0.05


def _body_read(request: Request) -> bool:
    """Whether every body message has been received already. Starlette's ``Request`` keeps
    this to itself (``_stream_consumed``; ``_body`` once ``body()`` ran); without either,
    the watcher must not call ``receive`` (it would take body messages meant for the route)."""
    return bool(getattr(request, "_stream_consumed", False) or hasattr(request, "_body"))


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone away.

    Once the body is read, the next message an ASGI server sends on an HTTP request is
    ``http.disconnect``, so one ``receive`` that waits costs nothing until then. Before
    that, this only checks every ``POLL_S`` whether the route has read its body: asking
    the server (even Starlette's ``is_disconnected``) could take a body message the route
    needs. A server that answers ``receive`` with anything else is polled instead."""
    while not _body_read(request):
        await asyncio.sleep(POLL_S)
    if (await request.receive())["type"] == "http.disconnect":
        return
    while not await request.is_disconnected():
        await asyncio.sleep(POLL_S)


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it (its ``finally`` blocks
    close contexts and free pages) and raise ``CancelledError``."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        await _wait_for_disconnect(request)
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await task
    finally:
        watcher.cancel()
