"""Cancel a request's work when its client goes away (non-streaming requests; a
streaming response is cancelled by Starlette itself)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")
POLL_S = 0.05


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it (its ``finally`` blocks
    close contexts and free pages) and raise ``CancelledError``."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not task.done():
            if await request.is_disconnected():
                task.cancel()
                return
            await asyncio.sleep(POLL_S)

    watcher = asyncio.create_task(watch())
    try:
        return await task
    finally:
        watcher.cancel()
