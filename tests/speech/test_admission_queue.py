"""The speech admission queue (``speech.admission``): whole clips are not held to real time,
waiters queue FIFO with a bound and a deadline, nobody is left waiting without an answer,
and Retry-After is estimated from the running requests' frame budgets.

- a whole clip (``streamed=False``) joins the batch past the time bound; a stream is still
  refused, and a whole clip waits while a stream it would slow down runs;
- the queue is bounded (a full one refuses with ``reason: queue``), first in first out, and
  each wait ends by its deadline with a ``SpeechBusyError`` naming the bound and the wait;
- a waiter that leaves (deadline, cancellation) wakes the ones behind it, and one cancelled
  in the instant it was admitted gives its ticket back;
- ``SpeechModel.speak_async`` cancelled while it waits gives its place back: it used to wait
  on a worker thread, which took the slot later for nobody and kept it for good;
- Retry-After plays the running tickets' remaining frames forward at the measured pass time.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from speech import SpeechBusyError, SpeechCapacity, SpeechModel
from speech.admission import RECHECK_S
from speech.frame_timing import FrameTiming


def _timing() -> FrameTiming:
    """8 streams keep real time at 0.8 (60 ms of 64), 9 do not (67.5 ms)."""
    timing = FrameTiming(0.080)
    timing.observe(1, 0.010)
    timing.observe(4, 0.030)
    return timing


def test_whole_clips_join_the_batch_past_the_time_bound_and_streams_are_refused() -> None:
    cap = SpeechCapacity(num_pages=1000, page_size=4, timing=_timing(), safety=0.8)
    whole = [cap.admit(8, wait=False, streamed=False) for _ in range(12)]  # no stream to slow down
    assert cap.streams == 12 and cap.streamed == 0
    with pytest.raises(SpeechBusyError) as e:
        cap.admit(8, wait=False)  # a stream would run at 13 x 7.5 ms: behind real time
    assert e.value.reason == "time" and cap.refused["time"] == 1
    for t in whole:
        t.release()
    stream = cap.admit(8, wait=False)
    running = [cap.admit(8, wait=False, streamed=False) for _ in range(7)]  # 8 in all: in time
    with pytest.raises(SpeechBusyError) as e:  # a 9th would put the stream behind
        cap.admit(8, wait=False, streamed=False)
    assert e.value.reason == "time"

    async def queued() -> None:
        waiter = asyncio.create_task(cap.admit_async(8, streamed=False, timeout=10))
        await asyncio.sleep(0.05)
        assert not waiter.done() and cap.waiting().count == 1
        stream.release()  # no stream runs now: the whole clip joins at once
        ticket = await asyncio.wait_for(waiter, 5)
        assert cap.streams == 8 and cap.waited["time"] == 1
        ticket.release()

    asyncio.run(queued())
    for t in running:
        t.release()
    assert (cap.streams, cap.streamed, cap.pages_promised) == (0, 0, 0)


def test_the_queue_is_bounded_first_in_first_out_and_every_wait_has_a_deadline() -> None:
    cap = SpeechCapacity(num_pages=100, page_size=4, max_streams=1, queue_size=2, wait_s=0.3)

    async def main() -> None:
        held = cap.admit(8, wait=False)
        first = asyncio.create_task(cap.admit_async(8, timeout=10))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(cap.admit_async(8, timeout=10))
        await asyncio.sleep(0.05)
        with pytest.raises(SpeechBusyError) as e:  # two wait: the queue is full
            await cap.admit_async(8)
        assert e.value.code == "queue_full" and e.value.reason == "queue" and e.value.retry_after >= 1
        assert cap.refused["queue"] == 1
        waiting = cap.waiting()
        assert waiting.count == 2 and waiting.longest_s > 0
        held.release()
        got = await asyncio.wait_for(first, 5)  # first in, first out
        assert not second.done()
        got.release()
        (await asyncio.wait_for(second, 5)).release()
        assert cap.waiting().count == 0 and cap.waits.n == 2
        # a wait ends by its deadline (the capacity's wait_s), with the bound and the wait
        held = cap.admit(8, wait=False)
        start = time.monotonic()
        with pytest.raises(SpeechBusyError) as e:
            await cap.admit_async(8)
        waited = time.monotonic() - start
        assert 0.3 <= waited < 0.3 + RECHECK_S + 1.0
        assert e.value.reason == "max_streams" and e.value.waited_s >= 0.3 and "waited" in e.value.message
        assert cap.timed_out["max_streams"] == 1 and cap.waiting().count == 0
        held.release()

    asyncio.run(main())
    assert (cap.streams, cap.pages_promised) == (0, 0)


def test_a_head_that_gives_up_wakes_the_one_behind_it() -> None:
    """A big request at the head waits for pages; a small one behind it would fit but keeps
    its place. When the head's deadline passes, the small one gets in then: not at its own
    deadline, and without any ticket coming back."""
    cap = SpeechCapacity(num_pages=10, page_size=1)
    held = cap.admit(6, wait=False)
    results: dict[str, object] = {}

    def wait(name: str, rows: int, timeout: float) -> None:
        try:
            results[name] = cap.admit(rows, wait=True, timeout=timeout)
        except SpeechBusyError as e:
            results[name] = e
        results[name + "_at"] = time.monotonic()

    big = threading.Thread(target=wait, args=("big", 8, 0.3))
    big.start()
    time.sleep(0.05)
    small = threading.Thread(target=wait, args=("small", 2, 20))
    small.start()
    time.sleep(0.1)
    assert "small" not in results and cap.waiting().count == 2  # first in, first out
    big.join(5)
    small.join(5)
    assert not small.is_alive()
    assert isinstance(results["big"], SpeechBusyError) and results["big"].reason == "pages"
    ticket = results["small"]
    assert not isinstance(ticket, SpeechBusyError)
    assert results["small_at"] - results["big_at"] < 0.5  # woken when the head left
    ticket.release()
    held.release()
    assert (cap.streams, cap.pages_promised) == (0, 0)


def test_a_waiter_cancelled_when_it_was_admitted_gives_the_ticket_back() -> None:
    cap = SpeechCapacity(num_pages=100, page_size=4, max_streams=1)

    async def main() -> None:
        held = cap.admit(8, wait=False)
        waiter = asyncio.create_task(cap.admit_async(8, timeout=10))
        await asyncio.sleep(0.05)
        held.release()  # admits the waiter now (its wake-up is on its way) ...
        assert cap.streams == 1
        waiter.cancel()  # ... and its client leaves before it runs
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert cap.streams == 0 and cap.waiting().count == 0
        # and one cancelled while it waits leaves the queue
        held = cap.admit(8, wait=False)
        waiter = asyncio.create_task(cap.admit_async(8, timeout=10))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert cap.waiting().count == 0
        held.release()
        assert cap.streams == 0

    asyncio.run(main())


@pytest.fixture(scope="module")
def one_stream(tiny_dir):
    return SpeechModel.load(tiny_dir("tiny-csm"), device="cpu", max_streams=1)


def test_speak_async_cancelled_while_it_waits_gives_its_place_back(one_stream) -> None:
    model = one_stream

    async def main() -> None:
        job = model.prepare("The first voice.", 0, max_duration=0.4, temperature=0)
        held = model.admit(job, wait=False)
        waiting = asyncio.create_task(model.speak_async("The second voice.", 1, max_duration=0.4))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        waiting.cancel()  # its client left
        with pytest.raises(asyncio.CancelledError):
            await waiting
        held.release()
        await asyncio.sleep(0.5)  # a waiter left behind would take the slot now
        assert model.capacity.streams == 0
        again = model.prepare("The third voice.", 2, max_duration=0.4, temperature=0)
        clip = await model.clip_async(again, model.admit(again, wait=False))
        assert len(clip.codes)

    asyncio.run(main())
    assert model.capacity.streams == 0 and model.pool.stats().in_use == 0


def test_retry_after_is_played_forward_from_the_frame_budgets() -> None:
    timing = FrameTiming(0.080)
    timing.observe(1, 0.010)  # 10 ms a frame pass of one
    cap = SpeechCapacity(num_pages=100, page_size=4, max_streams=1, timing=timing, safety=None)
    running = cap.admit(8, wait=False, frames=500)  # 500 frames left: 5 s
    with pytest.raises(SpeechBusyError) as e:
        cap.admit(8, wait=False)
    assert e.value.retry_after == 5 and e.value.reason == "max_streams"
    running.done = 300  # 200 frames left: 2 s (no pace measured: the predicted frame pass)
    with pytest.raises(SpeechBusyError) as e:
        cap.admit(8, wait=False)
    assert e.value.retry_after == 2
    got = []
    ahead = threading.Thread(target=lambda: got.append(cap.admit(8, wait=True, timeout=10, frames=400)))
    ahead.start()
    deadline = time.monotonic() + 5
    while cap.waiting().count == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(SpeechBusyError) as e:  # behind the waiter: 2 s, then its 400 frames
        cap.admit(8, wait=False)
    assert e.value.retry_after == 6
    running.release()
    ahead.join(5)
    got[0].release()
    with pytest.raises(SpeechBusyError) as e:  # a running request of unknown budget: 1 s
        held = cap.admit(8, wait=False)
        cap.admit(8, wait=False)
    assert e.value.retry_after == 1
    held.release()
