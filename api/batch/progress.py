"""The batch job's counters and its progress bar (tqdm on stderr): samples/s, tokens/s,
errors, ETA, how much of the run the engine waited for input (``input_wait``: it had room
for another sample and none was prepared yet) and how much it had nothing at all to do
(``idle``: no caption in flight while the job was not finished)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class JobSummary:
    total: int = 0
    skipped: int = 0
    captioned: int = 0
    reused: int = 0
    """Records written from an earlier caption of the same content (no model run)."""
    errors: int = 0
    earlier_errors: int = 0
    """Samples skipped because an earlier run recorded an error for them."""
    torn_bytes: int = 0
    """Bytes of torn last lines cut from the journals at start."""
    elapsed_s: float = 0.0
    tokens: int = 0
    records: int = 0
    shards: int = 0
    shards_skipped: int = 0
    idle_s: float = 0.0
    """Time (after the first sample arrived) with no caption in flight."""
    input_wait_s: float = 0.0
    """Time the engine had room for another sample but none was prepared yet (the job
    waited on an empty input queue with a free slot): preparation falling behind."""
    files: list[str] = field(default_factory=list)

    @property
    def idle_fraction(self) -> float:
        return self.idle_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def input_wait_fraction(self) -> float:
        return self.input_wait_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def failed(self) -> int:
        return self.errors + self.earlier_errors


class EngineClock:
    """Counts the time the engine has nothing in flight."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.idle_s = 0.0
        self._idle_since: float | None = None
        self.started: float | None = None

    def begin(self) -> None:
        now = time.perf_counter()
        if self.started is None:
            self.started = now
        if self.in_flight == 0 and self._idle_since is not None:
            self.idle_s += now - self._idle_since
            self._idle_since = None
        self.in_flight += 1

    def end(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle_since = time.perf_counter()

    def stop(self) -> None:
        self._idle_since = None


class Progress:
    def __init__(
        self,
        enabled: bool,
        total: int | None,
        summary: JobSummary,
        clock: EngineClock,
        input_wait: Callable[[], float] = lambda: 0.0,
    ):
        """``input_wait()``: the seconds so far the engine had a free slot and waited for a
        prepared sample (``Pipeline.waited_s``)."""
        self.summary, self.clock, self.input_wait = summary, clock, input_wait
        self.bar: Any = None
        self._t0 = time.perf_counter()
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, unit="sample", dynamic_ncols=True, desc="caption")

    def advance(self, n: int = 1) -> None:
        if self.bar is None:
            return
        s = self.summary
        elapsed = max(1e-9, time.perf_counter() - self._t0)
        self.bar.set_postfix(
            tok_s=f"{s.tokens / elapsed:.1f}",
            errors=s.errors,
            skipped=s.skipped,
            input_wait=f"{100 * self.input_wait() / elapsed:.0f}%",
            idle=f"{100 * self.clock.idle_s / elapsed:.0f}%",
            refresh=False,
        )
        self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
