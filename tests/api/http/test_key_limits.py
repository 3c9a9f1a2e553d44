"""Per-key limits as token buckets: a key bursts up to its minute's figure, then goes at the
steady rate; tokens are charged after the fact and an overdrawn bucket refuses until it
refills; a key without limits is never counted."""

from __future__ import annotations

import pytest

from api.http.errors import ServiceError
from api.http.security.key_limits import KeyLimiter, _Bucket, check_storage
from api.http.security.tenancy import Caller, KeyLimits


def test_bucket_refills_at_the_per_minute_rate() -> None:
    b = _Bucket(rate_per_s=1.0, capacity=60.0, level=0.0, stamp=100.0)
    b.refill(130.0)
    assert b.level == 30.0 and b.wait_s(31) == pytest.approx(1.0)
    b.refill(1000.0)
    assert b.level == 60.0  # never past the minute's figure


def test_limits_refuse_with_retry_after() -> None:
    lim = KeyLimiter()
    c = Caller(
        "c", "c", limits=KeyLimits(requests_per_minute=2, max_concurrent_streams=1, tokens_per_minute=60)
    )
    lim.admit(c, generation=True)
    with pytest.raises(ServiceError) as e:
        lim.admit(c, generation=True)
    assert e.value.code == "too_many_streams" and e.value.retry_after == 1
    lim.release(c)
    lim.charge_tokens(c, 200)  # overdrawn: ~140 tokens short at 1 token/s
    with pytest.raises(ServiceError) as e:
        lim.admit(c, generation=True)
    assert e.value.code == "rate_limit_exceeded" and 130 <= e.value.retry_after <= 142
    lim.admit(c, generation=False)  # a plain request spends no tokens, only its request
    with pytest.raises(ServiceError) as e:
        lim.admit(c, generation=False)  # the 3rd request within the minute
    assert e.value.code == "rate_limit_exceeded"
    free = Caller("f", "f")
    for _ in range(1000):
        lim.admit(free, generation=True)
    assert lim.streams(free) == 0  # no limits: nothing kept


def test_storage_limit() -> None:
    c = Caller("c", "c", limits=KeyLimits(max_stored_bytes=100))
    check_storage(c, 60, 40)
    with pytest.raises(ServiceError) as e:
        check_storage(c, 60, 41)
    assert e.value.code == "storage_limit_exceeded" and e.value.details["limit"] == 100
    check_storage(Caller("u", "u"), 10**12, 10**12)
