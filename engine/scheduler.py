"""Batch the forward passes of all live contexts (continuous batching, asyncio).

A context that needs a forward pass ``await scheduler.submit(step)``. The first
submission while no pass is being served starts a serving task on the running loop;
it first yields, so every task that is ready in that loop iteration (the other
contexts' decode steps, prefill chunks) submits before the batch is cut, then it runs
the batch (media encoding + one language-model pass) on the model's worker thread and
resolves each step's future. Steps submitted while a pass runs form the next batch.
The event loop stays free while a pass runs (torch releases the GIL), so HTTP handlers
and streams keep moving.

Work is bounded per pass by ``max_batch_rows``: steps that do not fit wait for the next
pass (a step is never split here; contexts chunk their own prefill and never split a
media span).

Overlap (vLLM's async scheduling, SGLang's overlap scheduler, on this design): a plain
generation submits its next decode step before it knows the token it feeds, naming the
step whose sampled token it is (``StepInput.after``). Such a step waits for a later pass
than the one it follows; and while a pass runs, the scheduler already cuts and hands the
forward worker the next one when steps like it wait. So the worker goes from pass N
straight to pass N+1 (reading N's tokens, which it sampled itself), while the event loop
streams N's tokens, checks stops and submits N+2: the host's share of a step runs beside
the model's, not between two passes. The next pass is cut early only when every step of
the running one has its successor waiting; otherwise (a prefill chunk, a grammar's step)
it is cut when the running one answers, so contexts one pass out of phase share passes
rather than alternate.

Device feed (with the overlap, on CUDA by default; ``PIE_MEDIA_DEVICE_FEED=1``/``0``):
even so, the worker reads pass N's tokens to the host before it builds and launches N+1,
and the device idles for that read and the launch. When N is a graph decode pass
(``engine.decode_graphs``) whose greedy rows the runner argmaxes, the worker launches it
without waiting (``ForwardRunner.launch``), then, while N runs, launches the next pass
handed over if each of its steps takes its token from N's argmax (gathered on the device
into N+1's ids) or already knows it; only then does it read N's tokens (``finish``). The
device goes from N to N+1 without a gap; the host builds N+1 while N runs. Rows sampled
with a ``SampleRequest`` (a sampler other than greedy, or penalties) are drawn on the
host side and are not fed this way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine import step_timing
from engine.forward import ForwardRunner, StepInput

log = logging.getLogger(__name__)

SKIPPED = object()
"""The result of an ``after`` step whose token never came (``StepInput.skipped``)."""


@dataclass
class SchedulerStats:
    passes: int = 0
    steps: int = 0
    max_steps_in_pass: int = 0
    overlapped_passes: int = 0
    """Passes handed to the worker while the one before was still running."""
    fed_passes: int = 0
    """Passes launched on the device before the pass they take their tokens from had
    returned them to the host (the device feed)."""


class Scheduler:
    def __init__(self, runner: ForwardRunner, *, max_batch_rows: int = 8192):
        self.runner = runner
        self.max_batch_rows = max_batch_rows
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[StepInput, asyncio.Future]]] = {}
        self._serving: set[asyncio.AbstractEventLoop] = set()
        self._tasks: set[asyncio.Task] = set()
        self._lock = threading.Lock()  # one forward pass at a time per model, whatever the loop
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pie-forward")
        self.stats = SchedulerStats()
        self.overlap = overlap_default(runner.device)
        """Whether plain generations submit each decode step ahead of its token (see the
        module doc)."""
        self.device_feed = device_feed_default(runner.device)
        """With the overlap: whether a graph decode pass whose tokens are the running
        pass's argmax is launched before that pass's tokens reach the host (see the
        module doc)."""
        self.feed_wait_s = 0.0
        """Off CUDA, how long the worker waits for the next pass to be handed over before
        reading the running one's tokens (on CUDA: while that pass runs, at most 50 ms).
        Tests set it to rehearse the device feed on the CPU, where a pass is over when it
        is launched."""
        self._queued: deque[list[StepInput]] = deque()  # passes handed to the worker, in order
        self._queue_cv = threading.Condition()
        self._prelaunched: dict[int, Any] = {}  # id(steps) -> the runner's launched pass
        self._wakers: dict[asyncio.AbstractEventLoop, asyncio.Future] = {}
        """Per loop: resolved by the next ``enqueue`` while ``_serve`` waits on a pass whose
        steps were submitted ahead and still lack their successors (``_serve``)."""

    async def submit(self, step: StepInput) -> torch.Tensor | None:
        return await self.enqueue(step)

    def enqueue(self, step: StepInput) -> asyncio.Future:
        """``submit`` without waiting: the future of the step's result (cancel it to drop
        the step while it still waits for a pass)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._pending.setdefault(loop, []).append((step, fut))
        waker = self._wakers.pop(loop, None)
        if waker is not None and not waker.done():
            waker.set_result(None)
        if loop not in self._serving:
            self._serving.add(loop)
            task = loop.create_task(self._serve(loop))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return fut

    async def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on one kept hidden state, on the forward worker (between passes),
        so it neither blocks the event loop nor competes with a pass for the cores."""
        loop = asyncio.get_running_loop()

        def head() -> torch.Tensor:
            with self._lock:
                return self.runner.logits_of(hidden)

        return await loop.run_in_executor(self._executor, head)

    def after_pass(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the running loop once the forward worker has finished the
        pass it is running or has queued now (at once, in effect, when idle). For releasing
        the pages of a step whose awaiting task was cancelled: its pass may still write them."""
        loop = asyncio.get_running_loop()
        done = loop.run_in_executor(self._executor, _nothing)
        done.add_done_callback(lambda _: callback())

    def on_worker_after_passes(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the forward worker once every pass handed to it so far has ended,
        whether or not an event loop is still running then (a staged pass of a context
        closed just before ``asyncio.run`` returns: its pages are given back after it)."""
        self._executor.submit(fn)

    async def pass_over(self) -> None:
        """Return once the forward worker has finished the pass it is running or has
        queued now: a cancelled step's pages can then be released (nothing writes them)."""
        await asyncio.get_running_loop().run_in_executor(self._executor, _nothing)

    def _run_timed(self, steps: list[StepInput], ended: list[float]) -> list[torch.Tensor | None]:
        """``_run`` on the worker, noting when it ended (``engine.step_timing``'s hop)."""
        t0 = step_timing.start()
        try:
            return self._run(steps)
        finally:
            step_timing.stop("worker: pass (whole)", t0)
            ended.append(time.perf_counter())

    def _run(self, steps: list[StepInput]) -> list[torch.Tensor | None]:
        with self._lock:
            if step_timing.TIMING.on:
                began = time.perf_counter()
                for step in steps:
                    step.started = began
            self._unqueue(steps)
            launched = self._prelaunched.pop(id(steps), None)
            if launched is None:
                live = []
                for step in steps:
                    if step.after is not None:  # its token: what its predecessor's pass drew
                        token = _drawn(step.after)
                        if token is None:
                            step.skipped = True
                            continue
                        step.tokens = [token]
                    live.append(step)
                if not (self.device_feed and self.runner.can_launch(live)):
                    out = iter(self.runner.run(live) if live else ())
                    return [SKIPPED if step.skipped else next(out) for step in steps]
                launched = self.runner.launch(live)
            fed = self._launch_next(launched)
            out = iter(self.runner.finish(launched))
            for step in fed:  # their ids came on the device; the host learns them now
                assert step.after is not None
                step.tokens = [step.after.argmax]
            return [SKIPPED if step.skipped else next(out) for step in steps]

    # -- the device feed ----------------------------------------------------------------------
    def _unqueue(self, steps: list[StepInput]) -> None:
        with self._queue_cv:
            for i, queued in enumerate(self._queued):
                if queued is steps:
                    del self._queued[i]
                    return

    def _launch_next(self, launched: Any) -> list[StepInput]:
        """While ``launched`` runs on the device, launch the next pass handed to the worker
        if its tokens are ``launched``'s argmax (or already known): its ids are taken on
        the device, so the device goes from one pass to the next without waiting for the
        host to read the tokens and build the next pass. Returns the steps fed so."""
        nxt = self._next_queued(launched)
        if nxt is None:
            return []
        rows = {id(s): i for i, s in enumerate(launched.steps)}
        fed_rows: list[tuple[int, int]] = []
        known: list[tuple[StepInput, int]] = []
        for i, step in enumerate(nxt):
            before = step.after
            if before is None:
                continue
            row = rows.get(id(before))
            if row is None:  # an earlier pass's token, on the host already (as _run takes it)
                token = _drawn(before)
                if token is None:
                    return []
                known.append((step, token))
            elif before.sample is not None:
                return []  # a sampled token is drawn on the host side: no feed
            else:
                fed_rows.append((i, row))
        if not self.runner.can_launch(nxt):
            return []
        for step, token in known:
            step.tokens = [token]
        fed = [nxt[i] for i, _ in fed_rows]
        for step in fed:
            step.tokens = [-1]  # its id comes on the device
        try:
            self._prelaunched[id(nxt)] = self.runner.launch(nxt, launched, fed_rows)
        except Exception:  # it runs as usual when its turn comes
            log.exception("launching a decode pass ahead of its tokens failed; it runs in turn")
            return []
        self.stats.fed_passes += 1
        return fed

    def _next_queued(self, launched: Any) -> list[StepInput] | None:
        """The next pass handed to the worker, waiting for the loop to hand it over while
        ``launched`` still runs on the device (CUDA: at most 50 ms), else ``feed_wait_s``."""
        cuda = self.runner.device.type == "cuda"
        cap = time.monotonic() + (0.05 if cuda else self.feed_wait_s)
        with self._queue_cv:
            while not self._queued:
                now = time.monotonic()
                if now >= cap or (cuda and launched.done()):
                    return None
                self._queue_cv.wait(0.0002 if cuda else cap - now)
            return self._queued[0]

    def _cut(self, loop: asyncio.AbstractEventLoop) -> list[tuple[StepInput, asyncio.Future]]:
        """The next pass's steps: every waiting one that fits, except steps whose
        predecessor (``StepInput.after``) is in no earlier pass yet."""
        queue = [(s, f) for s, f in self._pending.pop(loop, []) if not f.done()]
        batch, rest, rows = [], [], 0
        for item in queue:
            n = len(item[0].tokens)
            early = item[0].after is not None and not item[0].after.dispatched
            if early or (batch and rows + n > self.max_batch_rows):
                rest.append(item)
            else:
                batch.append(item)
                rows += n
        if rest:
            self._pending[loop] = rest
        return batch

    def _may_overlap(
        self, loop: asyncio.AbstractEventLoop, running: list[tuple[StepInput, asyncio.Future]]
    ) -> bool:
        """Whether to cut the next pass while ``running`` runs: only when every step in it
        already has its successor waiting (submitted ahead of its token). A step without
        one (a prefill chunk, a decode step outside the overlap) gets its successor once
        the pass answers, and cutting earlier would leave that successor a pass behind: a
        chunked prefill would take every other pass instead of every pass."""
        followed = {
            id(s.after) for s, f in self._pending.get(loop, ()) if s.after is not None and not f.done()
        }
        return bool(followed) and all(id(s) in followed or f.done() for s, f in running)

    def _may_be_followed(
        self, loop: asyncio.AbstractEventLoop, running: list[tuple[StepInput, asyncio.Future]]
    ) -> bool:
        """Whether the running pass holds steps submitted ahead of their tokens (``after``)
        that its caller still waits for, and not all of its steps have successors waiting
        yet (``_may_overlap`` would cut them beside it once they have)."""
        return any(s.after is not None and not f.done() for s, f in running) and not self._may_overlap(
            loop, running
        )

    async def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        running: deque[tuple[list[tuple[StepInput, asyncio.Future]], asyncio.Future, list[float]]] = deque()
        try:
            await asyncio.sleep(0)  # let every ready task submit its step first
            while True:
                # Hand the worker the next pass: at once when none runs, and beside a
                # running one only when steps submitted ahead of their tokens wait.
                while self._pending.get(loop) and (
                    not running or (len(running) < 2 and self._may_overlap(loop, running[-1][0]))
                ):
                    batch = self._cut(loop)
                    if not batch:
                        break
                    for step, _ in batch:
                        step.dispatched = True
                    if running:
                        self.stats.overlapped_passes += 1
                    steps = [s for s, _ in batch]
                    with self._queue_cv:  # always, so the queue is right whenever the feed is switched on
                        self._queued.append(steps)
                        self._queue_cv.notify()
                    ended: list[float] = []
                    running.append(
                        (batch, loop.run_in_executor(self._executor, self._run_timed, steps, ended), ended)
                    )
                if not running:
                    if not self._pending.get(loop):
                        break
                    # Only steps whose predecessor was dropped before its pass wait: they
                    # will never get a token, so the next cut takes them and _run skips them.
                    for step, _ in self._pending.get(loop, ()):
                        if step.after is not None and not step.after.dispatched:
                            step.after.skipped = step.after.dispatched = True
                    continue
                head = running[0]
                if len(running) == 1 and self._may_be_followed(loop, head[0]):
                    # Its steps were submitted ahead (staged passes) and their successors
                    # are still to come: a hand-built pass stages the next when it claims
                    # the staged one, while that one runs. Cut them beside it as they come
                    # (a waker ``enqueue`` resolves), not after it: the worker then goes
                    # from pass to pass without waiting for the host.
                    waker = self._wakers[loop] = loop.create_future()
                    head[1].add_done_callback(lambda _, w=waker: w.done() or w.set_result(None))
                    await waker
                    self._wakers.pop(loop, None)
                    if not head[1].done():
                        continue
                batch, pending, ended = running.popleft()
                try:
                    results = await pending
                except Exception as e:  # a failed pass fails the steps in it, not the loop
                    for _, f in batch:
                        if not f.done():
                            f.set_exception(e)
                    continue
                if ended and step_timing.TIMING.on:
                    step_timing.TIMING.add(
                        "loop: hop from the worker's pass end (waits included)",
                        time.perf_counter() - ended[0],
                    )
                t0 = step_timing.start()
                self.stats.passes += 1
                self.stats.steps += len(batch)
                self.stats.max_steps_in_pass = max(self.stats.max_steps_in_pass, len(batch))
                for (_, f), r in zip(batch, results, strict=True):
                    if not f.done():
                        f.set_result(r)
                step_timing.stop("loop: hand results to the contexts", t0)
                # Let the steps just answered run to their next submission before the next
                # cut: without this, streams that are out of phase by one pass ping-pong
                # (each pass serving one of them) instead of sharing passes.
                await asyncio.sleep(0)
        finally:
            self._serving.discard(loop)
            self._wakers.pop(loop, None)


def _drawn(step: StepInput) -> int | None:
    """The token ``step``'s pass drew for its row, on the host, or None when there is none
    (its pass has not run, failed to sample it, or it was skipped)."""
    if not step.dispatched or step.skipped:
        return None
    return step.sampled if step.sample is not None else step.argmax


def _switch(name: str, device: torch.device) -> bool:
    """``name=1`` / ``0`` in the environment forces a switch on / off; unset, it is on for
    a CUDA device."""
    forced = os.environ.get(name, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return device.type == "cuda"


def overlap_default(device: torch.device) -> bool:
    """``PIE_MEDIA_OVERLAP=1`` / ``0`` forces the overlap on / off; unset, it is on for a
    CUDA device and off on the CPU. Measured on the CPU (``bench/host_overhead.py``, tiny
    Qwen3-VL, 2 cores): 0.85-1.08x the plain loop's speed, slower at 32 contexts. The
    "device" there is the same CPU, and the worker's Python (index building, sampling's
    glue) and the loop's share one GIL, so there is little to hide and the switching costs.
    On a GPU the worker waits on the device without the GIL."""
    return _switch("PIE_MEDIA_OVERLAP", device)


def device_feed_default(device: torch.device) -> bool:
    """``PIE_MEDIA_DEVICE_FEED=1`` / ``0`` forces the device feed on / off; unset, it is
    on for a CUDA device. It acts only with the overlap, CUDA-graph decode and the runner's
    pass-wide argmax (greedy rows without penalties)."""
    return _switch("PIE_MEDIA_DEVICE_FEED", device)


def _nothing() -> None:
    return None
