"""How long a frame takes, learned from the speech model's real passes, and how far ahead
of real time each stream runs.

``FrameTiming`` keeps a running mean (the plain mean of a size's first passes, then
exponential with weight ``EMA_WEIGHT`` for the newest pass) of the wall time of a *frame pass* at each batch size: a scheduler pass whose steps
are all frames (one backbone row and the frame head each; ``TimedRunner`` times them, and
skips passes that carry prompt prefill). Every stream of such a pass gets one frame out
of it, so a pass of ``n`` streams must take at most the audio length of one frame
(``1 / frame_rate``: 80 ms for Mimi at 12.5 Hz) for all ``n`` to keep up with real time.

``predict(n)`` assumes a pass never gets faster with more rows (so any larger measured
size's time bounds it) and never gets cheaper per row with more rows (so any smaller
measured size's time, scaled by ``n / size``, bounds it), and takes the tightest of these
bounds and ``n``'s own mean. For a size never measured that errs on the side of keeping
streams real time (no batching gain is assumed past the largest size measured); for a
measured size it keeps one slow pass (a shared CPU's hiccup, a new shape's first run) at
the frontier from shutting admission at that size for good: the frontier is run again
only if admission lets it, so its own mean alone would never be corrected.

``warm_up`` seeds the table at load: after a throwaway lone request (a fresh model's
first passes pay one-time costs), 1, 4 and 16 requests of three frames at once, until a
size is clearly too slow (twice the budget: a size just over it may be one slow pass on
a shared machine, which the larger sizes' times then bound). That is about 0.4 s for the
tiny CSM on a CPU; at CSM-1B's shape on a CPU, one lone request's three frames (already
too slow). It stops at 16 because the prefill of many prompts at once costs more than
the frames (64 tiny prompts: 0.5 s on a CPU); past 16 the prediction assumes no batching
gain until real passes at those sizes are measured, so a server's admission grows with
the load it has actually run.

``StreamPace`` measures what the table predicts: each stream's audio seconds generated
per wall second from its first frame to its latest (the real-time margin; >= 1 keeps
up), live for running streams and as a histogram over finished ones.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

from engine import Histogram

EMA_WEIGHT = 0.2
"""Weight of the newest pass in a size's running mean."""
MARGIN_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0)
"""Histogram bounds of the real-time margin (audio seconds per wall second)."""
WARM_UP_FRAMES = 3
"""Frames per warm-up request: the first comes from the prefill pass, the rest are frame passes."""
WARM_UP_MAX_BATCH = 16
WARM_UP_GROWTH = 4
"""Warm-up batch sizes: 1, 4, 16 (other sizes are predicted from these until run)."""
WARM_UP_TEXT = "Warm up."
WARM_UP_GIVE_UP = 2.0
"""The warm-up stops at a size whose frame pass takes this many times the budget."""


class FrameTiming:
    """Running mean of a frame pass's seconds per batch size (thread-safe: the forward
    worker writes, admission reads)."""

    def __init__(self, frame_seconds: float, *, ema_weight: float = EMA_WEIGHT):
        if not frame_seconds > 0:
            raise ValueError(f"frame_seconds must be > 0, got {frame_seconds}")
        self.frame_seconds = float(frame_seconds)
        self.ema_weight = ema_weight
        self._sizes: list[int] = []  # sorted
        self._mean: dict[int, float] = {}
        self._passes: dict[int, int] = {}
        self._lock = threading.Lock()

    def observe(self, batch: int, seconds: float) -> None:
        with self._lock:
            if batch in self._mean:  # a plain mean over the first passes, then exponential
                self._passes[batch] += 1
                weight = max(self.ema_weight, 1.0 / self._passes[batch])
                self._mean[batch] += weight * (seconds - self._mean[batch])
            else:
                bisect.insort(self._sizes, batch)
                self._mean[batch] = seconds
                self._passes[batch] = 1

    def clear(self) -> None:
        with self._lock:
            self._sizes.clear()
            self._mean.clear()
            self._passes.clear()

    def table(self) -> dict[int, tuple[float, int]]:
        """``{batch size: (mean seconds, passes measured)}``."""
        with self._lock:
            return {n: (self._mean[n], self._passes[n]) for n in self._sizes}

    @property
    def measured(self) -> bool:
        return bool(self._sizes)

    def predict(self, batch: int) -> float | None:
        """Seconds of a frame pass of ``batch`` streams (None: nothing measured yet): the
        tightest bound the measured sizes give (see the module docstring)."""
        with self._lock:
            if not self._sizes:
                return None
            i = bisect.bisect_left(self._sizes, batch)
            above = [self._mean[m] for m in self._sizes[i:]]  # not slower than a larger size
            below = [
                self._mean[m] * batch / m for m in self._sizes[: bisect.bisect_right(self._sizes, batch)]
            ]
            return min(above + below)  # (below: not cheaper per row than a smaller size)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, (s, _) in self.table().items())
        return f"FrameTiming({self.frame_seconds * 1e3:.0f} ms frames; {sizes or 'nothing measured'})"


