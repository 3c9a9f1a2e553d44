"""``InferletRun``: the launcher's side of one run (messages in, cancel)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable

from media import cache_scope as current_cache_scope

_CLOSED = object()


class InferletRun:
    """Pass one as ``control=`` to ``InferletRuntime.run`` / ``run_async`` to talk to the
    run while it goes: ``post(text)`` queues a message for the guest's ``receive()``,
    ``close_input()`` tells it no more will come, ``cancel()`` stops it (thread-safe, from
    any thread or the event loop).

    Cancellation takes effect at the guest's next host call, or at once when the guest is
    waiting in one (a generation, a receive): that call fails with ``inferlet_cancelled``
    and the run ends with ``InferletCancelledError``. A guest computing without calling
    the host runs on until its fuel or wall-clock budget ends it.

    ``namespace``: whose run it is (a server passes its caller's tenant); the contexts the
    run saves, opens and deletes by name live under it, so two tenants' runs never reach
    each other's saved contexts. Empty: the plain names (a library user, an admin).
    ``cache_scope``: the ``encoders.cache_scope`` the run's contexts key their prefix pages
    and encoder outputs under (default: the scope where the run object is made)."""

    def __init__(
        self,
        messages: Iterable[str] | None = None,
        *,
        close: bool = False,
        namespace: str = "",
        cache_scope: str | None = None,
    ):
        self.namespace = namespace
        self.cache_scope = current_cache_scope() if cache_scope is None else cache_scope
        self._inbox: queue.Queue[object] = queue.Queue()
        self._cancel = threading.Event()
        for m in messages or ():
            self.post(m)
        if close:
            self.close_input()

    def post(self, text: str) -> None:
        self._inbox.put(str(text))

    def close_input(self) -> None:
        self._inbox.put(_CLOSED)

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def next_message(self, timeout: float) -> str | None:
        """The next message; None once the input is closed. ``queue.Empty`` on timeout."""
        item = self._inbox.get(timeout=max(0.0, timeout))
        if item is _CLOSED:
            self._inbox.put(_CLOSED)  # stays closed for later receives
            return None
        assert isinstance(item, str)
        return item
