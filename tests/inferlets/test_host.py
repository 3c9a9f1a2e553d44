"""Inferlet host: the guest's greedy output equals the engine's, token for token; the CLI
prints sends then the result; concurrent inferlets share the scheduler's batched passes."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from inferlets import InferletRuntime, InvalidComponentError
from tests.inferlets import direct


def test_chat_equals_engine(rt, wasm, model) -> None:
    async def main():
        out = await rt.run_async(wasm, ["chat", "tiny", "Describe a cat.", "12"])
        assert out == await direct.chat(model, "Describe a cat.", 12)

    asyncio.run(main())


def test_best_of_sends_each_branch(rt, wasm, model) -> None:
    async def main():
        sends: list[str] = []
        out = await rt.run_async(wasm, ["best-of", "tiny", "Hi", "6", "3"], on_send=sends.append)
        want = await direct.chat(model, "Hi", 6)
        assert sends == [want] * 3  # greedy forks of one prefill agree
        assert out == want

    asyncio.run(main())


def test_cached_component_and_bad_bytes(rt, wasm) -> None:
    key, comp = rt.component(wasm)
    assert rt.component(wasm.read_bytes()) == (key, comp)  # in memory by content hash
    fresh = InferletRuntime(rt.models, rt.cache_dir.parent)
    assert fresh.component(wasm)[0] == key  # a second runtime deserializes the cached file
    assert list(rt.cache_dir.glob(f"{key}-*.cwasm"))
    with pytest.raises(InvalidComponentError):
        rt.component(b"\0asm not really")


@pytest.mark.parametrize(
    ("wat", "says"),
    [
        ("(component)", "no run function"),
        ('(component (import "pie:media/host@0.1.0" (instance (export "f" (func)))))', "does not fit"),
    ],
)
def test_component_of_another_world_is_typed(rt, wat, says) -> None:
    import wasmtime

    with pytest.raises(InvalidComponentError, match=says):
        asyncio.run(rt.run_async(wasmtime.wat2wasm(wat), []))


def test_cli_run_prints_sends_then_result(wasm, model, capsys) -> None:
    import subprocess
    import sys

    from api.cli import main

    cmd = [sys.executable, "-m", "api.cli", "inferlet", "run", str(wasm), "--model", "tiny", "--"]
    r = subprocess.run([*cmd, "best-of", "tiny", "Hi", "4", "2"], capture_output=True, text=True, timeout=120)
    want = asyncio.run(direct.chat(model, "Hi", 4))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [want] * 3
    # In-process from here on (no second interpreter start): typed errors exit 2 with
    # their code, messages reach receive().
    assert main(["inferlet", "run", str(wasm), "--model", "tiny", "--", "forged"]) == 2
    assert "inferlet_bad_handle" in capsys.readouterr().err
    png = base64.b64encode(direct.png()).decode()
    args = ["inferlet", "run", str(wasm), "--model", "tiny", "--message", png, "--wall-s", "30"]
    assert main([*args, "--", "image-qa", "tiny", "What?", "3", "-"]) == 0
    facts, answer = capsys.readouterr().out.splitlines()
    assert json.loads(facts)["kind"] == "image" and len(json.loads(answer)["tokens"]) == 3


@pytest.mark.parametrize("n", [8, 16])
def test_concurrent_inferlets_share_forward_passes(rt, wasm, model, n) -> None:
    """n guests generating 8 tokens each: the scheduler batches their steps, so passes
    are far fewer than steps (serial would be one step per pass)."""
    stats = model.scheduler.stats

    async def main():
        p0, s0, m0 = stats.passes, stats.steps, stats.max_steps_in_pass
        stats.max_steps_in_pass = 0
        runs = [rt.run_async(wasm, ["chat", "tiny", f"Prompt {i}", "8"]) for i in range(n)]
        outs = await asyncio.gather(*runs)
        counted = stats.passes - p0, stats.steps - s0, stats.max_steps_in_pass
        stats.max_steps_in_pass = max(m0, stats.max_steps_in_pass)
        for i, out in enumerate(outs):
            assert out == await direct.chat(model, f"Prompt {i}", 8)
        return counted

    passes, steps, widest = asyncio.run(main())
    assert widest >= n // 2, (widest, n)
    assert passes < steps / 2, (passes, steps)


def test_two_inferlets_share_passes(rt, wasm, model) -> None:
    """Two at once is enough to batch: a best-of-3 and a beam search, both on the tiny
    model, run fewer passes together than their steps."""
    stats = model.scheduler.stats

    async def main():
        p0, s0, m0 = stats.passes, stats.steps, stats.max_steps_in_pass
        stats.max_steps_in_pass = 0
        await asyncio.gather(
            rt.run_async(wasm, ["best-of", "tiny", "One", "8", "3"]),
            rt.run_async(wasm, ["chat", "tiny", "Two", "8"]),
        )
        got = stats.passes - p0, stats.steps - s0, stats.max_steps_in_pass
        stats.max_steps_in_pass = max(m0, stats.max_steps_in_pass)
        return got

    passes, steps, widest = asyncio.run(main())
    assert widest >= 2 and passes < steps, (passes, steps, widest)


def test_the_epoch_ticks_only_while_a_run_is_in_flight(rt, wasm) -> None:
    """An idle host does not wake 100 times a second; a run's deadline still advances."""
    import time

    ticker = rt._ticker
    time.sleep(0.05)  # a tick begun by an earlier test's run lands
    before = ticker.ticks
    time.sleep(0.3)
    assert ticker.ticks == before  # idle: the thread sleeps
    with ticker:  # held as a run holds it
        time.sleep(0.3)
        assert ticker.ticks - before >= 5
    assert asyncio.run(rt.run_async(wasm, ["chat", "tiny", "Describe a cat.", "4"]))  # holds, lets go
    idle = ticker.ticks
    time.sleep(0.3)
    assert ticker.ticks - idle <= 1  # at most the tick that was sleeping when the run ended


def test_forwarded_hands_every_outcome_to_the_waiting_thread() -> None:
    """``state.forwarded`` (how ``execute`` hands a pass's outcome to the guest's thread):
    the result, the error, or a cancellation of the task each reach the future;
    cancelling the future itself leaves the task running."""
    import concurrent.futures
    import threading

    from inferlets.host.state import forwarded

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:

        async def value() -> int:
            await asyncio.sleep(0)
            return 7

        async def failing() -> None:
            raise ValueError("bad pass")

        async def forever() -> None:
            await asyncio.sleep(3600)

        def start(coro):
            run, out = forwarded(coro)
            task = asyncio.run_coroutine_threadsafe(_wrap(run), loop).result(5)
            return task, out

        async def _wrap(run):
            return asyncio.ensure_future(run)

        _, out = start(value())
        assert out.result(5) == 7
        _, out = start(failing())
        with pytest.raises(ValueError, match="bad pass"):
            out.result(5)
        task, out = start(forever())
        assert not out.cancel()  # running: the guest's drop does not stop the pass
        assert not task.done()
        loop.call_soon_threadsafe(task.cancel)
        with pytest.raises(concurrent.futures.CancelledError):
            out.result(5)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
