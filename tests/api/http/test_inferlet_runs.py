"""The run table bounds how many inferlet runs go at once: past the cap a launch is a
429 ``queue_full`` at once (never queued without bound); a cancelled run frees its slot."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from api.http.errors import ServiceError
from api.http.inferlet_runs import RunTable

EXAMPLES = Path(__file__).resolve().parents[3] / "inferlets" / "examples"


def test_running_runs_are_capped(tmp_path: Path) -> None:
    from api.model_ref import load_model
    from fixtures.paths import cache_root
    from inferlets import InferletRuntime, build_component

    wasm = build_component(EXAMPLES, cache_root() / "inferlets-build")
    model = load_model("tiny", device="cpu")
    rt = InferletRuntime({"tiny": model}, cache_root())
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

    asyncio.run(main())
    assert model.pool.stats().in_use == 0
