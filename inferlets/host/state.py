"""One run's state on the host: its handles, budgets, and the bridge to the event loop.

The guest runs on a worker thread. Every engine call that touches a context runs on the
server's event loop (``on_loop`` / ``wait_for``), so contexts see the same single-threaded
use they get in-process and concurrent runs share the scheduler's batched passes. Every
wait is bounded by the run's deadline and ends at once when the launcher cancels.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from inferlets.host.control import InferletRun
from inferlets.host.errors import (
    InferletCancelledError,
    InferletLimitError,
    InferletTimeoutError,
    UnknownModelError,
)
from inferlets.host.handles import HandleTable
from inferlets.host.limits import RunLimits

POLL_S = 0.05


def forwarded(coro: Coroutine[Any, Any, Any]) -> tuple[Coroutine[Any, Any, None], concurrent.futures.Future]:
    """``coro`` wrapped to hand its outcome to the returned future, which a thread other
    than the loop's waits on. Handed on from inside the task, not from a done-callback:
    that would take one more turn of the loop before the waiting thread wakes."""
    out: concurrent.futures.Future = concurrent.futures.Future()
    out.set_running_or_notify_cancel()

    async def run() -> None:
        try:
            out.set_result(await coro)
        except asyncio.CancelledError:
            out.set_exception(concurrent.futures.CancelledError("cancelled before it ended"))
            raise
        except BaseException as e:
            out.set_exception(e)

    return run(), out


class RunState:
    def __init__(
        self,
        models: dict[str, Any],
        loop: asyncio.AbstractEventLoop,
        args: list[str],
        on_send: Callable[[str], None],
        limits: RunLimits,
        control: InferletRun | None,
    ):
        self.models = models
        self.loop = loop
        self.args = list(args)
        self.on_send = on_send
        self.limits = limits
        self.control = control
        self.deadline = time.monotonic() + limits.wall_s
        self.saves = 0
        self.tokens_used = 0
        """Tokens generated so far, against ``limits.token_budget``."""
        self.on_output: Callable[[str, str], None] | None = None
        """(stream, text) for what the guest writes to WASI stdout / stderr (None: dropped),
        a line at a time (``output``)."""
        self.output_source: Callable[[], None] | None = None
        """Hands on output captured elsewhere (``OutputCapture.drain``), called first by
        ``flush_output``."""
        self._pending_output: list[tuple[str, str]] = []
        self._output_lock = threading.Lock()
        self.pie: Any = None
        """The run's ``PieHost`` (both worlds: pie-media's own calls are a layer over Pie's)."""
        self.ended_by: Exception | None = None
        """Set when a host call was refused for cancel or deadline: how the run ends, whatever
        the guest makes of that call's error."""
        self.handles = HandleTable(
            limits.max_handles,
            {
                "context": lambda c: c.close(),  # a pie_core ContextRes (it closes on the loop)
                "speech-stream": lambda g: g.close(),
            },
        )

    # -- budgets ----------------------------------------------------------------------------
    def check(self) -> None:
        """Refuse any further host call once the run is cancelled or past its deadline."""
        if self.control is not None and self.control.cancelled:
            self.ended_by = InferletCancelledError("the run was cancelled")
            raise self.ended_by
        if time.monotonic() >= self.deadline:
            self.ended_by = InferletTimeoutError(f"the run passed its {self.limits.wall_s} s deadline")
            raise self.ended_by

    def token_allowance(self, contexts: int, asked: int) -> int:
        """Tokens each of ``contexts`` may generate in one call that ``asked`` for: ``asked``
        with no budget, else cut to an equal share of what is left. A spent budget ends the
        run (``inferlet_limit``), as cancel and deadline do."""
        budget = self.limits.token_budget
        if budget is None:
            return asked
        share = (budget - self.tokens_used) // max(1, contexts)
        if share < 1:
            self.ended_by = InferletLimitError(
                f"the run's token budget of {budget} is spent ({self.tokens_used} generated)",
                limit=budget,
                actual=self.tokens_used,
            )
            raise self.ended_by
        return min(asked, share)

    def spend_tokens(self, n: int) -> None:
        self.tokens_used += n
        if self.control is not None:
            self.control.tokens_used += n

    # -- stdout / stderr ----------------------------------------------------------------------
    def output(self, stream: str, text: str) -> None:
        """What the guest wrote (its worker thread, or the output capture's): whole lines go
        on at once, a line's start waits for its end (a Python guest writes ``print``'s
        parts one by one), or for ``flush_output``. Another stream's text first flushes what
        waits, keeping the order."""
        if self.on_output is None:
            return
        with self._output_lock:
            if self._pending_output and self._pending_output[-1][0] != stream:
                self._flush_pending()
            pending = self._pending_output[-1][1] if self._pending_output else ""
            text = pending + text
            self._pending_output.clear()
            cut = text.rfind("\n") + 1
            if cut:
                self.on_output(stream, text[:cut])
            if len(text) - cut > 1 << 16:  # a line that never ends goes on in pieces
                self.on_output(stream, text[cut:])
            elif cut < len(text):
                self._pending_output.append((stream, text[cut:]))

    def flush_output(self) -> None:
        """Hand on everything written so far, a partial line too (before a send, so the
        order holds, and at the run's end)."""
        if self.output_source is not None:
            self.output_source()
        with self._output_lock:
            self._flush_pending()

    def _flush_pending(self) -> None:
        pending, self._pending_output = self._pending_output, []
        for stream, text in pending:
            if self.on_output is not None:
                self.on_output(stream, text)

    def text(self, s: str, what: str = "text") -> str:
        n = len(s.encode("utf-8", "surrogatepass"))
        if n > self.limits.max_text_bytes:
            raise InferletLimitError(
                f"{what} of {n} bytes is over the limit of {self.limits.max_text_bytes}",
                limit=self.limits.max_text_bytes,
                actual=n,
            )
        return s

    def buffer(self, data: bytes | list[int], what: str = "buffer", item_bytes: int = 1) -> None:
        n = len(data) * item_bytes
        if n > self.limits.max_buffer_bytes:
            raise InferletLimitError(
                f"{what} of {n} bytes is over the limit of {self.limits.max_buffer_bytes}",
                limit=self.limits.max_buffer_bytes,
                actual=n,
            )

    # -- models -----------------------------------------------------------------------------
    def model(self, name: str, kind: type | None = None) -> Any:
        m = self.models.get(name)
        if m is None or (kind is not None and not isinstance(m, kind)):
            what = "" if kind is None else f" {kind.__name__}"
            raise UnknownModelError(f"no{what} model named {name!r}; have {sorted(self.models)}", model=name)
        return m

    # -- the bridge -------------------------------------------------------------------------
    def wait_for(self, coro: Coroutine[Any, Any, Any], *, bounded: bool = True) -> Any:
        """Run ``coro`` on the loop and wait; past the deadline or on cancel the coroutine is
        cancelled and a typed error raised (``bounded=False``: cleanup, never interrupted)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        if not bounded:
            return fut.result()
        while True:
            try:
                return fut.result(timeout=POLL_S)
            except concurrent.futures.TimeoutError:
                try:
                    self.check()
                except Exception:
                    fut.cancel()
                    raise

    def start_soon(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Start ``coro`` on the loop and return at once: the future is its outcome. One
        thread hop less than ``wait_for`` (the caller does not wait for the loop to pick it
        up), for work whose errors were checked on this thread first. Cancelling the future
        does not stop the coroutine (it would leave its context half-changed); the run's
        end does (its contexts close)."""
        run, out = forwarded(coro)
        self.loop.call_soon_threadsafe(self.loop.create_task, run)
        return out

    def on_loop(self, fn: Callable[..., Any], *a: Any, bounded: bool = True) -> Any:
        """Call the synchronous ``fn`` on the loop's thread (engine state is not shared
        across threads) and return its result."""

        async def call() -> Any:
            return fn(*a)

        return self.wait_for(call(), bounded=bounded)

    def close_context(self, ctx: Any) -> None:
        """Close an engine context on the loop (its pages go back to the pool there)."""
        if self.loop.is_running() and not self.loop.is_closed():
            self.on_loop(ctx.close, bounded=False)
        else:
            ctx.close()

    def close(self) -> None:
        """Close every live handle: contexts return their pages, streams release the model."""
        self.handles.close_all()
