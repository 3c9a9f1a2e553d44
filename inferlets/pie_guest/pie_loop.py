"""The asyncio loop of pie-media's Python guests of Pie's world (guest side): Pie's SDK awaits
a host future by appending ``(pollable, waker)`` to ``loop.wakers``
(``inferlet._async.await_future``); this loop honours that, plus timers (``asyncio.sleep``).
Its only wait is ``wasi:io/poll.poll``, so a guest waiting on the host spins no core. Pie's
world imports no monotonic clock, so while a timer is pending the loop checks the pollables
with ``ready()`` and sleeps (WASI's own clock, ``time.sleep``) up to 5 ms between checks.

Used by ``pie_entry`` (a run's ``main(input)``) and by daemons (``run`` inside a
``wasi:http/incoming-handler``). Written here because componentize-py's own ``poll_loop``
imports ``wasi:http``, which Pie's run world does not have.
"""

import asyncio
import heapq
import itertools
import time

from wit_world.imports import poll

TIMER_CHECK_S = 0.005


class _Handle(asyncio.Handle):
    pass


class PiePollLoop(asyncio.AbstractEventLoop):
    """A single-threaded loop: ready callbacks, then timers, then ``poll`` on the pollables
    of the futures awaited (``wakers``) and of the nearest timer."""

    def __init__(self) -> None:
        self.wakers: list = []
        self._ready: list = []
        self._timers: list = []
        self._seq = itertools.count()
        self._running = False
        self._closed = False
        self._exception = None

    # -- running ---------------------------------------------------------------------------
    def run_until_complete(self, future):
        future = asyncio.ensure_future(future, loop=self)
        self._running = True
        asyncio.events._set_running_loop(self)
        try:
            while not future.done():
                self._run_once()
                if self._exception is not None:
                    exc, self._exception = self._exception, None
                    raise exc
        finally:
            self._running = False
            asyncio.events._set_running_loop(None)
        return future.result()

    def _run_once(self) -> None:
        ready, self._ready = self._ready, []
        ran = bool(ready)
        for h in ready:
            if not h._cancelled:
                h._run()
        if self._timers:  # the clock is a host call: read it only when a timer waits
            now = self.time()
            while self._timers and self._timers[0][0] <= now:
                _, _, h = heapq.heappop(self._timers)
                if not h._cancelled:
                    self._ready.append(h)
        if self._ready:
            return
        pollables = [p for p, _ in self.wakers]
        if self._timers:
            hit = {i for i, p in enumerate(pollables) if p.ready()}
            if not hit:
                time.sleep(min(TIMER_CHECK_S, max(0.0, self._timers[0][0] - self.time())))
                return
        elif pollables:
            hit = set(poll.poll(pollables))
        elif ran:
            return  # the outer loop looks whether the main task is done
        else:
            raise RuntimeError("the inferlet awaits something that can never finish (nothing to poll)")
        still = []
        for i, (p, waker) in enumerate(self.wakers):
            if i in hit:
                p.__exit__(None, None, None)
                if not waker.done():
                    waker.set_result(None)
            else:
                still.append((p, waker))
        self.wakers = still

    # -- scheduling ------------------------------------------------------------------------
    def call_soon(self, callback, *args, context=None):
        h = _Handle(callback, args, self, context=context)
        self._ready.append(h)
        return h

    def call_later(self, delay, callback, *args, context=None):
        return self.call_at(self.time() + max(0.0, delay), callback, *args, context=context)

    def call_at(self, when, callback, *args, context=None):
        h = asyncio.TimerHandle(when, callback, args, self, context=context)
        heapq.heappush(self._timers, (when, next(self._seq), h))
        return h

    def _timer_handle_cancelled(self, handle):
        pass

    def call_soon_threadsafe(self, callback, *args, context=None):
        return self.call_soon(callback, *args, context=context)

    def time(self):
        return time.monotonic()

    def create_future(self):
        return asyncio.Future(loop=self)

    def create_task(self, coro, *, name=None, context=None):
        return asyncio.Task(coro, loop=self, name=name, context=context)

    # -- state -----------------------------------------------------------------------------
    def get_debug(self):
        return False

    def is_running(self):
        return self._running

    def is_closed(self):
        return self._closed

    def close(self):
        self._closed = True

    def stop(self):
        pass

    async def shutdown_asyncgens(self):
        pass

    def call_exception_handler(self, context):
        exc = context.get("exception")
        if exc is not None and self._exception is None and not isinstance(exc, asyncio.CancelledError):
            print("inferlet: unhandled exception in a task:", repr(exc))

    def default_exception_handler(self, context):
        self.call_exception_handler(context)


def run(coro):
    """Run ``coro`` to its end on a fresh ``PiePollLoop``; its result (or exception)."""
    loop = PiePollLoop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
