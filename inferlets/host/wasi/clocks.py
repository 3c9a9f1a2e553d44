"""``wasi:clocks/monotonic-clock``, all of it the host's: ``now`` and both pollable makers
read one clock (``time.monotonic_ns``), so a guest's absolute deadline
(``subscribe-instant(now() + d)``, what CPython's ``time.sleep`` asks for) is one this host
understands. wasmtime's own ``now`` counts from when the run's WASI context was made, so
beside the host's pollables a sleep of any length ended at once."""

from __future__ import annotations

import time

from inferlets.host.binding import Interface, wit
from inferlets.host.wasi.poll import Pollable

RESOLUTION_NS = max(1, round(time.get_clock_info("monotonic").resolution * 1e9))


class MonotonicClock(Interface):
    NAME = "wasi:clocks/monotonic-clock"

    @wit("now")
    def now(self) -> int:
        return time.monotonic_ns()

    @wit("resolution")
    def resolution(self) -> int:
        return RESOLUTION_NS

    @wit("subscribe-duration")
    def subscribe_duration(self, ns: int) -> Pollable:
        return Pollable(None, time.monotonic_ns() + int(ns))

    @wit("subscribe-instant")
    def subscribe_instant(self, at: int) -> Pollable:
        return Pollable(None, int(at))
