"""Per-key limits: requests per minute, tokens per minute, concurrent streams and stored
bytes. Over one, the answer is 429 with Retry-After in OpenAI's error shape
(``rate_limit_exceeded`` / ``too_many_streams`` / ``storage_limit_exceeded``).

Rates are token buckets (capacity: the per-minute figure, refilled continuously), so a
key may burst up to its minute's worth and then goes at the steady rate. Generated and
prompt tokens are charged when a request finishes (its usage is only known then); a
request is admitted while the key's token bucket is above zero, so one long answer can
overdraw it and the next requests wait until it refills. Each server process (replica)
keeps its own buckets: N replicas let a key through up to N times its figures.

Retry-After is when the refusal would end: a bucket's refill time for the rates, and for
``max_concurrent_streams`` when the key's first request in flight is likely to end (the
median of its recent requests' durations less that request's age; 1 s before any has
ended).

Written by hand: the limits hang on our own key identities and answer in OpenAI's shape,
which a general ASGI rate-limit package would not know."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from api.http.errors import RECENT_DURATIONS, ServiceError, error_response, retry_after_estimate
from api.http.security.tenancy import Caller

GENERATION_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/v1/audio/speech",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
    }
)
"""Requests that hold a stream (count against ``max_concurrent_streams``) and spend tokens."""


@dataclass
class _Bucket:
    rate_per_s: float
    capacity: float
    level: float
    stamp: float = field(default_factory=time.monotonic)

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate_per_s)
        self.stamp = now

    def wait_s(self, need: float) -> float:
        """Seconds until the bucket holds ``need``."""
        return max(0.0, (need - self.level) / self.rate_per_s)


@dataclass
class _KeyState:
    requests: _Bucket | None = None
    tokens: _Bucket | None = None
    streams: int = 0
    started: list[float] = field(default_factory=list)
    """When each of its generation requests in flight began (monotonic)."""
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_DURATIONS))
    """How long its recent generation requests held their stream slot."""


class KeyLimiter:
    """The limit state of one server process, per key name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: dict[str, _KeyState] = {}

    def _of(self, caller: Caller) -> _KeyState:
        st = self._state.get(caller.name)
        if st is None:
            st = self._state[caller.name] = _KeyState()
        lim = caller.limits
        for attr, per_minute in (("requests", lim.requests_per_minute), ("tokens", lim.tokens_per_minute)):
            bucket = getattr(st, attr)
            if per_minute is None:
                setattr(st, attr, None)
            elif bucket is None or bucket.capacity != per_minute:  # new, or the key file changed
                setattr(st, attr, _Bucket(per_minute / 60.0, float(per_minute), float(per_minute)))
        return st

    def admit(self, caller: Caller, *, generation: bool, count_request: bool = True) -> float | None:
        """Count one request (and, for ``generation``, check the token bucket and take a
        stream slot, given back by ``release``); ``ServiceError`` (429) past a limit. Returns
        the slot's start (pass it to ``release``), None when no slot was taken.
        ``count_request=False``: the request was counted already (by the middleware)."""
        lim = caller.limits
        if not lim.any:
            return None
        now = time.monotonic()
        with self._lock:
            st = self._of(caller)
            if (
                generation
                and lim.max_concurrent_streams is not None
                and st.streams >= lim.max_concurrent_streams
            ):
                retry = retry_after_estimate(st.started, st.durations, now)
                raise ServiceError(
                    "too_many_streams",
                    f"the key {caller.name!r} has {st.streams} requests in flight, its limit; "
                    f"retry when one ends (likely in {retry} s)",
                    retry_after=retry,
                    limit=lim.max_concurrent_streams,
                )
            if st.requests is not None and count_request:
                st.requests.refill(now)
                if st.requests.level < 1:
                    raise _rate_error(caller, "requests", st.requests.wait_s(1), lim.requests_per_minute)
            if generation and st.tokens is not None:
                st.tokens.refill(now)
                if st.tokens.level <= 0:
                    raise _rate_error(caller, "tokens", st.tokens.wait_s(1), lim.tokens_per_minute)
            if st.requests is not None and count_request:
                st.requests.level -= 1
            if generation:
                st.streams += 1
                st.started.append(now)
                return now
            return None

    def release(self, caller: Caller, started: float | None = None) -> None:
        """A generation request admitted by ``admit`` (which returned ``started``) ended."""
        if caller.limits.max_concurrent_streams is None and not caller.limits.any:
            return
        with self._lock:
            st = self._state.get(caller.name)
            if st is not None and st.streams > 0:
                st.streams -= 1
                if started is None and st.started:
                    started = st.started[0]  # unknown: the oldest (keeps the list in step)
                if started is not None and started in st.started:
                    st.started.remove(started)
                    st.durations.append(time.monotonic() - started)

    def admit_run(self, caller: Caller, *, count_request: bool = True) -> Callable[[int], None]:
        """Admit an inferlet run (or one request to a daemon) for ``caller``: a stream slot,
        checked against the token bucket (and the request, with ``count_request``);
        ``ServiceError`` (429) past a limit. Returns ``done(tokens)``, to call once when it
        ends: the slot back, the tokens it generated charged to the key."""
        started = self.admit(caller, generation=True, count_request=count_request)
        if started is None:
            return lambda tokens: None
        spent = [False]

        def done(tokens: int) -> None:
            if not spent[0]:
                spent[0] = True
                self.release(caller, started)
                self.charge_tokens(caller, tokens)

        return done

    def charge_tokens(self, caller: Caller, n: int) -> None:
        """A finished request spent ``n`` tokens (prompt + generated)."""
        if caller.limits.tokens_per_minute is None or n <= 0:
            return
        with self._lock:
            st = self._of(caller)
            assert st.tokens is not None
            st.tokens.refill(time.monotonic())
            st.tokens.level -= n

    def streams(self, caller: Caller) -> int:
        with self._lock:
            st = self._state.get(caller.name)
            return st.streams if st is not None else 0