def is_frame_step(step: Any) -> bool:
    """One backbone row asking for a frame (a stream's next frame, not a prefill chunk)."""
    return len(step.tokens) == 1 and step.logits == "head"


class TimedRunner:
    """The scheduler's runner, timing every pass made only of frame steps into ``timing``.
    Everything else is the wrapped runner's (attributes are read through)."""

    def __init__(self, runner: Any, timing: FrameTiming):
        self.runner = runner
        self.timing = timing

    def run(self, steps: Sequence[Any]) -> Any:
        start = time.perf_counter()
        out = self.runner.run(steps)  # frame results are host lists: the device work is done
        if steps and all(is_frame_step(s) for s in steps):
            self.timing.observe(len(steps), time.perf_counter() - start)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


class StreamClock:
    """One stream's frames against the wall clock (``StreamPace.start``)."""

    def __init__(self, pace: StreamPace):
        self.pace = pace
        self.frames = 0
        self.first = 0.0
        self.last = 0.0

    def frame(self) -> None:
        now = time.perf_counter()
        if self.frames == 0:
            self.first = now
        self.last = now
        self.frames += 1

    def margin(self) -> float | None:
        """Audio seconds per wall second since the first frame (None before two frames)."""
        if self.frames < 2 or self.last <= self.first:
            return None
        return (self.frames - 1) * self.pace.frame_seconds / (self.last - self.first)

    def close(self) -> None:
        self.pace._end(self)


class StreamPace:
    """Real-time margins: of the running streams (live) and of finished ones (histogram)."""

    def __init__(self, frame_seconds: float):
        self.frame_seconds = frame_seconds
        self.running: set[StreamClock] = set()
        self.finished = Histogram(bounds=MARGIN_BUCKETS, counts=[0] * (len(MARGIN_BUCKETS) + 1))
        self.finished_behind = 0
        """Finished streams whose margin was below 1 (slower than real time)."""
        self._lock = threading.Lock()

    def start(self) -> StreamClock:
        clock = StreamClock(self)
        with self._lock:
            self.running.add(clock)
        return clock

    def _end(self, clock: StreamClock) -> None:
        with self._lock:
            if clock not in self.running:
                return
            self.running.discard(clock)
            margin = clock.margin()
            if margin is not None:
                self.finished.observe(margin)
                self.finished_behind += margin < 1.0

    def running_margins(self) -> list[float]:
        with self._lock:
            clocks = list(self.running)
        return [m for m in (c.margin() for c in clocks) if m is not None]


async def _drain(frames: Any) -> None:
    async for _ in frames:
        pass


def warm_up(model: Any, *, max_batch: int, budget_seconds: float) -> None:
    """Seed ``model.timing`` with real frame passes (see the module docstring). ``model`` is a
    ``speech.model.SpeechModel`` (not imported: it builds on this); its counters are put
    back afterwards, so the warm-up shows in no request statistic."""
    from engine import run_sync
    from speech.frames import frames

    stats = dataclasses.replace(model.stats)
    passes = dataclasses.replace(model.scheduler.stats)
    job_pages = model.capacity.pages_for(len(model.prepare(WARM_UP_TEXT, 0).rows) + WARM_UP_FRAMES)
    max_batch = max(1, min(max_batch, model.pool.num_pages // job_pages))

    def round_of(batch: int, n_frames: int) -> None:
        jobs = [
            model.prepare(WARM_UP_TEXT, 0, max_duration=n_frames / model.frame_rate, temperature=0)
            for _ in range(batch)
        ]

        async def all_at_once() -> None:
            await asyncio.gather(*(_drain(frames(model, job)) for job in jobs))

        run_sync(all_at_once())

    try:
        round_of(1, 2)  # a fresh model's first passes pay one-time costs: not a measure
        model.timing.clear()
        batch = 1
        while batch <= max_batch:
            round_of(batch, WARM_UP_FRAMES)
            measured = model.timing.predict(batch)
            if measured is None or measured > WARM_UP_GIVE_UP * budget_seconds:
                break
            batch *= WARM_UP_GROWTH
    finally:
        model.stats = stats
        model.scheduler.stats = passes
