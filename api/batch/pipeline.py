"""Reading, decoding and preparation ahead of the engine.

With ``workers >= 1`` each worker is a process (spawned: no copy of the parent's torch
threads) holding a weightless encoder; it takes a shard at a time, reads it sample by
sample and puts each prepared ``WorkItem`` (pickled) on one bounded queue, then a
``ShardEnd``. The queue's bound (``depth`` items) is what keeps memory flat: a worker
that is ahead waits. With ``workers == 0`` one thread does the same in this process
with the model's own ``prepare`` (tests, tiny jobs).

``items()`` yields the work as it comes (shards interleave when there are several
workers)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from api.batch.ledger import DoneIndex
from api.batch.preparation import Preparer
from api.batch.samples import ShardEnd, WorkItem
from api.batch.sources import Shard
from api.batch.spec import CaptionSpec

_STOP = b"stop"


def _done_lookup(index: DoneIndex, shard: str, spec: CaptionSpec) -> Callable[[str, str | None], int | None]:
    """Skippable before the engine: every prompt recorded (segment jobs are filtered
    record by record later: their segment count is known only once prepared)."""

    def lookup(key: str, h: str | None) -> int | None:
        if spec.segments or spec.scene_cuts:
            return None
        got = index.lookup(shard, key, h)
        if got is None:
            return None
        ids, errors = got
        if spec.prompt_field is None and not all((p, None) in ids for p in spec.prompts):
            return None
        return errors

    return lookup


def _read_shard(
    prep: Preparer, shard: Shard, index: DoneIndex, spec: CaptionSpec, put: Callable[[Any], None]
) -> None:
    lookup = _done_lookup(index, shard.id, spec)
    n = 0
    for sample in shard.samples():
        put(prep(sample, lookup))
        n += 1
    put(ShardEnd(shard.id, n))


def _worker(model_dir: str, spec: CaptionSpec, tasks: Any, results: Any, parent: int) -> None:
    """A preparation process. It leaves as soon as its parent is gone (a killed job must
    not leave workers behind): every wait on a queue is short and checks the parent."""
    import os

    import torch

    torch.set_num_threads(1)

    def orphaned() -> bool:
        return os.getppid() != parent

    def watchdog() -> None:  # also covers the exit's wait for the queue's feeder thread
        while not orphaned():
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watchdog, name="orphan-watchdog", daemon=True).start()

    def put(x: Any) -> None:
        data = x if isinstance(x, bytes) else pickle.dumps(x, protocol=5)
        while True:
            try:
                results.put(data, timeout=0.5)
                return
            except queue.Full:
                if orphaned():
                    os._exit(0)

    prep = Preparer.for_model_dir(model_dir, spec)
    while True:
        try:
            task = tasks.get(timeout=0.5)
        except queue.Empty:
            if orphaned():
                os._exit(0)
            continue
        if task is None:
            break
        shard, index = task
        try:
            _read_shard(prep, shard, index, spec, put)
        except BaseException as e:  # noqa: BLE001 - a reader bug must not hang the job
            put(("failed", shard.id, repr(e)))
    put(_STOP)


class Pipeline:
    def __init__(
        self,
        shards: list[Shard],
        index: DoneIndex,
        spec: CaptionSpec,
        *,
        workers: int,
        depth: int,
        model_dir: str | None = None,
        inline_prepare: Preparer | None = None,
    ):
        self.shards, self.index, self.spec = shards, index, spec
        self.workers, self.depth = workers, max(1, depth)
        self.model_dir, self.inline_prepare = model_dir, inline_prepare
        self.waited_s = 0.0
        """Time the consumer spent waiting on an empty queue."""

    async def items(self) -> AsyncIterator[WorkItem | ShardEnd]:
        if not self.shards:
            return
        if self.workers == 0:
            async for x in self._inline():
                yield x
        else:
            async for x in self._processes():
                yield x

    async def _inline(self) -> AsyncIterator[WorkItem | ShardEnd]:
        assert self.inline_prepare is not None
        q: queue.Queue[Any] = queue.Queue(self.depth)
        stop = threading.Event()

        def put(x: Any) -> None:
            while not stop.is_set():
                try:
                    q.put(x, timeout=0.2)
                    return
                except queue.Full:
                    continue
            raise SystemExit

        def run() -> None:
            try:
                for shard in self.shards:
                    _read_shard(self.inline_prepare, shard, self.index.for_shard(shard.id), self.spec, put)
            except SystemExit:
                return
            except BaseException as e:  # noqa: BLE001
                with contextlib.suppress(SystemExit):
                    put(("failed", "", repr(e)))
            with contextlib.suppress(SystemExit):
                put(_STOP)

        t = threading.Thread(target=run, name="batch-prepare", daemon=True)
        t.start()
        try:
            while True:
                x = await self._get(q.get_nowait, q.get)
                if x is _STOP:
                    return
                if isinstance(x, tuple):
                    raise RuntimeError(f"reading shard {x[1]} failed: {x[2]}")
                yield x
        finally:
            stop.set()
            t.join(timeout=10)

    async def _get(self, nowait: Callable[[], Any], blocking: Callable[[], Any]) -> Any:
        try:
            return nowait()
        except queue.Empty:
            pass
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        x = await asyncio.to_thread(blocking)
        self.waited_s += loop.time() - t0
        return x

    async def _processes(self) -> AsyncIterator[WorkItem | ShardEnd]:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        tasks = ctx.Queue()
        results = ctx.Queue(self.depth)
        n = min(self.workers, len(self.shards))
        for shard in self.shards:
            tasks.put((shard, self.index.for_shard(shard.id)))
        for _ in range(n):
            tasks.put(None)
        procs = [
            ctx.Process(
                target=_worker, args=(self.model_dir, self.spec, tasks, results, os.getpid()), daemon=True
            )
            for _ in range(n)
        ]
        for p in procs:
            p.start()
        stopped = 0
        try:
            while stopped < n:
                raw = await self._get(results.get_nowait, results.get)
                if raw == _STOP:
                    stopped += 1
                    continue
                x = pickle.loads(raw)
                if isinstance(x, tuple):
                    raise RuntimeError(f"reading shard {x[1]} failed: {x[2]}")
                yield x
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
            results.cancel_join_thread()
            tasks.cancel_join_thread()
