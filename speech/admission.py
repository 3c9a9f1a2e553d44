"""How many speech requests a model runs at once: KV pages, real time, an optional cap, and
a bounded queue with a deadline for the requests that may wait.

A new request is admitted only if all of these hold with it:

- **pages**: the request is promised the pages it can ever hold (its prompt plus every
  frame ``max_duration`` allows), so a running stream never meets a full pool. Pages
  shared through the prefix cache are still promised in full: the promise is an upper
  bound, never an overdraft.
- **time** (streamed responses, and any request while streamed ones run): every frame
  pass gives each running request one frame, so with ``n`` of them each waits one pass of
  ``n`` rows per frame. A *streamed* request (``streamed=True``: a listener plays it as it
  comes) is admitted only if the frame time predicted for the resulting batch
  (``speech.frame_timing.FrameTiming``: measured from the real passes, seeded at load) is
  at most the audio length of one frame times ``safety`` (the server's default 0.8: 64 ms
  per 80 ms frame), so no running stream falls behind real time. A whole-clip request
  (``streamed=False``) has no real-time deadline of its own: it joins the batch whatever
  the frame time, unless streamed requests are running that it would push behind real
  time. A lone request is always admitted (nothing runs that it could slow down, and
  waiting would not make it faster); before any frame pass is measured the rule admits.
  ``safety=None`` turns the rule off (``SpeechModel.load``'s default, for offline batches).
- **max_streams** (optional, None: "auto"): a fixed upper bound on requests running.

Past a bound a request either is refused at once (``wait=False``: the HTTP endpoint's
streamed responses) or waits in a FIFO queue of at most ``queue_size`` waiters (whole-clip
HTTP answers, and the blocking callers: the CLI, inferlets, scripts) until it fits or its
deadline (``wait_s``, default 30 s) passes; a full queue or a passed deadline is a
``SpeechBusyError`` (429) whose ``details['reason']`` says which bound ("pages", "time",
"max_streams", or "queue" for a full queue). Nobody waits without an answer:

- every change of state this class owns re-runs the queue (``_pump``) under its one lock:
  a ticket given back on any path, a waiter admitted, and a waiter that leaves (its
  deadline passed, its task cancelled): a big request at the head that gives up must not
  leave a small one behind it asleep;
- the one input it does not own, the measured frame time, is re-read by every waiter at
  least every ``RECHECK_S``;
- a waiter that is cancelled (its client left) leaves the queue, and if it was admitted in
  the same instant its ticket is given back at once: an admission never outlives its
  waiter. (Before, async callers waited on a thread of the loop's default pool, up to
  300 s: a cancelled caller left that thread waiting, the ticket it took later was never
  given back, so the model lost a slot and its pages for good and every later waiter slept
  to its deadline; and the waiting threads held the pool that the server's encodes and
  media decodes run on.)

Retry-After (``SpeechBusyError.retry_after``, whole seconds, at least 1) is estimated, not
fixed: each running ticket ends after its remaining frame budget at its own measured pace
(the seconds between its last frames: the frame passes as this machine runs them now,
whatever else it runs), the waiters ahead are admitted as they fit and run theirs, until
the refused request would fit (``_eta``). Budgets are upper bounds (a clip may end early at
its end frame), so while the machine keeps its pace the estimate errs late, not early.

``headroom()`` says how many voices fit now and which bound stops more; the admitted /
refused / waited counts by reason, the queue (``waiting()``) and a histogram of waits are
kept for /metrics.
"""

from __future__ import annotations

import asyncio
import heapq
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine import Histogram
from speech.errors import InvalidDurationError, SpeechBusyError
from speech.frame_timing import FrameTiming

MIN_RETRY_AFTER_S = 1
DEFAULT_WAIT_S = 30.0
"""How long a request waits for admission before it is refused (429 with Retry-After)."""
DEFAULT_QUEUE_SIZE = 32
"""Requests that may wait for admission at once; past it a request is refused at once."""
DEFAULT_SAFETY = 0.8
REASONS = ("max_streams", "pages", "time", "queue")
HEADROOM_SCAN = 4096
"""The time bound is searched up to this many streams."""
RECHECK_S = 0.25
"""A waiter re-reads the measured frame time at least this often (the time rule's input
changes with every measured pass, which is no event of this class)."""
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ETA_STEPS = 100_000
"""Events the Retry-After estimate plays forward at most."""
PACE_FRAMES = 128
"""A request's pace is measured over its last this many frames."""


