"""``pie:core/types``: ``future-string`` and ``future-blob``, host futures whose pollables
the guest's ``poll`` waits on (``HostFuture`` is also the base of the other futures:
inference outputs, messages, children)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

from inferlets.host.binding import Interface, Resource, wit
from inferlets.host.wasi.poll import Pollable


class HostFuture(Resource):
    """A ``concurrent.futures.Future`` seen by the guest: ``pollable()`` is ready once it is
    done (completion wakes the run's ``poll``), ``get()`` is None before, then the value
    (``convert``-ed once). A future that failed raises its error from ``get``."""

    def __init__(
        self,
        fut: concurrent.futures.Future,
        host: Any,
        convert: Callable[[Any], Any] | None = None,
    ):
        self.fut = fut
        self._convert = convert
        self._value: Any = None
        self._taken = False
        fut.add_done_callback(host.waiter.wake)

    def pollable(self) -> Pollable:
        return Pollable(self.fut.done)

    def get(self) -> Any:
        if not self.fut.done():
            return None
        if not self._taken:
            value = self.fut.result()
            self._value = value if self._convert is None else self._convert(value)
            self._taken = True
        return self._value

    def close(self) -> None:
        self.fut.cancel()


def done_future(value: Any) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(value)
    return fut


class FutureString(HostFuture):
    WIT = ("pie:core/types", "future-string")


class FutureBlob(HostFuture):
    WIT = ("pie:core/types", "future-blob")


class Types(Interface):
    NAME = "pie:core/types"
    RESOURCES = (FutureString, FutureBlob)

    @wit("[method]future-string.pollable")
    def string_pollable(self, f: FutureString) -> Pollable:
        return f.pollable()

    @wit("[method]future-string.get")
    def string_get(self, f: FutureString) -> str | None:
        return f.get()

    @wit("[method]future-blob.pollable")
    def blob_pollable(self, f: FutureBlob) -> Pollable:
        return f.pollable()

    @wit("[method]future-blob.get")
    def blob_get(self, f: FutureBlob) -> bytes | None:
        return f.get()
