"""``InferletRun``: the launcher's side of one run (messages and files in, cancel)."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Iterable

from media import cache_scope as current_cache_scope

_CLOSED = object()


class _Inbox:
    """A thread-safe FIFO whose reader takes a ``concurrent.futures.Future`` per item: a
    waiting guest holds the future (Pie's ``future-string`` / ``future-blob``), the poster
    completes it. Once closed, every later read gets None."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: collections.deque[object] = collections.deque()
        self._waiters: collections.deque[concurrent.futures.Future] = collections.deque()
        self._closed = False

    def put(self, item: object) -> None:
        with self._lock:
            while self._waiters:
                fut = self._waiters.popleft()
                if fut.set_running_or_notify_cancel():
                    fut.set_result(None if item is _CLOSED else item)
                    if item is _CLOSED:
                        self._closed = True
                        continue
                    return
            if item is _CLOSED:
                self._closed = True
            else:
                self._items.append(item)

    def future(self) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._items:
                fut.set_running_or_notify_cancel()
                fut.set_result(self._items.popleft())
            elif self._closed:
                fut.set_running_or_notify_cancel()
                fut.set_result(None)
            else:
                self._waiters.append(fut)
        return fut

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class InferletRun:
    """Pass one as ``control=`` to ``InferletRuntime.run`` / ``run_async`` to talk to the
    run while it goes: ``post(text)`` queues a message for the guest's ``receive()``,
    ``post_file(data)`` a file for Pie's ``session.receive-file``, ``close_input()`` tells
    it no more will come, ``cancel()`` stops it (thread-safe, from any thread or the event
    loop).

    Cancellation takes effect at the guest's next host call, or at once when the guest is
    waiting in one (a generation, a receive): that call fails with ``inferlet_cancelled``
    and the run ends with ``InferletCancelledError``. A guest computing without calling
    the host runs on until its fuel or wall-clock budget ends it.

    ``namespace``: whose run it is (a server passes its caller's tenant); the contexts the
    run saves, opens and deletes by name live under it, so two tenants' runs never reach
    each other's saved contexts. Empty: the plain names (a library user, an admin).
    ``cache_scope``: the ``encoders.cache_scope`` the run's contexts key their prefix pages
    and encoder outputs under (default: the scope where the run object is made).
    ``username``: the caller's key name (Pie's ``runtime.username``)."""

    def __init__(
        self,
        messages: Iterable[str] | None = None,
        *,
        close: bool = False,
        namespace: str = "",
        cache_scope: str | None = None,
        username: str = "",
    ):
        self.namespace = namespace
        self.username = username
        self.tokens_used = 0
        """Tokens the run has generated so far (``RunState.spend_tokens``): what a server
        charges to its caller's key when it ends."""
        self.cache_scope = current_cache_scope() if cache_scope is None else cache_scope
        self._inbox = _Inbox()
        self._files = _Inbox()
        self._cancel = threading.Event()
        self._on_cancel: list = []
        for m in messages or ():
            self.post(m)
        if close:
            self.close_input()

    def post(self, text: str) -> None:
        self._inbox.put(str(text))

    def post_file(self, data: bytes) -> None:
        self._files.put(bytes(data))

    def close_input(self) -> None:
        self._inbox.put(_CLOSED)
        self._files.put(_CLOSED)

    def cancel(self) -> None:
        self._cancel.set()
        for fn in list(self._on_cancel):
            fn()

    def on_cancel(self, fn) -> None:
        """Call ``fn()`` (any thread) when the run is cancelled: a host waiting in ``poll``
        wakes at once."""
        self._on_cancel.append(fn)
        if self.cancelled:
            fn()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def message_future(self) -> concurrent.futures.Future:
        """A future of the next message (None once the input is closed)."""
        return self._inbox.future()

    def file_future(self) -> concurrent.futures.Future:
        """A future of the next file's bytes (None once the input is closed)."""
        return self._files.future()

    def next_message(self, timeout: float) -> str | None:
        """The next message; None once the input is closed. ``queue.Empty`` on timeout."""
        import queue

        fut = self._inbox.future()
        try:
            return fut.result(timeout=max(0.0, timeout))
        except concurrent.futures.TimeoutError:
            if not fut.cancel():  # completed meanwhile: keep it
                return fut.result()
            raise queue.Empty from None
