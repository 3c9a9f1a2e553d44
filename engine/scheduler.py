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
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.forward import ForwardRunner, StepInput


@dataclass
class SchedulerStats:
    passes: int = 0
    steps: int = 0
    max_steps_in_pass: int = 0


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

    async def submit(self, step: StepInput) -> torch.Tensor | None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._pending.setdefault(loop, []).append((step, fut))
        if loop not in self._serving:
            self._serving.add(loop)
            task = loop.create_task(self._serve(loop))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await fut

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

    def _run(self, steps: list[StepInput]) -> list[torch.Tensor | None]:
        with self._lock:
            return self.runner.run(steps)

    def _cut(self, loop: asyncio.AbstractEventLoop) -> list[tuple[StepInput, asyncio.Future]]:
        queue = [(s, f) for s, f in self._pending.pop(loop, []) if not f.done()]
        batch, rest, rows = [], [], 0
        for item in queue:
            n = len(item[0].tokens)
            if batch and rows + n > self.max_batch_rows:
                rest.append(item)
            else:
                batch.append(item)
                rows += n
        if rest:
            self._pending[loop] = rest
        return batch

    async def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            await asyncio.sleep(0)  # let every ready task submit its step first
            while self._pending.get(loop):
                batch = self._cut(loop)
                if not batch:
                    continue
                try:
                    results = await loop.run_in_executor(self._executor, self._run, [s for s, _ in batch])
                except Exception as e:  # a failed pass fails the steps in it, not the loop
                    for _, f in batch:
                        if not f.done():
                            f.set_exception(e)
                    continue
                self.stats.passes += 1
                self.stats.steps += len(batch)
                self.stats.max_steps_in_pass = max(self.stats.max_steps_in_pass, len(batch))
                for (_, f), r in zip(batch, results, strict=True):
                    if not f.done():
                        f.set_result(r)
                # Let the steps just answered run to their next submission before the next
                # cut: without this, streams that are out of phase by one pass ping-pong
                # (each pass serving one of them) instead of sharing passes.
                await asyncio.sleep(0)
        finally:
            self._serving.discard(loop)


def _nothing() -> None:
    return None
