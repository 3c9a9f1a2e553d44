"""A run's handle table: u32 -> (kind, object), never shared between runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inferlets.host.errors import InferletHandleError, InferletLimitError

KINDS = ("context", "media", "speech-stream")


class HandleTable:
    """Live objects of one run by handle. A handle is never reused within the run, so a
    closed handle stays an error (``inferlet_bad_handle``) instead of naming a newer object;
    past ``limit`` live entries ``add`` refuses (``inferlet_limit``) and closes what it was
    given, so nothing leaks."""

    def __init__(self, limit: int, closers: dict[str, Callable[[Any], None]]):
        self.limit = limit
        self._closers = closers
        self._live: dict[int, tuple[str, Any]] = {}
        self._closed: set[int] = set()
        self._next = 1

    def __len__(self) -> int:
        return len(self._live)

    def ensure_room(self) -> None:
        """Raise the limit error now if no handle is left (before costly work)."""
        if len(self._live) >= self.limit:
            raise InferletLimitError(
                f"more than {self.limit} live handles (contexts, media, speech streams); drop some first",
                limit=self.limit,
            )

    def add(self, kind: str, obj: Any) -> int:
        if len(self._live) >= self.limit:
            self._close(kind, obj)
            raise InferletLimitError(
                f"more than {self.limit} live handles (contexts, media, speech streams); drop some first",
                limit=self.limit,
            )
        h = self._next
        self._next += 1
        self._live[h] = (kind, obj)
        return h

    def get(self, h: int, kind: str) -> Any:
        entry = self._live.get(h)
        if entry is None:
            state = "closed" if h in self._closed else "unknown"
            raise InferletHandleError(f"{kind} handle {h} is {state} in this run", handle=h, kind=kind)
        if entry[0] != kind:
            raise InferletHandleError(f"handle {h} is a {entry[0]}, not a {kind}", handle=h, kind=kind)
        return entry[1]

    def drop(self, h: int, kind: str) -> None:
        obj = self.get(h, kind)
        del self._live[h]
        self._closed.add(h)
        self._close(kind, obj)

    def close_all(self) -> None:
        """Close every live object (the run ended, however it ended)."""
        while self._live:
            h, (kind, obj) = self._live.popitem()
            self._closed.add(h)
            try:
                self._close(kind, obj)
            except Exception:  # noqa: BLE001 - cleanup goes on for the rest
                pass

    def _close(self, kind: str, obj: Any) -> None:
        closer = self._closers.get(kind)
        if closer is not None:
            closer(obj)
