"""How many speech requests a model runs at once: a batch limit and the KV pages.

A request is admitted with the pages it can ever hold promised to it (its prompt plus
every frame ``max_duration`` allows), so a running stream never meets a full pool, and
at most ``max_streams`` run at once (each frame of each stream is one depth-decoder row
of a pass). Past either limit the HTTP endpoint answers 429 with Retry-After at once
(``wait=False``); blocking callers (the CLI, inferlets, scripts) wait for a slot, up to a
deadline. Pages shared through the prefix cache are still promised in full: the promise
is an upper bound, never an overdraft.
"""

from __future__ import annotations

import threading
import time

from speech.errors import InvalidDurationError, SpeechBusyError

RETRY_AFTER_S = 1
DEFAULT_WAIT_S = 300.0


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


class SpeechCapacity:
    def __init__(self, *, num_pages: int, page_size: int, max_streams: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_streams = max_streams
        self.streams = 0
        self.pages_promised = 0
        self._cond = threading.Condition()

    def pages_for(self, rows: int) -> int:
        return -(-rows // self.page_size)

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
        with self._cond:
            while not self._fits(pages):
                left = deadline - time.monotonic()
                if not wait or left <= 0:
                    raise SpeechBusyError(
                        f"the speech model is running {self.streams} of at most {self.max_streams} "
                        f"streams with {self.pages_promised} of {self.num_pages} KV pages promised; "
                        f"retry after {RETRY_AFTER_S} s",
                        retry_after=RETRY_AFTER_S,
                        limit=self.max_streams,
                    )
                self._cond.wait(left)
            self.streams += 1
            self.pages_promised += pages
        return SpeechTicket(self, pages)

    def _fits(self, pages: int) -> bool:
        return self.streams < self.max_streams and self.pages_promised + pages <= self.num_pages

    def _give_back(self, pages: int) -> None:
        with self._cond:
            self.streams -= 1
            self.pages_promised -= pages
            self._cond.notify_all()

    def __repr__(self) -> str:
        return (
            f"SpeechCapacity({self.streams}/{self.max_streams} streams, "
            f"{self.pages_promised}/{self.num_pages} pages promised)"
        )
