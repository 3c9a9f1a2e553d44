"""How many speech requests a model runs at once: KV pages, real time, and an optional cap.

A new stream is admitted only if all of these hold with it:

- **pages**: the request is promised the pages it can ever hold (its prompt plus every
  frame ``max_duration`` allows), so a running stream never meets a full pool. Pages
  shared through the prefix cache are still promised in full: the promise is an upper
  bound, never an overdraft.
- **time**: every frame pass gives each running stream one frame, so with ``n`` streams
  each waits one pass of ``n`` rows per frame. The stream is admitted only if the frame
  time predicted for the resulting batch (``speech.frame_timing.FrameTiming``: measured
  from the real passes, seeded at load) is at most the audio length of one frame times
  ``safety`` (the server's default 0.8: 64 ms per 80 ms frame), so no running stream falls
  behind real time. A lone stream is always admitted (nothing runs that it could slow
  down, and waiting would not make it faster); before any frame pass is measured the rule
  admits. ``safety=None`` turns the rule off: an offline batch job wants the biggest
  batches the pages allow, not real time (``SpeechModel.load``'s default; the server's
  ``--speech-realtime-safety`` is on).
- **max_streams** (optional, None: "auto"): a fixed upper bound on streams.

Past any of them the HTTP endpoint answers 429 with Retry-After at once (``wait=False``)
and the error says which bound (``details['reason']``: "pages", "time" or
"max_streams"); blocking callers (the CLI, inferlets, scripts) wait for a slot, up to a
deadline. ``headroom()`` says how many voices fit now and which bound stops more; the
admitted / refused counts by reason are kept for /metrics.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from speech.errors import InvalidDurationError, SpeechBusyError
from speech.frame_timing import FrameTiming

RETRY_AFTER_S = 1
DEFAULT_WAIT_S = 300.0
DEFAULT_SAFETY = 0.8
REASONS = ("max_streams", "pages", "time")
HEADROOM_SCAN = 4096
"""The time bound is searched up to this many streams."""


class SpeechTicket:
    """A held admission; ``release()`` is idempotent."""

    def __init__(self, capacity: SpeechCapacity, pages: int):
        self.capacity = capacity
        self.pages = pages
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.capacity._give_back(self.pages)

    def __enter__(self) -> SpeechTicket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"SpeechTicket(pages={self.pages}, held={self._held})"


@dataclass(frozen=True)
class Headroom:
    """How many streams fit (running ones included) and which bound says so."""

    running: int
    fit: int
    """Streams that can run at once now: the smallest of the bounds below."""
    bound: str
    """The bound that sets ``fit``: "pages", "time" or "max_streams"."""
    by_pages: int
    """Running streams plus requests of ``stream_pages`` pages each that the free pages hold."""
    by_time: int | None
    """The most streams whose predicted frame time keeps real time (None: nothing measured)."""
    max_streams: int | None
    stream_pages: int
    frame_ms: float | None
    """Predicted frame time at ``fit`` streams (None: nothing measured)."""
    budget_ms: float | None
    """Frame audio length times the safety factor (None: no time rule)."""

    @property
    def more(self) -> int:
        return max(0, self.fit - self.running)


class SpeechCapacity:
    """Streams, promised pages and (with ``timing``) the real-time rule of one speech model.

    ``stream_pages``: pages of a typical request, used only by ``headroom()`` to count how
    many more such requests the free pages hold (the model passes a request without
    ``max_duration``); ``admit`` promises each request its own pages."""

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_streams: int | None = None,
        timing: FrameTiming | None = None,
        safety: float | None = DEFAULT_SAFETY,
        stream_rows: int | None = None,
    ):
        if safety is not None and not 0 < safety <= 1:
            raise ValueError(f"safety must be in (0, 1] (a share of a frame's audio length), got {safety}")
        if max_streams is not None and max_streams < 1:
            raise ValueError(f"max_streams must be >= 1 or None (auto), got {max_streams}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_streams = max_streams
        self.timing = timing
        self.safety = safety
        self.stream_pages = self.pages_for(stream_rows) if stream_rows else 1
        self.streams = 0
        self.pages_promised = 0
        self.admitted = 0
        self.refused = dict.fromkeys(REASONS, 0)
        """Requests refused at once (``wait=False`` or a wait that timed out), by bound."""
        self.waited = dict.fromkeys(REASONS, 0)
        """Blocking requests that had to wait for a slot, by the bound they first met."""
        self._cond = threading.Condition()

    def pages_for(self, rows: int) -> int:
        return -(-rows // self.page_size)

    @property
    def budget_seconds(self) -> float | None:
        """The longest frame pass that keeps real time (None: no time rule)."""
        if self.timing is None or self.safety is None:
            return None
        return self.timing.frame_seconds * self.safety

    def admit(self, rows: int, *, wait: bool, timeout: float = DEFAULT_WAIT_S) -> SpeechTicket:
        """A ticket for a request of at most ``rows`` KV rows, or ``SpeechBusyError``."""
        pages = self.pages_for(rows)
        if pages > self.num_pages:
            raise InvalidDurationError(
                f"this request needs up to {pages} KV pages and the model has {self.num_pages}; "
                "lower max_duration or shorten the context",
                needed_pages=pages,
                limit=self.num_pages,
            )
        deadline = time.monotonic() + timeout
        first_reason = None
        with self._cond:
            while (reason := self._refusal(pages)) is not None:
                first_reason = first_reason or reason
                left = deadline - time.monotonic()
                if not wait or left <= 0:
                    self.refused[reason] += 1
                    raise SpeechBusyError(
                        self._busy_message(reason, pages),
                        retry_after=RETRY_AFTER_S,
                        limit=self.max_streams,
                        reason=reason,
                    )
                self._cond.wait(left)
            if first_reason is not None:
                self.waited[first_reason] += 1
            self.streams += 1
            self.pages_promised += pages
            self.admitted += 1
        return SpeechTicket(self, pages)

    def _in_time(self, streams: int) -> bool:
        budget = self.budget_seconds
        if streams <= 1 or budget is None:
            return True
        assert self.timing is not None
        predicted = self.timing.predict(streams)
        return predicted is None or predicted <= budget

    def _refusal(self, pages: int) -> str | None:
        """The bound a new stream of ``pages`` pages would break now (None: it fits)."""
        if self.max_streams is not None and self.streams >= self.max_streams:
            return "max_streams"
        if self.pages_promised + pages > self.num_pages:
            return "pages"
        if not self._in_time(self.streams + 1):
            return "time"
        return None

    def _busy_message(self, reason: str, pages: int) -> str:
        retry = f"retry after {RETRY_AFTER_S} s"
        if reason == "max_streams":
            return (
                f"the speech model is running {self.streams} of at most {self.max_streams} streams; {retry}"
            )
        if reason == "pages":
            return (
                f"the speech model has {self.pages_promised} of {self.num_pages} KV pages promised to "
                f"{self.streams} streams and this request needs {pages} more; {retry}"
            )
        assert self.timing is not None and self.budget_seconds is not None
        n = self.streams + 1
        predicted = self.timing.predict(n) or 0.0
        return (
            f"the speech model is running {self.streams} streams; with one more, a frame pass of {n} "
            f"would take ~{predicted * 1e3:.1f} ms (measured) against {self.budget_seconds * 1e3:.1f} ms "
            f"({self.safety:g} x the {self.timing.frame_seconds * 1e3:.0f} ms frame), so every stream "
            f"would fall behind real time; {retry}"
        )

    def _give_back(self, pages: int) -> None:
        with self._cond:
            self.streams -= 1
            self.pages_promised -= pages
            self._cond.notify_all()

    def time_bound(self, limit: int = HEADROOM_SCAN) -> int | None:
        """The most streams (>= 1) whose predicted frame time keeps real time, searched up to
        ``limit`` (None: no time rule, or nothing measured yet)."""
        if self.budget_seconds is None or self.timing is None or not self.timing.measured:
            return None
        n = 1
        while n < limit and self._in_time(n + 1):
            n += 1
        return n

    def headroom(self) -> Headroom:
        """How many voices fit now, and why no more: pages, time or the ``max_streams`` cap."""
        with self._cond:
            running, promised = self.streams, self.pages_promised
        by_pages = running + max(0, self.num_pages - promised) // self.stream_pages
        limit = min(by_pages, self.max_streams or by_pages, HEADROOM_SCAN)
        by_time = self.time_bound(limit + 1)
        bounds = [(by_pages, "pages")]
        if by_time is not None:
            bounds.append((by_time, "time"))
        if self.max_streams is not None:
            bounds.append((self.max_streams, "max_streams"))
        fit, bound = min(bounds, key=lambda b: b[0])
        predicted = self.timing.predict(max(fit, 1)) if self.timing is not None else None
        return Headroom(
            running=running,
            fit=fit,
            bound=bound,
            by_pages=by_pages,
            by_time=by_time,
            max_streams=self.max_streams,
            stream_pages=self.stream_pages,
            frame_ms=predicted * 1e3 if predicted is not None else None,
            budget_ms=self.budget_seconds * 1e3 if self.budget_seconds is not None else None,
        )

    def __repr__(self) -> str:
        h = self.headroom()
        time_part = ""
        if h.budget_ms is not None:
            frame = f"~{h.frame_ms:.1f}" if h.frame_ms is not None else "unmeasured"
            time_part = f", frame {frame}/{h.budget_ms:.1f} ms at {h.fit}"
        cap = self.max_streams if self.max_streams is not None else "auto"
        return (
            f"SpeechCapacity({self.streams} streams running, {h.fit} fit (bound: {h.bound}; "
            f"pages {h.by_pages}, time {h.by_time if h.by_time is not None else '-'}, max {cap}), "
            f"{self.pages_promised}/{self.num_pages} pages promised{time_part})"
        )
