"""The HTTP service's run table bounds how many inferlet runs go at once: past the cap a
launch is a 429 ``queue_full`` at once (never queued without bound); a cancelled run frees
its slot.

It lives here, not in tests/api/http, because it runs wasmtime in the test process: that
must come after tests/api/test_ray_captions.py starts Ray in-process, since Ray replaces the
signal handlers wasmtime installed first and a guest trap (SIGILL) then kills the process.
The server and the inferlet CLI never run Ray in their process."""

from __future__ import annotations

import asyncio

import pytest

from api.http.errors import ServiceError
from api.http.runs.inferlets import RunTable


def test_running_runs_are_capped(rt, wasm, model) -> None:
    table = RunTable(max_running=2)
    waiting = ["video-qa", "tiny", "?", "2", "2", "-"]  # waits in receive() for its video

    async def main() -> None:
        runs = [table.start(rt, "inferlet-x", wasm, waiting, rt.limits, [], False) for _ in range(2)]
        with pytest.raises(ServiceError) as e:
            table.start(rt, "inferlet-x", wasm, waiting, rt.limits, [], False)
        assert e.value.code == "queue_full" and e.value.retry_after == 1
        table.cancel(runs[0])
        await asyncio.wait_for(runs[0].task, 30)
        assert runs[0].status == "cancelled"
        again = table.start(rt, "inferlet-x", wasm, ["ping", "3"], rt.limits, [], True)  # a slot is free
        await asyncio.wait_for(again.task, 30)
        assert again.status == "succeeded" and again.result == "3"
        await table.shutdown()
        assert all(r.done for r in runs)

    in_use = model.pool.stats().in_use  # contexts other tests saved keep theirs
    asyncio.run(main())
    assert model.pool.stats().in_use == in_use
