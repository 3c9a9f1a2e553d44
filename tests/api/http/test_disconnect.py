"""cancel_on_disconnect: one waiting receive once the body is read, no receive at all
while it is not (a body message is the route's), and the work cancelled when the client
leaves."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from api.http.disconnect import ClientDisconnected, cancel_on_disconnect

SCOPE = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}


class Client:
    """The server side of one request: body messages, then a disconnect when told."""

    def __init__(self, chunks: list[bytes]):
        self.pending = [
            {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
            for i, c in enumerate(chunks)
        ]
        self.left = asyncio.Event()
        self.calls = 0

    async def receive(self) -> dict:
        self.calls += 1
        if self.pending:
            return self.pending.pop(0)
        await self.left.wait()
        return {"type": "http.disconnect"}


def test_a_read_body_means_one_waiting_receive_and_the_work_is_cancelled():
    async def main():
        client = Client([b'{"a":', b"1}"])
        request = Request(SCOPE, client.receive)
        assert await request.body() == b'{"a":1}'
        calls_after_body = client.calls
        work = asyncio.Event()
        cancelled = []

        async def generate():
            try:
                await work.wait()
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        answer = asyncio.ensure_future(cancel_on_disconnect(request, generate()))
        await asyncio.sleep(0.3)  # six polls' worth: a poller would have called receive
        assert client.calls == calls_after_body + 1
        client.left.set()
        with pytest.raises(ClientDisconnected):
            await asyncio.wait_for(answer, 5)
        assert cancelled == [True]

    asyncio.run(main())


def test_an_unread_body_is_left_to_the_route():
    async def main():
        client = Client([b"abc", b"def", b"ghi"])
        request = Request(SCOPE, client.receive)

        calls_seen = []

        async def route_reads_its_body():
            await asyncio.sleep(0.2)  # the watcher runs first and must not take a chunk
            calls_seen.append(client.calls)
            body = await request.body()  # three receives that never suspend
            calls_seen.append(client.calls)
            return body

        got = await asyncio.wait_for(cancel_on_disconnect(request, route_reads_its_body()), 5)
        # Counted inside the route: once the body is read the watcher may make its one
        # waiting receive before the route's result is collected, which is allowed.
        assert got == b"abcdefghi" and calls_seen == [0, 3]

    asyncio.run(main())


def test_a_body_read_later_then_a_client_that_leaves():
    async def main():
        client = Client([b"abc"])
        request = Request(SCOPE, client.receive)
        read = asyncio.Event()

        async def route():
            await request.body()
            read.set()
            await asyncio.Event().wait()  # generates until cancelled

        answer = asyncio.ensure_future(cancel_on_disconnect(request, route()))
        await asyncio.wait_for(read.wait(), 5)
        client.left.set()
        with pytest.raises(ClientDisconnected):
            await asyncio.wait_for(answer, 5)

    asyncio.run(main())


def test_a_cancellation_from_outside_stays_a_cancellation():
    """Server shutdown cancels the request's task: that is not the client leaving, and
    it must not be turned into an answer."""

    async def main():
        client = Client([b"{}"])
        request = Request(SCOPE, client.receive)
        await request.body()
        started = asyncio.Event()

        async def work():
            started.set()
            await asyncio.Event().wait()

        answer = asyncio.ensure_future(cancel_on_disconnect(request, work()))
        await asyncio.wait_for(started.wait(), 5)
        answer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await answer

    asyncio.run(main())


def test_work_that_finishes_first_is_returned_and_the_watcher_stops():
    async def main():
        client = Client([b"{}"])
        request = Request(SCOPE, client.receive)
        await request.body()

        async def quick():
            return 42

        assert await cancel_on_disconnect(request, quick()) == 42
        await asyncio.sleep(0.05)
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    asyncio.run(main())
