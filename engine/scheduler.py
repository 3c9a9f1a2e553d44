"""Batch the forward passes of all live contexts (continuous batching, asyncio).

A context that needs a forward pass ``await scheduler.submit(step)``. The first
submission in a loop iteration schedules one drain with ``loop.call_soon``; every task
that is ready in that iteration (the other contexts' decode steps, prefill chunks)
submits before the drain runs, so concurrent generations share one pass per token.
The drain runs the batch synchronously on the loop thread and resolves each future.

Work is bounded per pass by ``max_batch_rows``: steps that do not fit wait for the next
pass (a step is never split here; contexts chunk their own prefill and never split a
media span).
"""

from __future__ import annotations

import asyncio
import threading
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
        self._scheduled: set[asyncio.AbstractEventLoop] = set()
        self._lock = threading.Lock()  # one forward pass at a time per model
        self.stats = SchedulerStats()

    async def submit(self, step: StepInput) -> torch.Tensor | None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._pending.setdefault(loop, []).append((step, fut))
        if loop not in self._scheduled:
            self._scheduled.add(loop)
            loop.call_soon(self._drain, loop)
        return await fut

    def run_now(self, steps: list[StepInput]) -> list[torch.Tensor | None]:
        """Run steps immediately (no batching with others); for synchronous callers."""
        with self._lock:
            return self.runner.run(steps)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduled.discard(loop)
        queue = [(s, f) for s, f in self._pending.pop(loop, []) if not f.cancelled()]
        while queue:
            batch, rows = [], 0
            rest = []
            for item in queue:
                n = len(item[0].tokens)
                if batch and rows + n > self.max_batch_rows:
                    rest.append(item)
                    continue
                batch.append(item)
                rows += n
            queue = rest
            try:
                with self._lock:
                    results = self.runner.run([s for s, _ in batch])
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
