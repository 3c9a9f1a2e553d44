"""Retry-After is an estimate of when the refusal ends, not a fixed second: a served model's
``queue_full``, a key's ``too_many_streams`` and the inferlet runs' ``queue_full`` say when
their first request in flight is likely to end (the median of recent durations less its
age), 1 s before anything has been measured; the header is whole seconds, at least 1.
(The speech model's own estimate is checked against a real server in
test_speech_admission_queue.py.)"""

from __future__ import annotations

import time

import pytest

from api.http.errors import ServiceError, error_response, retry_after_estimate
from api.http.registry import ServedModel
from api.http.runs.inferlets import RunRecord, RunTable
from api.http.security.key_limits import KeyLimiter
from api.http.security.tenancy import Caller, KeyLimits


def test_the_estimate_is_the_median_duration_less_the_oldest_age() -> None:
    assert retry_after_estimate([100.0], [], now=101.0) == 1  # nothing measured yet
    assert retry_after_estimate([100.0, 103.0], [6.0, 8.0, 30.0], now=104.0) == 4  # 8 - 4
    assert retry_after_estimate([100.0], [6.0], now=110.0) == 1  # past the median: any moment
    response = error_response(ServiceError("queue_full", "busy", retry_after=2.2))
    assert response.headers["retry-after"] == "3"  # whole seconds, never early


def test_a_full_model_says_when_its_first_request_is_likely_to_end() -> None:
    served = ServedModel(name="m", model=None, kind="chat", max_concurrency=1)
    a = served.admit()
    with pytest.raises(ServiceError) as e:
        served.admit()
    assert e.value.code == "queue_full" and e.value.retry_after == 1  # no request has ended yet
    served._durations.extend([7.0, 7.0, 7.0])  # recent requests held their slot 7 s
    with pytest.raises(ServiceError) as e:
        served.admit()
    assert e.value.retry_after == 7 and "retry after 7 s" in e.value.message
    a.release()
    assert served.in_flight == 0 and len(served._durations) == 4 and served._durations[-1] < 1
    b = served.admit()
    served._started[b.number] -= 5.0  # it began 5 s ago; the median is 7 s
    with pytest.raises(ServiceError) as e:
        served.admit()
    assert e.value.retry_after == 2
    b.release()
    b.release()  # idempotent
    assert served.in_flight == 0 and not served._started


def test_a_key_at_its_stream_limit_says_when_a_stream_is_likely_to_end() -> None:
    lim = KeyLimiter()
    c = Caller("c", "c", limits=KeyLimits(max_concurrent_streams=1))
    started = lim.admit(c, generation=True)
    with pytest.raises(ServiceError) as e:
        lim.admit(c, generation=True)
    assert e.value.code == "too_many_streams" and e.value.retry_after == 1  # nothing measured
    lim._state["c"].durations.extend([12.0, 12.0])
    with pytest.raises(ServiceError) as e:
        lim.admit(c, generation=True)
    assert e.value.retry_after == 12
    lim.release(c, started)
    assert lim.streams(c) == 0 and lim._state["c"].started == [] and len(lim._state["c"].durations) == 3


def test_the_inferlet_runs_say_when_a_run_is_likely_to_end() -> None:
    table = RunTable(max_running=1)
    now = int(time.time())
    for i in range(3):  # finished runs of 20 s
        table._runs[f"done-{i}"] = RunRecord(
            id=f"done-{i}",
            inferlet_id="x",
            args=[],
            created_at=now - 100,
            status="succeeded",
            finished_at=now - 80,
        )
    assert table.retry_after() == 1  # nothing runs
    table._runs["running"] = RunRecord(id="running", inferlet_id="x", args=[], created_at=now - 5)
    assert 14 <= table.retry_after() <= 16  # 20 s runs, this one 5 s in
