"""``wasi:clocks/monotonic-clock``'s two pollable makers (``now`` and ``resolution`` stay
wasmtime's: the same clock, ``time.monotonic_ns`` here being CLOCK_MONOTONIC too)."""

from __future__ import annotations

import time

from inferlets.host.binding import Interface, wit
from inferlets.host.wasi.poll import Pollable


class MonotonicClock(Interface):
    NAME = "wasi:clocks/monotonic-clock"

    @wit("subscribe-duration")
    def subscribe_duration(self, ns: int) -> Pollable:
        return Pollable(None, time.monotonic_ns() + int(ns))

    @wit("subscribe-instant")
    def subscribe_instant(self, at: int) -> Pollable:
        return Pollable(None, int(at))
