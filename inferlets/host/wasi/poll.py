"""``wasi:io/poll``: pollables made by the host (Pie's futures, clocks, streams) and the
``poll`` a guest's asyncio loop blocks in. The guest thread sleeps on the run's
``Waiter`` (a condition) until something it polls is ready: a host future completes
(``Waiter.wake`` from a done-callback), a clock deadline passes, or the run is cancelled
or out of time; it never spins."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from inferlets.host.binding import Interface, Resource, wit

MAX_WAIT_S = 1.0


class Waiter:
    """One per run: what ``poll`` sleeps on."""

    def __init__(self, check: Callable[[], None], deadline: Callable[[], float]):
        self.cond = threading.Condition()
        self.check = check
        self.deadline = deadline  # the run's deadline, time.monotonic() seconds
        self.polls = 0

    def wake(self, *_: object) -> None:
        with self.cond:
            self.cond.notify_all()


class Pollable(Resource):
    """Ready when ``ready()`` says so, or at ``deadline_ns`` (monotonic ns) if given."""

    WIT = ("wasi:io/poll", "pollable")
    __slots__ = ("_ready", "deadline_ns")

    def __init__(self, ready: Callable[[], bool] | None = None, deadline_ns: int | None = None):
        self._ready = ready
        self.deadline_ns = deadline_ns

    def is_ready(self) -> bool:
        if self.deadline_ns is not None and time.monotonic_ns() >= self.deadline_ns:
            return True
        return self._ready is not None and self._ready()

    def __repr__(self) -> str:
        return f"Pollable(ready={self.is_ready()})"


def always() -> Pollable:
    return Pollable(lambda: True)


class Poll(Interface):
    NAME = "wasi:io/poll"
    RESOURCES = (Pollable,)

    @wit("poll")
    def poll(self, pollables: list[Pollable]) -> list[int]:
        if not pollables:
            raise ValueError("poll: the list of pollables is empty")
        waiter: Waiter = self.host.waiter
        waiter.polls += 1
        with waiter.cond:
            while True:
                ready = [i for i, p in enumerate(pollables) if p.is_ready()]
                if ready:
                    return ready
                waiter.check()  # cancelled or out of time: ends the run
                now = time.monotonic()
                timeout = min(MAX_WAIT_S, max(0.0, waiter.deadline() - now) + 0.001)
                dls = [p.deadline_ns for p in pollables if p.deadline_ns is not None]
                if dls:
                    timeout = min(timeout, max(0.0, (min(dls) - time.monotonic_ns()) / 1e9))
                waiter.cond.wait(timeout)

    @wit("[method]pollable.ready")
    def ready(self, p: Pollable) -> bool:
        return p.is_ready()

    @wit("[method]pollable.block")
    def block(self, p: Pollable) -> None:
        self.poll([p])
