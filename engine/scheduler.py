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
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine import step_timing
from engine.forward import ForwardRunner, StepInput

SKIPPED = object()
"""The result of an ``after`` step whose token never came (``StepInput.skipped``)."""


@dataclass
class SchedulerStats:
    passes: int = 0
    steps: int = 0
    max_steps_in_pass: int = 0
    overlapped_passes: int = 0
    """Passes handed to the worker while the one before was still running."""


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

    async def submit(self, step: StepInput) -> torch.Tensor | None:
        return await self.enqueue(step)

    def enqueue(self, step: StepInput) -> asyncio.Future:
        """``submit`` without waiting: the future of the step's result (cancel it to drop
        the step while it still waits for a pass)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._pending.setdefault(loop, []).append((step, fut))
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
            live = []
            for step in steps:
                if step.after is not None:  # its token: what its predecessor's pass drew
                    before = step.after
                    token = before.sampled if before.sample is not None else before.argmax
                    if token is None or not before.dispatched or before.skipped:
                        step.skipped = True
                        continue
                    step.tokens = [token]
                live.append(step)
            out = iter(self.runner.run(live) if live else ())
            return [SKIPPED if step.skipped else next(out) for step in steps]

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


def overlap_default(device: torch.device) -> bool:
    """``PIE_MEDIA_OVERLAP=1`` / ``0`` forces the overlap on / off; unset, it is on for a
    CUDA device and off on the CPU. Measured on the CPU (``bench/host_overhead.py``, tiny
    Qwen3-VL, 2 cores): 0.85-1.08x the plain loop's speed, slower at 32 contexts. The
    "device" there is the same CPU, and the worker's Python (index building, sampling's
    glue) and the loop's share one GIL, so there is little to hide and the switching costs.
    On a GPU the worker waits on the device without the GIL."""
    forced = os.environ.get("PIE_MEDIA_OVERLAP", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return device.type == "cuda"


def _nothing() -> None:
    return None