def _rate_error(caller: Caller, what: str, wait_s: float, per_minute: int | None) -> ServiceError:
    return ServiceError(
        "rate_limit_exceeded",
        f"the key {caller.name!r} is over its {per_minute} {what} per minute; retry after "
        f"{math.ceil(wait_s)} s",
        retry_after=max(1, math.ceil(wait_s)),
        limit=per_minute,
    )


def check_storage(caller: Caller, used: int, adding: int) -> None:
    """``storage_limit_exceeded`` (429) when ``adding`` bytes would take the key's tenant
    past its ``max_stored_bytes`` (deleting stored objects makes room)."""
    limit = caller.limits.max_stored_bytes
    if limit is None or used + adding <= limit:
        return
    raise ServiceError(
        "storage_limit_exceeded",
        f"the key {caller.name!r} stores {used} bytes; {adding} more would pass its limit of {limit} "
        "bytes. Delete uploads or files to make room",
        retry_after=60,
        limit=limit,
        actual=used + adding,
    )


class KeyLimitsMiddleware:
    """Admits every keyed /v1 request against its key's limits before the app sees it, and
    holds a generation request's stream slot until its response (a stream included) ends.
    The key is identified here from the header (a hash and constant-time compares, as the
    bearer check does); requests without a valid key pass through to be refused there."""

    def __init__(
        self,
        app: ASGIApp,
        identify: Callable[[str | None], Caller | None],
        limiter: KeyLimiter,
        on_request: Callable[[Caller], None] | None = None,
        on_limited: Callable[[Caller, str], None] | None = None,
    ):
        self.app, self.identify, self.limiter = app, identify, limiter
        self.on_request, self.on_limited = on_request, on_limited

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        caller = self.identify(header)
        if caller is not None and self.on_request is not None:
            self.on_request(caller)
        if caller is None or not caller.limits.any:
            await self.app(scope, receive, send)
            return
        generation = scope.get("method") == "POST" and path in GENERATION_PATHS
        try:
            started = self.limiter.admit(caller, generation=generation)
        except ServiceError as e:
            if self.on_limited is not None:
                self.on_limited(caller, e.code)
            await error_response(e)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            if generation:
                self.limiter.release(caller, started)
