"""Admission sized from the measured frame time (``speech.admission``, ``speech.frame_timing``).

- the frame-time table is learned from the model's real passes: every pass made only of
  frame steps is recorded at its batch size, prefill passes are not; the warm-up at load
  seeds it without touching any request statistic or page;
- the prediction for sizes not measured is the tightest bound the measured ones give, and
  admission refuses the stream that would put the batch past real time (x safety), by
  reason, with counts; a blocking caller waits for the slot instead;
- with a safety factor that makes the tiny model's real measured frame time too slow, a
  second stream is refused for time ("time"), the lone stream never is, and ``headroom``
  and the repr say so;
- each stream's real-time margin is measured from its frames.

Nothing here asserts a duration: the timing tests check which passes were recorded and
what admission decides from the recorded values.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest

from speech import SpeechBusyError, SpeechCapacity, SpeechModel
from speech.frame_timing import FrameTiming, is_frame_step

TEXTS = [f"Stream {i} speaks its own line." for i in range(3)]
FRAMES = 5
SECONDS = FRAMES / 12.5


@pytest.fixture(scope="module")
def unwarmed(tiny_dir):
    """The real-time rule on, nothing measured at load."""
    return SpeechModel.load(tiny_dir("tiny-csm"), device="cpu", realtime_safety=0.8, warm_up_frames=False)


@pytest.fixture(scope="module")
def too_slow(tiny_dir):
    """A budget of 80 ns per frame: every real pass of the tiny model counts as too slow."""
    return SpeechModel.load(tiny_dir("tiny-csm"), device="cpu", realtime_safety=1e-6)


def test_the_table_is_learned_from_the_real_frame_passes(unwarmed) -> None:
    model = unwarmed
    assert not model.timing.measured and model.timing.predict(1) is None
    assert model.capacity.headroom().by_time is None  # nothing measured: the rule admits
    passes: list[list] = []
    run = model.scheduler._run

    def counted(steps):
        passes.append(list(steps))
        return run(steps)

    jobs = [model.prepare(t, i, max_duration=SECONDS, temperature=0) for i, t in enumerate(TEXTS)]
    tickets = [model.admit(job, wait=False) for job in jobs]  # nothing measured: all admitted

    async def together() -> list:
        return await asyncio.gather(*(model.clip_async(j, t) for j, t in zip(jobs, tickets, strict=True)))

    model.scheduler._run = counted  # an instance attribute over the method: records, then runs it
    try:
        clips = asyncio.run(together())
    finally:
        del model.scheduler._run
    assert all(len(c.codes) for c in clips)
    frame_passes = Counter(len(p) for p in passes if all(is_frame_step(s) for s in p))
    prefill_passes = [p for p in passes if not all(is_frame_step(s) for s in p)]
    assert prefill_passes and frame_passes  # both kinds ran; only frame passes are recorded
    table = model.timing.table()
    assert {n: count for n, (_, count) in table.items()} == dict(frame_passes)
    assert 3 in table  # the three streams shared their frame passes
    for n, (seconds, _) in table.items():
        assert seconds > 0 and model.timing.predict(n) <= seconds
    # every stream's margin was measured from its frames
    assert model.pace.finished.n == len(TEXTS) and model.pace.finished.total > 0
    assert not model.pace.running
    assert model.capacity.admitted == len(TEXTS) and sum(model.capacity.refused.values()) == 0


def test_the_warm_up_seeds_the_table_and_leaves_no_trace(too_slow) -> None:
    model = too_slow
    assert 1 in model.timing.table()  # measured at load
    assert model.stats.requests == model.stats.frames == model.scheduler.stats.passes == 0
    assert model.pool.stats().in_use == 0 and model.capacity.streams == 0
    assert model.pace.finished.n == 0 and model.capacity.admitted == 0


def test_prediction_is_the_tightest_bound_of_the_measured_sizes() -> None:
    timing = FrameTiming(0.080)
    timing.observe(1, 0.010)
    timing.observe(4, 0.030)
    assert timing.predict(4) == pytest.approx(0.030)
    assert timing.predict(2) == pytest.approx(0.020)  # 2 x the one-stream time, under 4's
    assert timing.predict(3) == pytest.approx(0.030)  # 4's time, under 3 x 0.010
    assert timing.predict(8) == pytest.approx(0.060)  # no batching gain past 4
    timing.observe(1, 0.050)  # one slow pass at 1 (a plain mean over the first passes)
    assert timing.table()[1] == pytest.approx((0.030, 2))
    assert timing.predict(1) == pytest.approx(0.030)  # not slower than 4 streams
    timing.observe(2, 0.500)  # a hiccup at the frontier does not shut size 2 for good
    assert timing.predict(2) == pytest.approx(0.030)


def test_admission_refuses_the_stream_that_would_fall_behind_real_time() -> None:
    timing = FrameTiming(0.080)
    timing.observe(1, 0.010)
    timing.observe(4, 0.030)  # predicted: 8 streams 60 ms, 9 streams 67.5 ms
    cap = SpeechCapacity(num_pages=100, page_size=4, timing=timing, safety=0.8, stream_rows=8)
    room = cap.headroom()
    assert (room.fit, room.bound, room.by_time, room.by_pages) == (8, "time", 8, 50)
    assert room.budget_ms == pytest.approx(64.0) and room.frame_ms == pytest.approx(60.0)
    assert "8 fit (bound: time" in repr(cap)
    tickets = [cap.admit(8, wait=False) for _ in range(8)]
    with pytest.raises(SpeechBusyError) as e:
        cap.admit(8, wait=False)
    assert e.value.code == "queue_full" and e.value.retry_after == 1 and e.value.reason == "time"
    assert "real time" in e.value.message and "9" in e.value.message
    assert cap.refused == {"max_streams": 0, "pages": 0, "time": 1, "queue": 0} and cap.admitted == 8
    assert cap.headroom().more == 0
    tickets.pop().release()
    tickets.append(cap.admit(8, wait=False))  # the freed slot fits again
    for t in tickets:
        t.release()
    # the rule at a looser safety, and the other bounds keep their order
    loose = SpeechCapacity(num_pages=100, page_size=4, timing=timing, safety=1.0, stream_rows=8)
    assert loose.headroom().by_time == 10  # 10 x 7.5 ms = 75 ms <= 80 ms
    capped = SpeechCapacity(num_pages=6, page_size=4, max_streams=2, timing=timing, stream_rows=8)
    a = capped.admit(8, wait=False)
    with pytest.raises(SpeechBusyError) as e:
        capped.admit(20, wait=False)  # 2 + 5 pages > 6
    assert e.value.reason == "pages"
    b = capped.admit(8, wait=False)
    with pytest.raises(SpeechBusyError) as e:
        capped.admit(1, wait=False)
    assert e.value.reason == "max_streams" and capped.headroom().bound == "max_streams"
    a.release()
    b.release()


def test_a_lone_stream_is_admitted_and_a_second_waits_or_is_refused_for_time(too_slow) -> None:
    """With the tiny model's real measured frame time counted as too slow, one stream runs
    (nothing to protect) and a second would put both behind real time."""
    model = too_slow
    room = model.capacity.headroom()
    assert (room.fit, room.bound, room.by_time) == (1, "time", 1)
    assert "1 fit (bound: time" in repr(model)
    job = model.prepare("The first voice.", 0, max_duration=SECONDS, temperature=0)
    ticket = model.admit(job, wait=False)
    with pytest.raises(SpeechBusyError) as e:
        model.admit(model.prepare("The second voice.", 1, max_duration=SECONDS), wait=False)
    assert e.value.reason == "time" and e.value.retry_after == 1
    assert model.capacity.refused["time"] == 1
    got = []
    second = model.prepare("The second voice.", 1, max_duration=SECONDS, temperature=0)
    waiter = threading.Thread(target=lambda: got.append(model.admit(second, wait=True, timeout=60)))
    waiter.start()
    waiter.join(0.2)
    assert not got  # waiting for the slot
    codes = asyncio.run(model.clip_async(job, ticket)).codes  # the first stream runs, then frees it
    waiter.join(60)
    assert got and len(codes) and model.capacity.waited["time"] == 1
    clip = asyncio.run(model.clip_async(second, got[0]))
    assert len(clip.codes) and model.capacity.streams == 0
    assert model.pool.stats().in_use == 0
