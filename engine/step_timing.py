"""Where a decode step's host time goes: named phases timed on both threads, off by default.

``bench/host_overhead.py`` (CPU, a stand-in forward) and ``bench/gpu/profile_decode.py``
(the GPU) switch it on around the passes they measure and print the totals per pass:

* the forward worker: the pass as a whole, building its inputs (index tensors, the copy to
  the device), the model (eager) or the graph replay with its flashinfer planning, the
  sampling with its device-to-host read;
* the event loop: the hop from the worker's pass end to the loop taking the results, handing
  them to the contexts, each context's emission (detokenization, stop checks, logprobs) and
  the building and submission of its next step.

What the event loop spends besides (asyncio's own scheduling, the consumers of the streams)
is the loop's busy time less these phases: ``bench/host_overhead.py`` reports it from the
loop thread's CPU time. A disabled timer costs one attribute read per phase. torch.profiler
sees kernels, not this: which of our Python steps the host spends its time in.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class StepTiming:
    """Seconds and counts per phase name; ``on`` switches recording."""

    def __init__(self) -> None:
        self.on = False
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self.seconds[name] += seconds
            self.counts[name] += 1

    def reset(self) -> None:
        with self._lock:
            self.seconds.clear()
            self.counts.clear()

    @contextmanager
    def recording(self) -> Iterator[StepTiming]:
        """Record (from zero) for the body's duration."""
        self.reset()
        self.on = True
        try:
            yield self
        finally:
            self.on = False

    def per_pass(self, passes: int) -> dict[str, float]:
        """Milliseconds per pass for each phase, largest first."""
        if passes <= 0:
            return {}
        rows = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        return {name: round(1e3 * s / passes, 4) for name, s in rows}

    def __repr__(self) -> str:
        state = "on" if self.on else "off"
        return f"StepTiming({state}, {len(self.seconds)} phases)"


TIMING = StepTiming()
"""The process's phase timer (one engine per process is the common case; a bench that runs
several models reads the totals between them)."""


def start() -> float:
    """A phase's start time when recording, else 0.0 (then ``stop`` records nothing)."""
    return time.perf_counter() if TIMING.on else 0.0


def stop(name: str, t0: float) -> None:
    if t0:
        TIMING.add(name, time.perf_counter() - t0)


def stop_at(name: str, t0: float, end: float) -> None:
    """Record the phase from ``t0`` to ``end`` (another thread's time), never below zero: a
    pass the worker began before it was asked for (a staged one) waited none."""
    if t0 and end:
        TIMING.add(name, max(0.0, end - t0))
