"""Messages between inferlet runs (Pie's ``pie:core/messaging``): push/pull queues (each
message to one puller, in order) and broadcast topics (each message to every subscriber
live when it is sent). Keyed by namespace (the caller's tenant): a run reaches only its
own tenant's topics. Bounded: a queue or a subscription holds at most ``max_pending``
messages (the oldest are dropped past it, counted in ``dropped``)."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable


class _Subscription:
    def __init__(self, broker: MessageBroker, key: tuple[str, str]):
        self._broker = broker
        self._key = key
        self._items: collections.deque[str] = collections.deque(maxlen=broker.max_pending)
        self._listeners: list[Callable[[], None]] = []
        self.cancelled = False

    def on_message(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def deliver(self, msg: str) -> None:
        self._items.append(msg)
        for fn in self._listeners:
            fn()

    def has_message(self) -> bool:
        return bool(self._items) or self.cancelled

    def next(self) -> str | None:
        return self._items.popleft() if self._items else None

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._broker._unsubscribe(self._key, self)
            for fn in self._listeners:
                fn()


class MessageBroker:
    def __init__(self, max_pending: int = 1024):
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._queues: dict[tuple[str, str], collections.deque[str]] = {}
        self._pullers: dict[tuple[str, str], collections.deque[concurrent.futures.Future]] = {}
        self._subs: dict[tuple[str, str], list[_Subscription]] = {}
        self.dropped = 0

    def __repr__(self) -> str:
        return (
            f"MessageBroker({len(self._queues)} queues, {sum(map(len, self._subs.values()))} subscriptions)"
        )

    def push(self, namespace: str, topic: str, msg: str) -> None:
        key = (namespace, topic)
        with self._lock:
            waiting = self._pullers.get(key)
            while waiting:
                fut = waiting.popleft()
                if fut.set_running_or_notify_cancel():
                    fut.set_result(msg)
                    return
            q = self._queues.setdefault(key, collections.deque())
            if len(q) >= self.max_pending:
                q.popleft()
                self.dropped += 1
            q.append(msg)

    def pull(self, namespace: str, topic: str) -> concurrent.futures.Future:
        key = (namespace, topic)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            q = self._queues.get(key)
            if q:
                fut.set_running_or_notify_cancel()
                fut.set_result(q.popleft())
            else:
                self._pullers.setdefault(key, collections.deque()).append(fut)
        return fut

    def broadcast(self, namespace: str, topic: str, msg: str) -> None:
        with self._lock:
            subs = list(self._subs.get((namespace, topic), ()))
        for s in subs:
            s.deliver(msg)

    def subscribe(self, namespace: str, topic: str) -> _Subscription:
        sub = _Subscription(self, (namespace, topic))
        with self._lock:
            self._subs.setdefault((namespace, topic), []).append(sub)
        return sub

    def _unsubscribe(self, key: tuple[str, str], sub: _Subscription) -> None:
        with self._lock:
            subs = self._subs.get(key, [])
            if sub in subs:
                subs.remove(sub)
