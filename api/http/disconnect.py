"""Cancel a request's work when its client goes away (non-streaming requests; a
streaming response watches for itself, ``api/http/sse.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")
POLL_S = 0.05
CLIENT_CLOSED_REQUEST = 499
"""The status a request ends with when its client left first (nginx's, for logs and
metrics; nobody reads it)."""


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; the work was cancelled. The app
    answers it with ``CLIENT_CLOSED_REQUEST`` (``errors.py``), so the request ends as a
    counted status rather than an exception the server logs as an error."""


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
    close contexts and free pages) and raise ``ClientDisconnected``. A cancellation from
    outside (server shutdown) stays a ``CancelledError``."""
    task = asyncio.ensure_future(work)
    left = False

    async def watch() -> None:
        nonlocal left
        await _wait_for_disconnect(request)
        left = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if left and task.cancelled() and not (current is not None and current.cancelling()):
            raise ClientDisconnected() from None
        raise
    finally:
        watcher.cancel()