def retry_after_s(seconds: float | None) -> int:
    """Whole seconds for Retry-After: the nearest to ``seconds``, at least 1 (1: unknown)."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return MIN_RETRY_AFTER_S
    return max(MIN_RETRY_AFTER_S, round(seconds))


class SpeechTicket:
    """A held admission; ``release()`` is idempotent and thread-safe. ``frame()`` counts the
    frames generated under it (the Retry-After estimate reads the budget left)."""

    def __init__(
        self, capacity: SpeechCapacity, pages: int, *, frames: int | None = None, streamed: bool = True
    ):
        self.capacity = capacity
        self.pages = pages
        self.frames = frames
        """Frames this request may generate at most (None: unknown)."""
        self.streamed = streamed
        self.done = 0
        """Frames generated so far."""
        self._stamps: deque[float] = deque(maxlen=PACE_FRAMES + 1)
        self._held = True

    @property
    def held(self) -> bool:
        return self._held

    def frame(self) -> None:
        self._stamps.append(time.perf_counter())
        self.done += 1

    @property
    def pace(self) -> float | None:
        """Seconds between its frames over its last ``PACE_FRAMES`` (None before two frames)."""
        stamps = self._stamps
        if len(stamps) < 2:
            return None
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    def release(self) -> None:
        if self._held:
            self.capacity._give_back(self)

    def __enter__(self) -> SpeechTicket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"SpeechTicket(pages={self.pages}, frames={self.done}/{self.frames}, held={self._held})"


class _Waiter:
    """One request waiting for admission (in ``SpeechCapacity._queue``)."""

    __slots__ = ("pages", "streamed", "frames", "since", "deadline", "reason", "ticket", "wake", "alive")

    def __init__(
        self,
        pages: int,
        streamed: bool,
        frames: int | None,
        deadline: float,
        reason: str,
        wake: Callable[[], bool],
        alive: Callable[[], bool],
    ):
        self.pages = pages
        self.streamed = streamed
        self.frames = frames
        self.since = time.monotonic()
        self.deadline = deadline
        self.reason = reason
        """The bound it waits for now."""
        self.ticket: SpeechTicket | None = None
        self.wake = wake
        """Called (under the capacity's lock, must not block) once ``ticket`` is set; False:
        nobody can take it (its event loop is closed), so it is taken back."""
        self.alive = alive
        """False once nobody can take the ticket (its event loop is closed): not admitted."""


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


@dataclass(frozen=True)
class Waiting:
    """The admission queue now: how many wait and the longest wait so far."""

    count: int
    longest_s: float


class SpeechCapacity:
    """Requests, promised pages, (with ``timing``) the real-time rule, and the admission
    queue of one speech model.

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
        queue_size: int = DEFAULT_QUEUE_SIZE,
        wait_s: float = DEFAULT_WAIT_S,
    ):
        if safety is not None and not 0 < safety <= 1:
            raise ValueError(f"safety must be in (0, 1] (a share of a frame's audio length), got {safety}")
        if max_streams is not None and max_streams < 1:
            raise ValueError(f"max_streams must be >= 1 or None (auto), got {max_streams}")
        if queue_size < 0:
            raise ValueError(f"queue_size must be >= 0, got {queue_size}")
        if not wait_s > 0:
            raise ValueError(f"wait_s must be > 0, got {wait_s}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_streams = max_streams
        self.timing = timing
        self.safety = safety
        self.queue_size = queue_size
        self.wait_s = wait_s
        self.stream_pages = self.pages_for(stream_rows) if stream_rows else 1
        self.streams = 0
        self.streamed = 0
        """Running requests that stream (the time rule keeps them in real time)."""
        self.pages_promised = 0
        self.admitted = 0
        self.refused = dict.fromkeys(REASONS, 0)
        """Requests refused (at once, or when their wait's deadline passed), by bound."""
        self.waited = dict.fromkeys(REASONS, 0)
        """Requests that had to queue, by the bound they first met."""
        self.timed_out = dict.fromkeys(REASONS, 0)
        """Waits whose deadline passed (also counted in ``refused``), by the bound last met."""
        self.waits = Histogram(bounds=WAIT_BUCKETS, counts=[0] * (len(WAIT_BUCKETS) + 1))
        """Seconds each queued request waited before it was admitted."""
        self._tickets: set[SpeechTicket] = set()
        self._queue: deque[_Waiter] = deque()
        self._lock = threading.Lock()

    def pages_for(self, rows: int) -> int:
        return -(-rows // self.page_size)

    @property
    def budget_seconds(self) -> float | None:
        """The longest frame pass that keeps real time (None: no time rule)."""
        if self.timing is None or self.safety is None:
            return None
        return self.timing.frame_seconds * self.safety

    # -- admission ---------------------------------------------------------------------------
    def admit(
        self,
        rows: int,
        *,
        wait: bool,
        timeout: float | None = None,
        streamed: bool = True,
        frames: int | None = None,
        queue_size: int | None = None,
    ) -> SpeechTicket:
        """A ticket for a request of at most ``rows`` KV rows (``frames``: frames it may
        generate), or ``SpeechBusyError``. ``wait``: queue for up to ``timeout`` seconds
        (default ``wait_s``), blocking this thread."""
        pages = self._pages_checked(rows)
        event = threading.Event()

        def wake() -> bool:
            event.set()
            return True

        got = self._enter(pages, streamed, frames, wait, timeout, queue_size, wake, _always)
        if isinstance(got, SpeechTicket):
            return got
        try:
            while True:
                left = self._check_in(got)
                if isinstance(left, SpeechTicket):
                    return left
                event.wait(min(left, RECHECK_S))
                event.clear()
        except BaseException:
            self._leave(got)
            raise

    async def admit_async(
        self,
        rows: int,
        *,
        wait: bool = True,
        timeout: float | None = None,
        streamed: bool = True,
        frames: int | None = None,
        queue_size: int | None = None,
    ) -> SpeechTicket:
        """``admit`` from an event loop: the wait suspends this task only. Cancelling the
        task takes it out of the queue (and gives back a ticket it was given meanwhile)."""
        pages = self._pages_checked(rows)
        loop = asyncio.get_running_loop()
        event = asyncio.Event()

        def wake() -> bool:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop is closed: nobody will take the ticket
                return False
            return True

        got = self._enter(
            pages, streamed, frames, wait, timeout, queue_size, wake, lambda: not loop.is_closed()
        )
        if isinstance(got, SpeechTicket):
            return got
        try:
            while True:
                left = self._check_in(got)
                if isinstance(left, SpeechTicket):
                    return left
                try:
                    await asyncio.wait_for(event.wait(), min(left, RECHECK_S))
                except TimeoutError:
                    pass
                event.clear()
        except BaseException:
            self._leave(got)
            raise

    def _pages_checked(self, rows: int) -> int:
        pages = self.pages_for(rows)
        if pages > self.num_pages:
            raise InvalidDurationError(
                f"this request needs up to {pages} KV pages and the model has {self.num_pages}; "
                "lower max_duration or shorten the context",
                needed_pages=pages,
                limit=self.num_pages,
            )
        return pages

    def _enter(
        self,
        pages: int,
        streamed: bool,
        frames: int | None,
        wait: bool,
        timeout: float | None,
        queue_size: int | None,
        wake: Callable[[], bool],
        alive: Callable[[], bool],
    ) -> SpeechTicket | _Waiter:
        """Admit at once, queue (a ``_Waiter``), or raise: a request never passes the queue."""
        with self._lock:
            if self._queue:
                reason = self._queue[0].reason  # what the requests ahead wait for
            else:
                reason = self._refusal(pages, streamed)
                if reason is None:
                    self.admitted += 1
                    return self._grant(pages, streamed, frames)
            if not wait:
                self.refused[reason] += 1
                raise self._busy(reason, pages, streamed, frames, list(self._queue))
            limit = self.queue_size if queue_size is None else queue_size
            if limit == 0:  # no queue: refused by the bound itself
                self.refused[reason] += 1
                raise self._busy(reason, pages, streamed, frames, [])
            if len(self._queue) >= limit:
                self.refused["queue"] += 1
                raise self._busy("queue", pages, streamed, frames, list(self._queue), limit=limit)
            deadline = time.monotonic() + (self.wait_s if timeout is None else max(0.0, timeout))
            waiter = _Waiter(pages, streamed, frames, deadline, reason, wake, alive)
            self._queue.append(waiter)
            self.waited[reason] += 1
            return waiter

    def _check_in(self, waiter: _Waiter) -> SpeechTicket | float:
        """The waiter's ticket, or the seconds it may still wait; ``SpeechBusyError`` once its
        deadline has passed (it leaves the queue)."""
        with self._lock:
            if waiter.ticket is not None:
                return waiter.ticket
            self._pump()  # the measured frame time may have changed since the last look
            if waiter.ticket is not None:
                return waiter.ticket
            now = time.monotonic()
            left = waiter.deadline - now
            if left > 0:
                return left
            ahead = []
            for w in self._queue:
                if w is waiter:
                    break
                ahead.append(w)
            reason = waiter.reason
            self.refused[reason] += 1
            self.timed_out[reason] += 1
            error = self._busy(
                reason, waiter.pages, waiter.streamed, waiter.frames, ahead, waited=now - waiter.since
            )
            self._remove(waiter)
        raise error

    def _leave(self, waiter: _Waiter) -> None:
        """A waiter that gives up (cancelled, interrupted): out of the queue, and a ticket it
        was given in the meantime goes back."""
        with self._lock:
            self._remove(waiter)
            ticket = waiter.ticket
        if ticket is not None:
            ticket.release()

    def _remove(self, waiter: _Waiter) -> None:
        """Take ``waiter`` out of the queue (lock held) and let the ones behind it move."""
        try:
            self._queue.remove(waiter)
        except ValueError:
            return
        self._pump()

    def _grant(self, pages: int, streamed: bool, frames: int | None) -> SpeechTicket:
        ticket = SpeechTicket(self, pages, frames=frames, streamed=streamed)
        self.streams += 1
        self.streamed += streamed
        self.pages_promised += pages
        self._tickets.add(ticket)
        return ticket

    def _pump(self) -> None:
        """Admit waiters from the head of the queue while they fit (lock held)."""
        while self._queue:
            head = self._queue[0]
            if not head.alive():
                self._queue.popleft()
                continue
            reason = self._refusal(head.pages, head.streamed)
            if reason is not None:
                head.reason = reason
                return
            self._queue.popleft()
            ticket = head.ticket = self._grant(head.pages, head.streamed, head.frames)
            if not head.wake():  # nobody can take it: straight back
                head.ticket = None
                self._drop(ticket)
                continue
            self.admitted += 1
            self.waits.observe(time.monotonic() - head.since)

    def _give_back(self, ticket: SpeechTicket) -> None:
        with self._lock:
            if ticket._held:
                self._drop(ticket)
                self._pump()

    def _drop(self, ticket: SpeechTicket) -> None:
        """Undo ``_grant`` (lock held)."""
        ticket._held = False
        self._tickets.discard(ticket)
        self.streams -= 1
        self.streamed -= ticket.streamed
        self.pages_promised -= ticket.pages

    # -- the bounds --------------------------------------------------------------------------
    def _in_time(self, streams: int) -> bool:
        budget = self.budget_seconds
        if streams <= 1 or budget is None:
            return True
        assert self.timing is not None
        predicted = self.timing.predict(streams)
        return predicted is None or predicted <= budget

    def _refusal(self, pages: int, streamed: bool) -> str | None:
        """The bound a new request of ``pages`` pages would break now (None: it fits)."""
        return self._refusal_at(pages, streamed, self.streams, self.pages_promised, self.streamed)

    def _refusal_at(
        self, pages: int, streamed: bool, streams: int, promised: int, streaming: int
    ) -> str | None:
        if self.max_streams is not None and streams >= self.max_streams:
            return "max_streams"
        if promised + pages > self.num_pages:
            return "pages"
        if (streamed or streaming) and not self._in_time(streams + 1):
            return "time"
        return None

    # -- Retry-After -------------------------------------------------------------------------
    def _pace(self) -> float | None:
        """Seconds per frame of a running request now: the median of the running tickets'
        measured paces, else the predicted frame pass at this batch size (lock held)."""
        paces = sorted(p for p in (t.pace for t in self._tickets) if p is not None)
        if paces:
            return paces[len(paces) // 2]
        if self.timing is None:
            return None
        return self.timing.predict(max(1, self.streams)) or self.timing.frame_seconds

    def _eta(
        self, pages: int, streamed: bool, frames: int | None, ahead: list[_Waiter], *, first: bool = False
    ) -> float | None:
        """Seconds until a request (``pages``, ``streamed``) queued behind ``ahead`` would be
        admitted (``first``: until the first of ``ahead`` is): each running ticket ends after
        its remaining frame budget at its measured pace (seconds between its frames), the
        waiters ahead are admitted as they fit and run their budgets at the running pace.
        None when that cannot be told (a request of unknown budget must end first, nothing
        measured) (lock held)."""
        pace = self._pace()
        ends: list[tuple[float, int, int, bool]] = []  # (end, tie-break, pages, streamed)
        for i, t in enumerate(self._tickets):
            own = t.pace
            own = own if own is not None else pace
            if t.frames is not None and own is not None:
                ends.append((max(1, t.frames - t.done) * own, i, t.pages, t.streamed))
        heapq.heapify(ends)
        queue = deque((w.pages, w.streamed, w.frames) for w in ahead)
        if not first:
            queue.append((pages, streamed, None))
        streams, promised, streaming = self.streams, self.pages_promised, self.streamed
        now, n = 0.0, len(ends)
        for _ in range(ETA_STEPS):
            while queue and self._refusal_at(queue[0][0], queue[0][1], streams, promised, streaming) is None:
                q_pages, q_streamed, q_frames = queue.popleft()
                if first or not queue:
                    return now
                streams, promised, streaming = streams + 1, promised + q_pages, streaming + q_streamed
                if q_frames is not None and pace is not None:
                    n += 1
                    heapq.heappush(ends, (now + q_frames * pace, n, q_pages, q_streamed))
            if not ends:
                return None
            now, _, e_pages, e_streamed = heapq.heappop(ends)
            streams, promised, streaming = streams - 1, promised - e_pages, streaming - e_streamed
        return None

    def _busy(
        self,
        reason: str,
        pages: int,
        streamed: bool,
        frames: int | None,
        ahead: list[_Waiter],
        *,
        limit: int | None = None,
        waited: float | None = None,
    ) -> SpeechBusyError:
        """The refusal (lock held): its message and estimated Retry-After."""
        if reason == "queue" and ahead:
            eta = self._eta(pages, streamed, frames, ahead, first=True)
            head_left = max(0.0, ahead[0].deadline - time.monotonic())  # or the head gives up
            eta = head_left if eta is None else min(eta, head_left)
        else:
            eta = self._eta(pages, streamed, frames, ahead)
        retry = retry_after_s(eta)
        message = self._busy_message(reason, pages, retry, queued=len(ahead), limit=limit)
        if waited is not None:
            message = f"waited {waited:.1f} s for admission: {message}"
        return SpeechBusyError(
            message,
            retry_after=retry,
            limit=limit if reason == "queue" else self.max_streams,
            reason=reason,
            waited_s=round(waited, 3) if waited is not None else None,
        )

    def _busy_message(self, reason: str, pages: int, retry: int, *, queued: int, limit: int | None) -> str:
        tail = f"retry after {retry} s"
        if queued and reason != "queue":
            tail = f"{queued} requests wait ahead; {tail}"
        if reason == "queue":
            return (
                f"the speech model is running {self.streams} requests and {queued} wait for admission, "
                f"its queue's maximum of {limit}; {tail}"
            )
        if reason == "max_streams":
            return f"the speech model is running {self.streams} of at most {self.max_streams} streams; {tail}"
        if reason == "pages":
            return (
                f"the speech model has {self.pages_promised} of {self.num_pages} KV pages promised to "
                f"{self.streams} streams and this request needs {pages} more; {tail}"
            )
        assert self.timing is not None and self.budget_seconds is not None
        n = self.streams + 1
        predicted = self.timing.predict(n) or 0.0
        return (
            f"the speech model is running {self.streams} streams; with one more, a frame pass of {n} "
            f"would take ~{predicted * 1e3:.1f} ms (measured) against {self.budget_seconds * 1e3:.1f} ms "
            f"({self.safety:g} x the {self.timing.frame_seconds * 1e3:.0f} ms frame), so every stream "
            f"would fall behind real time; {tail}"
        )

    # -- state for /metrics ------------------------------------------------------------------
    def waiting(self) -> Waiting:
        """How many requests wait for admission now, and the longest of their waits so far."""
        now = time.monotonic()
        with self._lock:
            longest = max((now - w.since for w in self._queue), default=0.0)
            return Waiting(len(self._queue), longest)

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
        with self._lock:
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
        queued = len(self._queue)
        return (
            f"SpeechCapacity({self.streams} streams running, {h.fit} fit (bound: {h.bound}; "
            f"pages {h.by_pages}, time {h.by_time if h.by_time is not None else '-'}, max {cap}), "
            f"{self.pages_promised}/{self.num_pages} pages promised{time_part}"
            + (f", {queued} waiting" if queued else "")
            + ")"
        )


def _always() -> bool:
    return True
